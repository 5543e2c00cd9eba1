"""The local sampler's CPU fast paths, each pinned against the plain path it replaces: decode steps that
append KV in place (``_GrowingLayer``) give bitwise the same generations as concatenation; prepacked
oneDNN linears (``PackedLinear``) in the merged LoRA view give the plain linear's outputs to float
rounding, keep its parameters and state dict, and follow every weight change; the client's worker threads
run on the thread count it was given, also when the process's count changes later."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from retool.backends.engine import generation
from retool.backends.engine.generation import KV_SPARE_COLUMNS, _GrowingLayer
from retool.backends.interface.types import AdamParams, Datum, Sample, SamplingParams
from retool.backends.local.client import LocalTrainingClient
from retool.backends.local.packed_linear import PackedLinear, can_pack


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _kv(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, length, 4, generator=g), torch.randn(rows, 2, length, 4, generator=g)


def test_growing_layer_appends_in_place_and_equals_concatenation() -> None:
    grown, plain = _GrowingLayer(), DynamicLayer()
    first = _kv(3, 5, 0)
    grown.update(*first)
    plain.update(*first)
    buffer = grown._key_buffer
    assert buffer is not None and buffer.shape[-2] == 5 + KV_SPARE_COLUMNS
    early_keys = grown.keys
    snapshot = early_keys.clone()
    for step in range(KV_SPARE_COLUMNS):  # fills the spare columns exactly: no new buffer yet
        k, v = _kv(3, 1, step + 1)
        keys, values = grown.update(k, v)
        plain.update(k, v)
        assert torch.equal(keys, plain.keys) and torch.equal(values, plain.values)
    assert grown._key_buffer is buffer  # written in place, never copied
    assert torch.equal(early_keys, snapshot)  # a view taken earlier never changes under its holder
    grown.update(*_kv(3, 1, 99))  # past the capacity: a bigger buffer, same contents
    plain.update(*_kv(3, 1, 99))
    assert grown._key_buffer is not buffer and torch.equal(grown.keys, plain.keys)


def test_growing_layer_rebuffers_tensors_handed_to_it() -> None:
    """The batch replaces ``keys`` / ``values`` when rows leave or join (select, extend, trim): the next
    update adopts them into a fresh buffer instead of writing into the old one."""
    grown, plain = _GrowingLayer(), DynamicLayer()
    start = _kv(4, 6, 0)
    grown.update(*start)
    plain.update(*start)
    old = grown._key_buffer
    keep = torch.tensor([0, 2])
    grown.keys, grown.values = grown.keys[keep], grown.values[keep]
    plain.keys, plain.values = plain.keys[keep], plain.values[keep]
    grown.keys, grown.values = grown.keys[:, :, 2:], grown.values[:, :, 2:]  # trim: a view at an offset
    plain.keys, plain.values = plain.keys[:, :, 2:], plain.values[:, :, 2:]
    step = _kv(2, 1, 7)
    keys, values = grown.update(*step)
    plain.update(*step)
    assert grown._key_buffer is not old and keys.shape == (2, 2, 5, 4)
    assert torch.equal(keys, plain.keys) and torch.equal(values, plain.values)


def _generations(client: LocalTrainingClient) -> list[Sample]:
    prompts = [list(client.tokenizer.encode(f"What is {i} + {7 * i}? Use the tool.")) for i in range(6)]
    out = [
        s for i, p in enumerate(prompts) for s in client.sample(p, 3, SamplingParams(max_tokens=24, seed=i))
    ]

    async def concurrent() -> list[list[Sample]]:  # rows join and leave mid-decode
        sampler = await client.sampling_client_async()
        params = [SamplingParams(max_tokens=8 + 6 * i, seed=50 + i) for i in range(len(prompts))]
        return await asyncio.gather(
            *[sampler.sample_async(p, 2, q) for p, q in zip(prompts, params, strict=True)]
        )

    return out + [s for group in asyncio.run(concurrent()) for s in group]


def test_generation_is_bitwise_the_same_as_with_concatenated_kv(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run() -> list[Sample]:
        c = LocalTrainingClient(tiny_model_dir, lora=None, device="cpu", seed=0, sample_batch_size=8)
        try:
            return _generations(c)
        finally:
            c.close()

    grown = run()
    monkeypatch.setattr(generation, "_growing", lambda cache: cache)  # DynamicLayer: torch.cat per step
    concatenated = run()
    assert sum(len(s.tokens) for s in grown) > 200
    assert [s.tokens for s in grown] == [s.tokens for s in concatenated]
    assert [s.logprobs for s in grown] == [s.logprobs for s in concatenated]


LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_merged_view_runs_prepacked_linears_that_follow_the_weights(tiny_model_dir: Path) -> None:
    c = LocalTrainingClient(tiny_model_dir, lora=LORA, device="cpu", seed=0, sample_batch_size=8)
    try:
        with torch.no_grad():
            for name, p in c.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.2)
        c.mark_weights_changed()
        view = c.sampling_model()
        assert can_pack(view)
        linears = [m for m in view.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(type(m) is PackedLinear for m in linears)
        names = set(view.state_dict())
        assert names and not any("_packed" in n for n in names)  # saves as the plain model does
        assert (
            view.lm_head.weight is view.get_input_embeddings().weight or not view.config.tie_word_embeddings
        )

        with torch.no_grad():
            for m in linears:
                x = torch.randn(5, 3, m.in_features)
                ref = torch.nn.functional.linear(x, m.weight, m.bias)
                assert torch.allclose(m(x), ref, rtol=1e-5, atol=1e-5)
        with torch.enable_grad():  # a forward that needs gradients never uses the packed copy
            x = torch.randn(5, 3, linears[0].in_features)
            assert torch.equal(
                linears[0](x), torch.nn.functional.linear(x, linears[0].weight, linears[0].bias)
            )

        prompt = list(c.tokenizer.encode("What is 3 + 4? Use the tool."))
        sample = c.sample(prompt, 1, SamplingParams(max_tokens=6, seed=1))[0]
        n = len(prompt) + len(sample.tokens) - 1
        seq = prompt + sample.tokens
        datum = Datum(
            seq[:-1], seq[1:], [-1.0] * n, [0.0] * (len(prompt) - 1) + [1.0] * len(sample.tokens), [5.0] * n
        )
        c.forward_backward([datum], "importance_sampling")
        c.optim_step(AdamParams(lr=0.05))
        view = c.sampling_model()  # repacked: the packed outputs follow the new merged weights
        q = next(m for n, m in view.named_modules() if n.endswith("q_proj"))
        x = torch.randn(5, 3, q.in_features)
        with torch.no_grad():
            assert torch.allclose(q(x), torch.nn.functional.linear(x, q.weight, q.bias), rtol=1e-5, atol=1e-5)
        greedy = SamplingParams(max_tokens=8, temperature=0.0, seed=0)
        merged = c.sample(prompt, 1, greedy)[0]
        c.merge_lora_for_sampling = False
        wrapped = c.sample(prompt, 1, greedy)[0]
        assert merged.tokens == wrapped.tokens
        assert max(abs(a - b) for a, b in zip(merged.logprobs, wrapped.logprobs, strict=True)) < 1e-4
    finally:
        c.close()


def test_worker_threads_run_on_the_clients_thread_count(tiny_model_dir: Path) -> None:
    c = LocalTrainingClient(tiny_model_dir, lora=None, device="cpu", seed=0, num_threads=1)
    try:
        torch.set_num_threads(2)  # the process changes its count later: the client's worker keeps 1
        assert c._executor.submit(torch.get_num_threads).result() == 1
        c.set_num_threads(2)
        assert c._executor.submit(torch.get_num_threads).result() == 2
        assert c.num_threads == 2 and torch.get_num_threads() == 2
    finally:
        c.close()
