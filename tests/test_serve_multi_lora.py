"""Sampling many adapters of one shared base in one batch (``retool.backends.samplers.multi_lora``, as ``retool serve``
uses it): the same tokens, and logprobs within float rounding, as each adapter (and the base) sampled alone
at fixed seeds; rows never get another adapter's weights, nor its cached KV."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from retool.backends.interface.clients import SamplingClient, run_sync
from retool.backends.interface.types import AdamParams, Datum, Sample, SamplingParams
from retool.backends.local.client import LocalLoraSpec, LocalTrainingClient, load_base_model
from retool.backends.samplers.multi_lora import MultiLoraEngine, SharedBaseSamplingClient

LORA = LocalLoraSpec(
    rank=4, alpha=8, dropout=0.0, target_modules=("q_proj", "v_proj", "o_proj", "up_proj", "lm_head")
)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [3 + (i * 7) % 40 for i in range(20)]]
PARAMS = [
    SamplingParams(max_tokens=6, temperature=0.0),
    SamplingParams(max_tokens=6, temperature=1.0, seed=3),
]


def _trained(tiny: Path, base: torch.nn.Module, seed: int, tokens: list[int]) -> LocalTrainingClient:
    client = LocalTrainingClient(
        tiny, lora=LORA, device="cpu", seed=seed, shared_base=base, merge_lora_for_sampling=False
    )
    data = [Datum(tokens[:-1], tokens[1:])]
    for _ in range(3):  # LoRA B starts at zero: train so that each adapter differs from the base
        client.forward_backward(data, "cross_entropy")
        client.optim_step(AdamParams(lr=5e-2, grad_clip_norm=0.0))
    return client


async def _sample_all(samplers: list[SamplingClient]) -> list[list[Sample]]:
    """Every (prompt, params) of every sampler, all submitted at once."""
    calls = [s.sample_async(p, 1, q) for s in samplers for p in PROMPTS for q in PARAMS]
    return list(await asyncio.gather(*calls))


def _assert_same(got: list[list[Sample]], want: list[list[Sample]]) -> None:
    for g, w in zip(got, want, strict=True):
        assert [s.tokens for s in g] == [s.tokens for s in w]
        for gs, ws in zip(g, w, strict=True):
            assert gs.logprobs == pytest.approx(ws.logprobs, abs=1e-4)


def test_adapters_and_the_base_batch_together_and_match_sampling_each_alone(tiny_model_dir: Path) -> None:
    torch.set_num_threads(1)
    base = load_base_model(str(tiny_model_dir), device="cpu")
    a = _trained(tiny_model_dir, base, 0, [5, 6, 7, 8, 20, 21, 22, 23])
    b = _trained(tiny_model_dir, base, 1, [9, 10, 11, 30, 31, 32, 33])
    c = _trained(tiny_model_dir, base, 2, [3, 4, 40, 41, 42, 43])
    plain = LocalTrainingClient(tiny_model_dir, lora=None, device="cpu", shared_base=base)
    frozen = [run_sync(t.frozen_sampling_client_async()) for t in (a, b, c)]
    alone = [run_sync(_sample_all([s])) for s in [*frozen, plain._sampler]]
    assert len({repr(x) for x in alone}) == 4  # four different sets of weights

    engine = MultiLoraEngine(base, a)
    shared = [engine.sampler_for(t, f.model) for t, f in zip((a, b, c), frozen, strict=True)]
    shared.append(engine.sampler_for(plain, plain.model))
    assert all(isinstance(s, SharedBaseSamplingClient) for s in shared)
    # Which compositions the layer was stacked for, while it ran: the state after the run depends on how
    # the batch drained (its last steps may hold fewer than three adapters), not on the stacked path.
    layer = engine.layers["model.layers.0.self_attn.q_proj"]
    stacked_for: list[int] = []
    unspied = layer.stack

    def spy(groups: list[tuple[list[int], torch.Tensor, torch.Tensor, float]], rows: int) -> bool:
        used = unspied(groups, rows)
        stacked_for.extend([len(groups)] if used else [])
        return used

    layer.stack = spy  # type: ignore[method-assign]
    together = run_sync(_sample_all(shared))  # type: ignore[arg-type]
    n = len(PROMPTS) * len(PARAMS)
    assert engine.engine.peak_rows == 4 * n  # one batch: every row of the four samplers
    assert stacked_for and max(stacked_for) == 3  # the three adapters' rows went through the stacked path
    for k in range(4):
        _assert_same(together[k * n : (k + 1) * n], alone[k])

    # The prefix cache keeps each adapter's KV apart: b after a on the same long prompt is still b's.
    engine.engine.cache.clear()
    long = PROMPTS[2]
    first = run_sync(shared[0].sample_async(long, 1, PARAMS[0]))
    assert len(engine.engine.cache) == 1
    second = run_sync(shared[1].sample_async(long, 1, PARAMS[0]))
    assert engine.engine.cache.stats.hits == 0
    _assert_same([first], [alone[0][4][:1]])
    _assert_same([second], [alone[1][4][:1]])
    # ... and the same adapter again is served from its own entry
    run_sync(shared[0].sample_async(long, 1, PARAMS[0]))
    assert engine.engine.cache.stats.hits == 1
    for client in (a, b, c, plain):
        client.close()
    engine.close()


def test_rows_get_only_their_own_adapters_deltas(tiny_model_dir: Path) -> None:
    base = load_base_model(str(tiny_model_dir), device="cpu")
    a = _trained(tiny_model_dir, base, 0, [5, 6, 7, 8, 20, 21])
    b = _trained(tiny_model_dir, base, 1, [9, 10, 11, 30, 31])
    engine = MultiLoraEngine(base, a)
    wa, wb = (engine.register(run_sync(c.frozen_sampling_client_async()).model) for c in (a, b))
    assert wa is not None and wb is not None and wa.key != wb.key
    engine._select([wb.key, None, wa.key, wb.key])
    q = engine.layers["model.layers.0.self_attn.q_proj"]
    k = engine.layers["model.layers.0.self_attn.k_proj"]  # not adapted: base only, for every row
    assert k.deltas == []
    by_a = {id(d[1]): d[0] for d in q.deltas}
    assert by_a[id(wa.layers["model.layers.0.self_attn.q_proj"][0])] == slice(2, 3)
    rows_b = by_a[id(wb.layers["model.layers.0.self_attn.q_proj"][0])]
    assert isinstance(rows_b, torch.Tensor) and rows_b.tolist() == [0, 3]
    # a sampler's adapter goes when its sampler does: no row can name it afterwards
    key = wa.key
    del wa
    assert engine._adapters.get(key) is None
    for client in (a, b):
        client.close()
    engine.close()


def test_the_servers_samplers_of_two_runs_and_the_base_share_one_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``retool serve``'s state: temporary sampler weights of two runs, a saved path and the base model all
    sample on the base's one engine, each through its own weights."""
    from retool.config import load_config
    from retool.serve.state import ServeState
    from retool.serve.storage import LoraRequest

    cfg = load_config("tiny", ["backend.device=cpu", "backend.cpu_threads=1"])
    state = ServeState(cfg, {"tiny": str(tiny_model_dir)}, tmp_path / "root")
    runs = [state.create_run("tiny", LoraRequest(rank=4, seed=s)) for s in (0, 1)]
    datum = [Datum([5, 6, 7, 8, 20, 21], [6, 7, 8, 20, 21, 22])]

    async def scenario() -> tuple[list[SamplingClient], list[list[Sample]], list[list[Sample]]]:
        for lr, run in zip((5e-2, 1e-1), runs, strict=True):  # two different adapters
            await state.forward(run, datum, "cross_entropy", {}, backward=True)
            await state.optim_step(run, AdamParams(lr=lr, grad_clip_norm=0.0))
        samplers = [await state.frozen_sampler(run) for run in runs]
        uri = await state.save(runs[1], "sampler_weights", "saved", "tinker")
        state._samplers.clear()  # the saved path loads from its files: a client that only samples
        samplers.append((await state.sampler(uri, None))[0])
        samplers.append((await state.sampler(None, "tiny"))[0])
        together = await _sample_all(samplers)
        alone = [await _sample_all([s]) for s in samplers]
        return samplers, together, alone

    samplers, together, alone = run_sync(scenario())
    assert all(isinstance(s, SharedBaseSamplingClient) for s in samplers)
    (engine,) = state._engines.values()
    assert engine.engine.peak_rows == len(together)  # every request of the four samplers in one batch
    n = len(PROMPTS) * len(PARAMS)
    for k in range(4):
        _assert_same(together[k * n : (k + 1) * n], alone[k])
    _assert_same(alone[2], alone[1])  # the saved path holds run 1's weights
    assert alone[0] != alone[1] and alone[0] != alone[3] and alone[1] != alone[3]
    run_sync(state.close())
