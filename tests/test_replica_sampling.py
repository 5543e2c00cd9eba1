"""Sampling on the data-parallel replicas (``retool.backends.local.replica_sampling``): the samples of a
split batch are the samples one process draws (seeded per row), later turns follow their sequence to the
engine that holds its KV, both processes generate, a weight change waits for the replicas' batches and
they sample the new weights, a dead replica fails its batches with an error that names it."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from retool.backends.engine.generation import GenRequest
from retool.backends.interface.types import AdamParams, Datum, SamplingParams
from retool.backends.local.client import LocalTrainingClient
from retool.backends.local.data_parallel import DataParallelTrainingClient, ReplicaError
from retool.backends.local.replica_sampling import Affinity, SplitSamplingClient, WeightsGate, plan_batch

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
KW: dict = {"lora": None, "device": "cpu", "seed": 0, "micro_batch_tokens": 256, "num_threads": 1}


def _prompts(vocab: int, count: int, length: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, vocab, (length + i % 3,), generator=g).tolist() for i in range(count)]


async def _sample_all(client: LocalTrainingClient, prompts: list[list[int]], seed: int = 7) -> list:
    sampler = await client.sampling_client_async()
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed)
    groups = await asyncio.gather(*(sampler.sample_async(p, 2, params) for p in prompts))
    return [s for g in groups for s in g]


def test_affinity_sends_a_continuation_to_the_engine_of_its_sequence() -> None:
    aff = Affinity()
    aff.start(0)
    aff.remember([1, 2, 3, 4, 5], 1)
    aff.remember([1, 2, 9], 0)
    assert aff.lookup([1, 2, 3, 4, 5, 6, 7]) == 1  # extends the first sequence
    assert aff.lookup([1, 2, 9, 8]) == 0
    assert aff.lookup([1, 2, 3]) is None  # a prefix of a remembered sequence is not one of them
    assert aff.lookup([7, 7]) is None
    aff.start(1)  # new weights: the engines' caches are empty, so is the map
    assert aff.lookup([1, 2, 3, 4, 5, 6]) is None
    # A group (identical prompts) stays on one engine; new prompts balance the load.
    reqs = [GenRequest([4, 4, 4], SamplingParams(max_tokens=4), s) for s in range(4)]
    reqs += [GenRequest([5, 5], SamplingParams(max_tokens=4), s) for s in range(4)]
    load = [0, 0]
    chosen = plan_batch(reqs, aff, load)
    assert chosen[:4] == [chosen[0]] * 4 and chosen[4:] == [chosen[4]] * 4 and chosen[0] != chosen[4]
    assert load == [4, 4]


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_a_split_batch_draws_what_one_process_draws_on_both_processes(
    tiny_model_dir: Path, lora: dict | None
) -> None:
    one = LocalTrainingClient(tiny_model_dir, **{**KW, "lora": lora})
    dp = DataParallelTrainingClient(tiny_model_dir, processes=2, **{**KW, "lora": lora})
    try:
        with torch.no_grad():  # LoRA B starts at zero: give the adapters weight (the merged views)
            for (name, p), q in zip(one.model.named_parameters(), dp.model.parameters(), strict=True):
                if "lora_B" in name:
                    p.normal_(0, 0.1)
                q.copy_(p)
        one.mark_weights_changed()
        dp.mark_weights_changed()
        assert isinstance(dp._sampler, SplitSamplingClient)
        dp._ready.join()  # type: ignore[union-attr]  # the replicas are up: batches split from now on
        prompts = _prompts(one.vocab_size, 8)
        a, b = asyncio.run(_sample_all(one, prompts)), asyncio.run(_sample_all(dp, prompts))
        assert [s.tokens for s in b] == [s.tokens for s in a]
        for x, y in zip(a, b, strict=True):
            assert y.logprobs == pytest.approx(x.logprobs, abs=1e-4)
        replica_rows = dp._replica_engines[0]._seen["sampled_sequences"]
        assert 0 < replica_rows < len(b)  # both processes generated a share
        assert dp.stats.sampled_sequences == len(b)  # the replica's work is counted here too
        # A next turn goes where its sequence was generated (its KV is cached there).
        first = [*prompts[0], *b[0].tokens, 9, 9]
        assert dp._sampler._affinity.lookup(first) is not None  # type: ignore[attr-defined]
    finally:
        dp.close()
        one.close()


def test_after_an_optimizer_step_the_replicas_sample_the_new_weights(tiny_model_dir: Path) -> None:
    one = LocalTrainingClient(tiny_model_dir, **KW)
    dp = DataParallelTrainingClient(tiny_model_dir, processes=2, **KW)
    try:
        prompts = _prompts(one.vocab_size, 8)
        g = torch.Generator().manual_seed(1)
        seq = torch.randint(5, one.vocab_size, (20,), generator=g).tolist()
        datum = Datum(seq[:-1], seq[1:], [0.0] * 19, [1.0] * 19, [1.0 / 19] * 19)
        for client in (one, dp):
            asyncio.run(_sample_all(client, prompts))  # fills the prefix caches with the old weights
            client.forward_backward([datum], "cross_entropy")
            client.optim_step(AdamParams(lr=5e-2))
        a, b = asyncio.run(_sample_all(one, prompts, seed=8)), asyncio.run(_sample_all(dp, prompts, seed=8))
        assert [s.tokens for s in b] == [s.tokens for s in a]
        for x, y in zip(a, b, strict=True):
            assert y.logprobs == pytest.approx(x.logprobs, abs=1e-4)
    finally:
        dp.close()
        one.close()


def test_a_weight_change_waits_for_the_replica_batches_in_flight() -> None:
    gate = WeightsGate()
    assert gate.try_enter()
    changed = threading.Event()

    def change() -> None:
        with gate.changing():
            changed.set()

    t = threading.Thread(target=change)
    t.start()
    time.sleep(0.2)
    assert not changed.is_set()  # a batch is in flight
    assert not gate.try_enter()  # and no new one starts while the change waits
    gate.leave()
    t.join(timeout=5)
    assert changed.is_set()
    assert gate.try_enter()  # after the change, batches go out again
    gate.leave()


def test_a_dead_replica_fails_its_batches_with_an_error_that_names_it(tiny_model_dir: Path) -> None:
    dp = DataParallelTrainingClient(tiny_model_dir, processes=2, **KW)
    try:
        dp._ready.join()  # type: ignore[union-attr]
        engine = dp._replica_engines[0]
        os.kill(dp._replicas[0].process.pid, signal.SIGKILL)
        dp._replicas[0].process.wait(timeout=10)
        request = GenRequest([5, 6, 7], SamplingParams(max_tokens=4), 1)
        future = engine.submit([request], dp._weights_version)
        with pytest.raises(ReplicaError, match="replica 1"):
            future.result(timeout=30)
        assert engine.failed
        # Later requests stay on the engine still alive (this process's).
        samples = asyncio.run(_sample_all(dp, _prompts(dp.vocab_size, 2)))
        assert len(samples) == 4
    finally:
        dp.close()


def test_with_sampling_on_replicas_off_rank_0_samples_alone_and_still_trains(tiny_model_dir: Path) -> None:
    dp = DataParallelTrainingClient(tiny_model_dir, processes=2, sample_on_replicas=False, **KW)
    try:
        assert not isinstance(dp._sampler, SplitSamplingClient)
        samples = asyncio.run(_sample_all(dp, _prompts(dp.vocab_size, 2)))
        assert len(samples) == 4
        seq = list(range(5, 25))
        datum = Datum(seq[:-1], seq[1:], [0.0] * 19, [1.0] * 19, [1.0 / 19] * 19)
        assert dp.forward_backward([datum, datum], "cross_entropy").extra["micro_batches"] >= 2
        assert dp._replica_engines == []
    finally:
        dp.close()
