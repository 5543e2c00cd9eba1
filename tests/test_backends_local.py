"""The local backend on a tiny random model: on-policy logprobs, sampling controls, PPO gradients,
micro-batch accumulation, and save/load in a fresh process."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from retool.backends.interface.types import AdamParams, Datum, Sample, SamplingParams
from retool.backends.local.client import LocalTrainingClient

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models run several times faster on one thread when the CPU is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path) -> LocalTrainingClient:
    return LocalTrainingClient(tiny_model_dir, lora=None, device="cpu", seed=0, sample_batch_size=16)


def _prompt(client: LocalTrainingClient, text: str) -> list[int]:
    return client.tokenizer.encode(text, add_special_tokens=False)


def _rl_datum(prompt: list[int], sample: Sample, advantage: float, weight: float = 1.0) -> Datum:
    seq = prompt + sample.tokens
    n_prompt = len(prompt) - 1
    n = len(sample.tokens)
    return Datum(
        input_tokens=seq[:-1],
        target_tokens=seq[1:],
        logprobs=[0.0] * n_prompt + list(sample.logprobs),
        advantages=[0.0] * n_prompt + [advantage] * n,
        weights=[0.0] * n_prompt + [weight] * n,
    )


def _recomputed_logprobs(client: LocalTrainingClient, prompt: list[int], tokens: list[int]) -> list[float]:
    seq = prompt + tokens
    ids = torch.tensor([seq[:-1]])
    tgt = torch.tensor([seq[1:]])
    with torch.no_grad():
        lp = client.target_logprobs(ids, torch.ones_like(ids), tgt)[0]
    return lp[len(prompt) - 1 :].tolist()


# -- sampling ----------------------------------------------------------------------------------------


def test_on_policy_logprobs_match_trainer(client: LocalTrainingClient) -> None:
    prompts = [_prompt(client, t) for t in ("Solve the problem.", "print(2**10)", "42")]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=3)

    async def run() -> list[list[Sample]]:
        sampler = await client.sampling_client_async()
        return await asyncio.gather(*[sampler.sample_async(p, 2, params) for p in prompts])

    groups = asyncio.run(run())  # different prompt lengths in one left-padded batch
    datums = []
    worst = 0.0
    for prompt, samples in zip(prompts, groups, strict=True):
        assert len(samples) == 2
        for s in samples:
            assert len(s.tokens) == len(s.logprobs) > 0
            ref = _recomputed_logprobs(client, prompt, s.tokens)
            worst = max(worst, max(abs(a - b) for a, b in zip(ref, s.logprobs, strict=True)))
            datums.append(_rl_datum(prompt, s, advantage=1.0))
    assert worst < 1e-4
    res = client.forward(datums, "ppo")
    assert res.trained_tokens == sum(len(s.tokens) for g in groups for s in g)
    assert abs(res.ratio_mean - 1) < 1e-4 and abs(res.ratio_min - 1) < 1e-4 and abs(res.ratio_max - 1) < 1e-4
    assert res.clip_fraction == 0.0


def test_greedy_sampling_picks_argmax(client: LocalTrainingClient) -> None:
    prompt = _prompt(client, "for i in range(5):")
    [s] = client.sample(prompt, 1, SamplingParams(max_tokens=8, temperature=0.0))
    seq = prompt + s.tokens
    with torch.no_grad():
        logits = client.model(input_ids=torch.tensor([seq])).logits[0]
    argmax = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    assert s.tokens == argmax


def test_top_k_1_and_tiny_top_p_are_greedy(client: LocalTrainingClient) -> None:
    prompt = _prompt(client, "Solve the problem.")
    [greedy] = client.sample(prompt, 1, SamplingParams(max_tokens=10, temperature=0.0))
    [k1] = client.sample(prompt, 1, SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=4))
    [p0] = client.sample(prompt, 1, SamplingParams(max_tokens=10, temperature=1.5, top_p=1e-6, seed=4))
    [free] = client.sample(prompt, 1, SamplingParams(max_tokens=10, temperature=1.5, seed=4))
    assert k1.tokens == greedy.tokens == p0.tokens
    assert free.tokens != greedy.tokens  # a random model at temperature 1.5 is not greedy
    # logprobs stay raw (unaffected by temperature / filtering)
    assert k1.logprobs == pytest.approx(greedy.logprobs, abs=1e-5)


def test_missing_model_path_is_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LocalTrainingClient(str(tmp_path / "nope"), device="cpu")


def test_model_name_tiny_is_built_once_into_the_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import retool.backends
    from retool.backends import resolve_model_name
    from retool.config import load_config

    built: list[tuple[Path, str, int]] = []

    def fake_build(out_dir: Path, size: str = "test", seed: int = 0, **_: object) -> Path:
        built.append((Path(out_dir), size, seed))
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "config.json").write_text("{}")
        return Path(out_dir)

    monkeypatch.setattr(retool.backends, "build_tiny_model", fake_build)
    monkeypatch.chdir(tmp_path)
    cfg = load_config("tiny", [f'train.run_dir="{tmp_path / "run"}"'])
    folder = tmp_path / "run" / "tiny_model"
    assert resolve_model_name(cfg) == str(folder)
    assert resolve_model_name(cfg) == str(folder)  # found, not rebuilt
    assert built == [(folder, "demo", 0)]
    assert resolve_model_name(load_config("tiny", ["model.name='/models/x'"])) == "/models/x"
    (tmp_path / "tiny").mkdir()  # a folder literally named "tiny" is a model path like any other
    assert resolve_model_name(cfg) == "tiny"


def test_seeds_are_reproducible_and_independent_of_batch(client: LocalTrainingClient) -> None:
    prompt = _prompt(client, "Solve the problem.")
    other = _prompt(client, "Traceback (most recent call last):")
    params = SamplingParams(max_tokens=16, seed=11)
    alone = client.sample(prompt, 3, params)

    async def crowded() -> list[list[Sample]]:
        sampler = await client.sampling_client_async()
        return await asyncio.gather(
            sampler.sample_async(other, 5, SamplingParams(max_tokens=30, seed=1)),
            sampler.sample_async(prompt, 3, params),
            sampler.sample_async(other, 2, SamplingParams(max_tokens=3)),
        )

    together = asyncio.run(crowded())[1]
    assert [s.tokens for s in alone] == [s.tokens for s in together]
    assert len({tuple(s.tokens) for s in alone}) == 3  # each sample of a request has its own stream
    different = client.sample(prompt, 1, SamplingParams(max_tokens=16, seed=12))
    assert different[0].tokens != alone[0].tokens


def test_concurrent_requests_are_batched(
    client: LocalTrainingClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    original = client.engine.submit

    def spy(requests):  # type: ignore[no-untyped-def]
        calls.append(len(requests))
        return original(requests)

    monkeypatch.setattr(client.engine, "submit", spy)
    client.engine.peak_rows = 0
    prompt = _prompt(client, "42")

    async def run() -> list[list[Sample]]:
        sampler = await client.sampling_client_async()
        return await asyncio.gather(
            *[sampler.sample_async(prompt, 2, SamplingParams(max_tokens=4, seed=i)) for i in range(6)]
        )

    out = asyncio.run(run())
    assert [len(x) for x in out] == [2] * 6
    assert calls == [12]  # six requests gathered into one submission (sample_batch_size=16)
    assert client.engine.peak_rows == 12  # and decoded together


def test_max_tokens_gives_length(client: LocalTrainingClient) -> None:
    prompt = _prompt(client, "Solve")
    samples = client.sample(prompt, 4, SamplingParams(max_tokens=5, seed=0))
    for s in samples:
        assert len(s.tokens) <= 5
        if len(s.tokens) == 5 and s.tokens[-1] not in client.eos_ids:
            assert s.stop_reason == "length"
    assert client.sample(prompt, 1, SamplingParams(max_tokens=0))[0] == Sample([], [], "length")


def test_stop_token_ids_and_strings(client: LocalTrainingClient) -> None:
    prompt = _prompt(client, "print(sum(range(10)))")
    base = SamplingParams(max_tokens=40, seed=5, temperature=1.0)
    [free] = client.sample(prompt, 1, base)
    assert len(free.tokens) >= 6, "the tiny model ended too early for this test"
    k = 4
    stop_tok = free.tokens[k]
    first = free.tokens.index(stop_tok)
    [by_id] = client.sample(prompt, 1, SamplingParams(max_tokens=40, seed=5, stop=(stop_tok,)))
    assert by_id.tokens == free.tokens[: first + 1]  # the stop token is included
    assert by_id.stop_reason == "stop"
    assert by_id.logprobs == pytest.approx(free.logprobs[: first + 1], abs=1e-6)

    tok = client.tokenizer
    # A stop string made of the decoded text of two consecutive tokens: generation must end as soon as the
    # decoded completion contains it, keeping the tokens that produced it.
    k = next(j for j in range(3, len(free.tokens) - 1) if tok.decode(free.tokens[j : j + 2]).strip())
    stop_text = tok.decode(free.tokens[k : k + 2])
    [by_str] = client.sample(prompt, 1, SamplingParams(max_tokens=40, seed=5, stop=(stop_text,)))
    assert by_str.stop_reason == "stop"
    text = tok.decode(by_str.tokens)
    assert stop_text in text
    assert stop_text not in tok.decode(by_str.tokens[:-1])  # stopped at the first token completing it
    assert by_str.tokens == free.tokens[: len(by_str.tokens)]


def test_bad_requests_are_rejected(client: LocalTrainingClient) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        client.sample([10**7], 1, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="empty"):
        client.sample([], 1, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="num_samples"):
        client.sample([1, 2], 0, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="needs logprobs and advantages"):
        client.forward([Datum([1, 2], [2, 3])], "ppo")
    with pytest.raises(ValueError, match="unknown loss_fn"):
        client.forward([Datum([1, 2], [2, 3])], "dpo")  # type: ignore[arg-type]


# -- training ----------------------------------------------------------------------------------------


def _grads(client: LocalTrainingClient) -> list[torch.Tensor]:
    return [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for p in client.trainable_parameters()
    ]


def _zero(client: LocalTrainingClient) -> None:
    for p in client.trainable_parameters():
        p.grad = None


def _synthetic_datums(seed: int, lengths: list[int], vocab: int) -> list[Datum]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        seq = torch.randint(5, vocab, (n + 1,), generator=g).tolist()
        n_prompt = max(1, n // 3)
        lp = (-torch.rand(n, generator=g) * 6).tolist()
        adv = float(torch.randn((), generator=g))
        out.append(
            Datum(
                seq[:-1],
                seq[1:],
                logprobs=[0.0] * n_prompt + lp[n_prompt:],
                advantages=[0.0] * n_prompt + [adv] * (n - n_prompt),
                weights=[0.0] * n_prompt + [1.0] * (n - n_prompt),
            )
        )
    return out


def test_ppo_model_gradient_matches_per_token_reference(tiny_model_dir: Path) -> None:
    c = LocalTrainingClient(tiny_model_dir, lora=None, device="cpu", seed=0)
    prompt = _prompt(c, "Solve the problem.")
    samples = c.sample(prompt, 2, SamplingParams(max_tokens=12, seed=7))
    datums = []
    # Shift the sampler logprobs so that ratios land below, inside and above [0.8, 1.28].
    shifts = [-0.6, -0.1, 0.0, 0.1, 0.6]
    for k, (s, adv) in enumerate(zip(samples, (1.5, -1.5), strict=True)):
        shifted = Sample(
            s.tokens, [lp + shifts[(j + k) % 5] for j, lp in enumerate(s.logprobs)], s.stop_reason
        )
        datums.append(_rl_datum(prompt, shifted, advantage=adv, weight=0.5 + k))
    res = c.forward_backward(datums, "ppo")
    got = _grads(c)
    _zero(c)

    # Reference: per-token Python arithmetic on each token's logprob, one datum at a time.
    total = 0.0
    n_clipped = 0
    n_trained = 0
    for d in datums:
        ids = torch.tensor([d.input_tokens])
        logits = c.model(input_ids=ids).logits[0].float()
        lps = torch.log_softmax(logits, -1)
        loss = torch.zeros(())
        for j, t in enumerate(d.target_tokens):
            if d.weights[j] == 0:
                continue
            n_trained += 1
            lp = lps[j, t]
            r = torch.exp(lp - d.logprobs[j])
            a = d.advantages[j]
            rv = float(r.detach())
            if (a > 0 and rv > 1.28) or (a < 0 and rv < 0.8):
                term = min(max(rv, 0.8), 1.28) * a + 0 * lp  # clipped: constant in lp
                n_clipped += 1
            else:
                term = r * a
            loss = loss - d.weights[j] * term
        loss.backward()
        total += float(loss.detach())
    ref = _grads(c)
    _zero(c)
    assert n_clipped > 0 and n_clipped < n_trained
    assert res.loss == pytest.approx(total, rel=1e-5)
    assert res.clip_fraction == pytest.approx(n_clipped / n_trained)
    scale = max(float(g.abs().max()) for g in ref)
    assert scale > 0
    for a, b in zip(got, ref, strict=True):
        # batched (padded) vs one-at-a-time forward passes differ by float32 rounding only
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}])
def test_micro_batches_accumulate_to_full_batch_gradient(tiny_model_dir: Path, lora: dict | None) -> None:
    c = LocalTrainingClient(tiny_model_dir, lora=lora, device="cpu", seed=0)
    if lora is not None:  # LoRA B starts at zero; make it non-zero so every LoRA matrix has a gradient
        with torch.no_grad():
            for name, p in c.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    # Four groups of two trajectories; group 1 is "degenerate" and skipped. The loop's weights average
    # over trained datums (6) and each datum's trained tokens.
    all_datums = _synthetic_datums(1, [9, 14, 20, 6, 31, 11, 17, 25], c.vocab_size)
    kept = [d for k, d in enumerate(all_datums) if k // 2 != 1]
    datums = []
    for d in kept:
        n_tr = sum(1 for w in d.weights if w)
        w = [x / n_tr / len(kept) for x in d.weights]
        datums.append(Datum(d.input_tokens, d.target_tokens, d.logprobs, d.advantages, w))
    for loss_fn in ("ppo", "cross_entropy"):
        c.micro_batch_tokens = 40  # many micro-batches
        small = c.forward_backward(datums, loss_fn)
        g_small = _grads(c)
        _zero(c)
        c.micro_batch_tokens = 10_000  # one batch
        full = c.forward_backward(datums, loss_fn)
        g_full = _grads(c)
        _zero(c)
        assert small.extra["micro_batches"] > 2 and full.extra["micro_batches"] == 1
        assert small.loss == pytest.approx(full.loss, rel=1e-5)
        assert small.trained_tokens == full.trained_tokens
        assert any(g.abs().sum() > 0 for g in g_full)
        for a, b in zip(g_small, g_full, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_training_forwards_autocast_when_asked_and_sampling_never(tiny_model_dir: Path) -> None:
    from retool.backends.local.client import autocast_dtype

    c = LocalTrainingClient(tiny_model_dir, lora=None, device="cpu", seed=0)
    datums = _synthetic_datums(3, [12, 20], c.vocab_size)
    fp32 = c.forward(datums, "cross_entropy")
    c.train_autocast = torch.bfloat16
    bf16 = c.forward(datums, "cross_entropy")
    c.forward_backward(datums, "cross_entropy")
    grads = _grads(c)
    _zero(c)
    prompt = _prompt(c, "Solve the problem.")
    greedy = c.sample(prompt, 1, SamplingParams(max_tokens=8, temperature=0.0))[0]
    c.train_autocast = None
    assert bf16.loss != fp32.loss and bf16.loss == pytest.approx(fp32.loss, rel=2e-2)  # bf16 rounding only
    assert all(g.dtype == torch.float32 for g in grads) and any(g.abs().sum() > 0 for g in grads)
    assert c.sample(prompt, 1, SamplingParams(max_tokens=8, temperature=0.0))[0].logprobs == greedy.logprobs
    assert autocast_dtype("off", torch.device("cpu")) is None
    assert autocast_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert autocast_dtype("auto", torch.device("cpu")) is (torch.bfloat16 if native else None)
    with pytest.raises(ValueError, match="off, bfloat16 or auto"):
        autocast_dtype("fp8", torch.device("cpu"))


def test_optim_step_changes_weights_and_clips(tiny_model_dir: Path) -> None:
    c = LocalTrainingClient(tiny_model_dir, lora=None, device="cpu", seed=0)
    datums = _synthetic_datums(2, [12, 18], c.vocab_size)
    before = [p.detach().clone() for p in c.trainable_parameters()]
    c.forward_backward(datums, "cross_entropy")
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in c.trainable_parameters() if p.grad is not None))
    res = c.optim_step(AdamParams(lr=1e-3, grad_clip_norm=1e-3))
    assert res.grad_norm == pytest.approx(norm, rel=1e-4)
    assert c.step == 1
    assert all(p.grad is None for p in c.trainable_parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, c.trainable_parameters(), strict=True))
    loss_before = c.forward(datums, "cross_entropy").loss
    for _ in range(3):
        c.forward_backward(datums, "cross_entropy")
        c.optim_step(AdamParams(lr=1e-2))
    assert c.forward(datums, "cross_entropy").loss < loss_before


_RESUME_SCRIPT = r"""
import json, sys
import torch
torch.set_num_threads(int(sys.argv[4]))  # same thread count as the parent: bitwise-equal float sums
from retool.backends.local.client import LocalTrainingClient
from retool.backends.interface.types import AdamParams, SamplingParams
sys.path.insert(0, sys.argv[3])
from test_backends_local import _synthetic_datums, _LORA
c = LocalTrainingClient(sys.argv[1], lora=_LORA, device="cpu", seed=123)  # a different seed: state must win
c.load_state(sys.argv[2])
datums = _synthetic_datums(5, [10, 16, 7], c.vocab_size)
out = {"step": c.step}
out["loss3"] = c.forward_backward(datums, "ppo").loss
out["gn3"] = c.optim_step(AdamParams(lr=1e-2)).grad_norm
out["loss4"] = c.forward(datums, "ppo").loss
out["unseeded"] = c.sample([5, 6, 7], 2, SamplingParams(max_tokens=6))[1].tokens
print(json.dumps(out))
"""

_LORA = {"rank": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}


def test_save_then_load_in_fresh_process_reproduces_next_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    c = LocalTrainingClient(tiny_model_dir, lora=_LORA, device="cpu", seed=0, checkpoint_dir=tmp_path)
    datums = _synthetic_datums(5, [10, 16, 7], c.vocab_size)
    for _ in range(2):
        c.forward_backward(datums, "ppo")
        c.optim_step(AdamParams(lr=1e-2))
    path = c.save_state("step2")
    assert Path(path) == tmp_path / "step2"
    assert (Path(path) / "adapter_model.safetensors").is_file()
    # lora dropout 0.1 makes the next step depend on the restored RNG state too
    expected = {"step": 2}
    expected["loss3"] = c.forward_backward(datums, "ppo").loss
    expected["gn3"] = c.optim_step(AdamParams(lr=1e-2)).grad_norm
    expected["loss4"] = c.forward(datums, "ppo").loss
    expected["unseeded"] = c.sample([5, 6, 7], 2, SamplingParams(max_tokens=6))[1].tokens
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _RESUME_SCRIPT,
            str(tiny_model_dir),
            path,
            str(REPO / "tests"),
            str(torch.get_num_threads()),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == expected


def test_loading_a_state_saved_before_any_step_starts_again_from_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Expert iteration trains every round from the start's state: loading it restores the weights and
    leaves no optimizer moments of the steps taken since (the next step is the first step again)."""
    c = LocalTrainingClient(tiny_model_dir, lora=None, device="cpu", seed=0, checkpoint_dir=tmp_path)
    datums = _synthetic_datums(2, [12, 18], c.vocab_size)
    start = c.save_state("start")
    first = []
    for _ in range(2):
        c.forward_backward(datums, "cross_entropy")
        c.optim_step(AdamParams(lr=1e-2))
        first.append(c.forward(datums, "cross_entropy").loss)
    c.load_state(start)
    assert c.step == 0 and c.optimizer is None
    again = []
    for _ in range(2):
        c.forward_backward(datums, "cross_entropy")
        c.optim_step(AdamParams(lr=1e-2))
        again.append(c.forward(datums, "cross_entropy").loss)
    assert again == pytest.approx(first, rel=1e-5)


def test_load_state_rejects_mismatch(tiny_model_dir: Path, tmp_path: Path) -> None:
    c = LocalTrainingClient(tiny_model_dir, lora=None, device="cpu", seed=0, checkpoint_dir=tmp_path)
    path = c.save_state("s0")
    other = LocalTrainingClient(tiny_model_dir, lora=_LORA, device="cpu", seed=0)
    with pytest.raises(ValueError, match="saved with lora"):
        other.load_state(path)
    with pytest.raises(FileNotFoundError):
        other.load_state(str(tmp_path / "missing"))


def test_make_training_client_local(tiny_model_dir: Path, tmp_path: Path) -> None:
    from retool.backends import make_training_client
    from retool.config import load_config

    cfg = load_config(
        None,
        [
            f'model.name="{tiny_model_dir}"',
            "lora.rank=4",
            "lora.alpha=8",
            f'train.run_dir="{tmp_path}"',
            "backend.micro_batch_tokens=64",
            "backend.cpu_threads=1",
        ],
    )
    c = make_training_client(cfg)
    assert isinstance(c, LocalTrainingClient)
    assert c.lora is not None and c.lora.rank == 4
    assert c.micro_batch_tokens == 64
    assert c.dtype == torch.float32
    assert c.checkpoint_dir == tmp_path / "checkpoints"


def test_gguf_paths_and_device_dtype_resolution() -> None:
    from retool.backends.local.client import resolve_dtype, split_model_path

    assert split_model_path("/models/q/qwen-0.5b-q8_0.gguf", None) == ("/models/q", "qwen-0.5b-q8_0.gguf")
    assert split_model_path("/models/q", "x.gguf") == ("/models/q", "x.gguf")
    assert split_model_path("Qwen/Qwen2.5-0.5B-Instruct", None) == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", torch.device("cpu"))


def test_lora_sampling_view_is_merged_shared_and_follows_each_step(tiny_model_dir: Path) -> None:
    """With LoRA, generation runs on a plain copy whose adapted linears hold W + scale * B @ A: same
    greedy tokens and (to float rounding) the same logprobs as the PEFT wrapper; every other tensor is
    the trainer's own; the copy follows the weights after each optim_step."""
    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    c = LocalTrainingClient(tiny_model_dir, lora=lora, device="cpu", seed=0, sample_batch_size=8)
    try:
        with torch.no_grad():  # a trained adapter (B != 0): the merged weights really differ from W
            for name, p in c.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.2)
        c._weights_version += 1
        prompt = _prompt(c, "What is 3 + 4? Use the tool.")
        greedy = SamplingParams(max_tokens=10, temperature=0.0, seed=0)

        def both() -> tuple[Sample, Sample]:
            c.merge_lora_for_sampling = True
            merged = c.sample(prompt, 1, greedy)[0]
            c.merge_lora_for_sampling = False
            wrapped = c.sample(prompt, 1, greedy)[0]
            c.merge_lora_for_sampling = True
            return merged, wrapped

        merged, wrapped = both()
        assert merged.tokens == wrapped.tokens
        assert max(abs(a - b) for a, b in zip(merged.logprobs, wrapped.logprobs, strict=True)) < 1e-4
        view = c.sampling_model()
        assert not any("lora" in n for n, _ in view.named_parameters())
        live = dict(c.model.get_base_model().named_parameters())
        shared = [n for n, p in view.named_parameters() if any(p is q for q in live.values())]
        copied = [n for n, _ in view.named_parameters() if n not in shared]
        assert copied and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in copied)
        assert len(shared) == len(list(view.parameters())) - len(copied)

        # One optimizer step on a strongly weighted datum: the view must follow the new weights.
        sample = c.sample(prompt, 1, SamplingParams(max_tokens=6, seed=1))[0]
        c.forward_backward([_rl_datum(prompt, sample, advantage=5.0)], "importance_sampling")
        c.optim_step(AdamParams(lr=0.05))
        after_merged, after_wrapped = both()
        assert after_merged.tokens == after_wrapped.tokens
        assert (
            max(abs(a - b) for a, b in zip(after_merged.logprobs, after_wrapped.logprobs, strict=True)) < 1e-4
        )
        assert after_merged.logprobs != merged.logprobs
        assert c.stats.sampled_tokens > 0 and c.stats.trained_tokens > 0
    finally:
        c.close()


def test_shared_prompt_prefix_is_run_once_with_the_same_result(client: LocalTrainingClient) -> None:
    """Prompts with a long common prefix (a system prompt) and suffixes of different lengths: prefilling
    the prefix once and each suffix after it gives the tokens and logprobs of one full prefill per row."""
    from retool.backends.engine.generation import MIN_SHARED_PREFIX, shared_prefix_length

    system = _prompt(client, "Solve the problem. Use the code_interpreter tool when it helps. " * 3)
    assert len(system) > MIN_SHARED_PREFIX
    prompts = [system + _prompt(client, q) for q in ("What is 3+4?", "How many primes are below 97?", "7*8")]
    assert shared_prefix_length(prompts) >= len(system)
    assert shared_prefix_length([prompts[0], prompts[0]]) == len(prompts[0]) - 1  # a token of its own

    def run(share: bool, temperature: float) -> list[Sample]:
        client.share_prompt_prefix = share
        try:

            async def go() -> list[list[Sample]]:
                sampler = await client.sampling_client_async()
                return await asyncio.gather(
                    *[
                        sampler.sample_async(
                            p, 2, SamplingParams(max_tokens=8, temperature=temperature, seed=k)
                        )
                        for k, p in enumerate(prompts)
                    ]
                )

            return [s for group in asyncio.run(go()) for s in group]
        finally:
            client.share_prompt_prefix = True

    for temperature in (0.0, 1.0):
        shared, full = run(True, temperature), run(False, temperature)
        assert [s.tokens for s in shared] == [s.tokens for s in full]
        for a, b in zip(shared, full, strict=True):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
