"""Data-parallel training of the local backend (``retool.backends.local.data_parallel``): one step over several
processes is the step of one process, a replica's failure is an error that names it, nothing outlives the
client; and how a batch is dealt out (``retool.backends.training.packing.split_for_workers``)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from retool.backends import make_training_client
from retool.backends.interface.types import AdamParams, Datum
from retool.backends.local import data_parallel
from retool.backends.local.client import LocalTrainingClient
from retool.backends.local.data_parallel import (
    DataParallelTrainingClient,
    ReplicaError,
    prestart_replicas,
    resolve_processes,
)
from retool.backends.training.packing import padded_cost, split_for_workers
from retool.config import load_config, override_config

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _datums(vocab: int, lengths: list[int], seed: int = 1) -> list[Datum]:
    """RL-shaped datums (prompt weight 0), normalised as the loop does: the call's gradient is a mean."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        seq = torch.randint(5, vocab, (n + 1,), generator=g).tolist()
        n_prompt = max(1, n // 3)
        lp = (-torch.rand(n, generator=g) * 6).tolist()
        adv = float(torch.randn((), generator=g))
        w = [0.0] * n_prompt + [1.0 / (n - n_prompt) / len(lengths)] * (n - n_prompt)
        out.append(Datum(seq[:-1], seq[1:], [0.0] * n_prompt + lp[n_prompt:], [adv] * n, w))
    return out


def _grads(client: LocalTrainingClient) -> list[torch.Tensor]:
    return [
        torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        for p in client.trainable_parameters()
    ]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie is dead too
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


def _replica_pids(client: DataParallelTrainingClient) -> list[int]:
    return [r.process.pid for r in client._replicas]


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_a_step_on_three_processes_is_the_step_of_one(tiny_model_dir: Path, lora: dict | None) -> None:
    kw: dict = {"lora": lora, "device": "cpu", "seed": 0, "micro_batch_tokens": 48}
    one = LocalTrainingClient(tiny_model_dir, **kw)
    dp = DataParallelTrainingClient(tiny_model_dir, processes=3, **kw)
    try:
        with torch.no_grad():  # LoRA B starts at zero: make every LoRA matrix get a gradient
            for (name, p), q in zip(one.model.named_parameters(), dp.model.parameters(), strict=True):
                if "lora_B" in name:
                    p.normal_(0, 0.1)
                q.copy_(p)
        datums = _datums(one.vocab_size, [9, 14, 20, 6, 31, 11, 17, 25, 3])
        for loss_fn in ("ppo", "cross_entropy"):
            a, b = one.forward_backward(datums, loss_fn), dp.forward_backward(datums, loss_fn)
            assert b.loss == pytest.approx(a.loss, rel=1e-5)
            assert b.trained_tokens == a.trained_tokens
            assert b.clip_fraction == pytest.approx(a.clip_fraction)
            for x, y in zip(a.token_logprobs or [], b.token_logprobs or [], strict=True):
                assert y == pytest.approx(x, abs=1e-5)
        assert b.extra["micro_batches"] >= 3  # every process ran a share
        ga, gb = _grads(one), _grads(dp)
        scale = max(float(g.abs().max()) for g in ga)
        assert scale > 0
        for x, y in zip(ga, gb, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5 * scale)
        adam = AdamParams(lr=1e-3)
        assert dp.optim_step(adam).grad_norm == pytest.approx(one.optim_step(adam).grad_norm, rel=1e-4)
        assert dp.trainable_parameters()[0].grad is None  # the replicas' gradients were consumed too
        # The replicas compute with the updated weights: the next call agrees again.
        a, b = one.forward(datums, "cross_entropy"), dp.forward(datums, "cross_entropy")
        for x, y in zip(a.token_logprobs or [], b.token_logprobs or [], strict=True):
            assert y == pytest.approx(x, abs=1e-4)
        # The instruments merge over the shares: the policy's entropy, and the KL to the start (LoRA).
        measure = {"measure_ref_kl": 1.0} if lora else None
        a, b = one.forward(datums, "ppo", measure), dp.forward(datums, "ppo", measure)
        assert a.entropy is not None and b.entropy == pytest.approx(a.entropy, rel=1e-5)
        if lora:
            assert a.ref_kl is not None and a.ref_kl > 0 and b.ref_kl == pytest.approx(a.ref_kl, rel=1e-3)
    finally:
        dp.close()
        one.close()


def test_the_replicas_autocast_as_rank_0_does(tiny_model_dir: Path) -> None:
    """``train_autocast`` (SFT's bf16) goes with every call: a replica's share is computed as this process
    computes it, and is not when autocast is off again."""
    one = LocalTrainingClient(tiny_model_dir, lora=None, device="cpu", seed=0)
    dp = DataParallelTrainingClient(tiny_model_dir, processes=2, lora=None, device="cpu", seed=0)
    try:
        datums = _datums(one.vocab_size, [17, 17])  # one datum a process; the replica takes the first
        assert split_for_workers([17, 17], 2, dp.micro_batch_tokens)[0] == [0]

        def alone(client: LocalTrainingClient) -> list[list[float]]:
            return [(client.forward([d], "cross_entropy").token_logprobs or [[]])[0] for d in datums]

        fp32 = alone(one)
        one.train_autocast = dp.train_autocast = torch.bfloat16
        bf16 = alone(one)
        both = dp.forward(datums, "cross_entropy").token_logprobs or []
        dp.train_autocast = None
        again = dp.forward(datums, "cross_entropy").token_logprobs or []
    finally:
        dp.close()
        one.close()
    assert max(abs(x - y) for x, y in zip(fp32[0], bf16[0], strict=True)) > 1e-4  # bf16 shows
    for got, want in ((both, bf16), (again, fp32)):
        for x, y in zip(want, got, strict=True):
            assert y == pytest.approx(x, abs=1e-6)


def test_states_save_and_load_through_the_shared_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Tied weights (the tiny model ties its embeddings and output layer) and per-parameter storages:
    a data-parallel state loads into a one-process client and back, and the replicas train on it."""
    dp = DataParallelTrainingClient(
        tiny_model_dir, processes=2, lora=None, device="cpu", micro_batch_tokens=48
    )
    one = LocalTrainingClient(tiny_model_dir, lora=None, device="cpu", micro_batch_tokens=48)
    try:
        datums = _datums(dp.vocab_size, [9, 14, 20, 6, 31, 11])
        dp.forward_backward(datums, "cross_entropy")
        dp.optim_step(AdamParams(lr=1e-2))
        saved = dp.save_state(str(tmp_path / "state"))
        dp.sampling_model().save_pretrained(tmp_path / "hf")  # the demo's save_hf
        assert (tmp_path / "hf" / "model.safetensors").is_file()
        one.load_state(saved)
        for p, q in zip(one.trainable_parameters(), dp.trainable_parameters(), strict=True):
            assert torch.equal(p, q)
        dp.forward_backward(datums, "cross_entropy")  # moves the shared weights away from the state
        dp.optim_step(AdamParams(lr=1e-2))
        dp.load_state(saved)  # written in place: the replica computes with the loaded weights
        a, b = one.forward(datums, "cross_entropy"), dp.forward(datums, "cross_entropy")
        for x, y in zip(a.token_logprobs or [], b.token_logprobs or [], strict=True):
            assert y == pytest.approx(x, abs=1e-5)
    finally:
        dp.close()
        one.close()


def test_a_dead_replica_fails_the_call_and_nothing_outlives_the_client(tiny_model_dir: Path) -> None:
    dp = DataParallelTrainingClient(
        tiny_model_dir, processes=3, lora=None, device="cpu", micro_batch_tokens=48
    )
    pids = _replica_pids(dp)
    assert all(_alive(pid) for pid in pids)
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(ReplicaError, match=r"replica 1 \(pid \d+\) .*\(exit code -9\)"):
        dp.forward_backward(_datums(dp.vocab_size, [9, 14, 20, 6, 31, 11]), "cross_entropy")
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)  # the surviving replica was stopped with it
    with pytest.raises(ReplicaError):  # the client is done, and says so
        dp.forward_backward(_datums(dp.vocab_size, [9, 14]), "cross_entropy")
    dp.close()


def test_a_replica_error_carries_its_traceback_and_close_stops_all(tiny_model_dir: Path) -> None:
    dp = DataParallelTrainingClient(tiny_model_dir, processes=2, lora=None, device="cpu")
    pids = _replica_pids(dp)
    files = list(dp._shared_files)
    assert files and all(f.exists() for f in files)  # until the replicas have mapped them
    dp.forward_backward(_datums(dp.vocab_size, [9, 14, 20]), "cross_entropy")
    assert not any(f.exists() for f in files)  # mapped, then unlinked at the first call
    replica = dp._replicas[0]
    replica.send(("run", None, "cross_entropy", None, True, None))  # no datums: the replica's code raises
    with pytest.raises(ReplicaError, match=r"(?s)replica 1 failed:.*Traceback.*TypeError"):
        replica.receive()
    dp.close()
    assert not any(_alive(pid) for pid in pids)
    unused = DataParallelTrainingClient(tiny_model_dir, processes=2, lora=None, device="cpu")
    files = list(unused._shared_files)
    unused.close()  # closed before any training call: its files go with it
    assert files and not any(f.exists() for f in files)


def test_a_spare_started_ahead_is_adopted(tiny_model_dir: Path) -> None:
    prestart_replicas(1)
    spare = data_parallel._SPARES[0]
    dp = DataParallelTrainingClient(tiny_model_dir, processes=2, lora=None, device="cpu")
    try:
        assert dp._replicas == [spare] and spare.rank == 1 and not data_parallel._SPARES
        dp.forward_backward(_datums(dp.vocab_size, [9, 14, 20]), "cross_entropy")
    finally:
        dp.close()
    assert not _alive(spare.process.pid)


def test_backend_processes_picks_the_client(tiny_model_dir: Path, tmp_path: Path) -> None:
    base = load_config("demo-tiny")
    sets = [f"model.name={tiny_model_dir}", f"train.run_dir={tmp_path}"]
    one = make_training_client(override_config(base, [*sets, "backend.processes=1"]))
    assert type(one) is LocalTrainingClient
    one.close()
    two = make_training_client(override_config(base, [*sets, "backend.processes=2"]))
    assert isinstance(two, DataParallelTrainingClient) and two.processes == 2
    two.close()
    assert resolve_processes(0) == min(len(os.sched_getaffinity(0)), 8)
    assert resolve_processes(0, "cpu", limit=1) == 1 and resolve_processes(3, "cpu") == 3
    with pytest.raises(ValueError, match=">= 2 processes"):
        DataParallelTrainingClient(tiny_model_dir, processes=1)


def test_shares_cover_the_batch_once_in_runs_of_similar_length() -> None:
    lengths = [30, 120, 35, 110, 40, 32, 125, 38, 33, 100, 36, 31, 115, 39, 34, 37]
    for workers in (1, 2, 3, 5):
        shares = split_for_workers(lengths, workers, 1024, batch_cost=64, share_cost=64)
        assert len(shares) == workers
        assert sorted(i for s in shares for i in s) == list(range(len(lengths)))
        order = [i for s in shares for i in s]  # runs of the longest-first order, one per worker
        assert [lengths[i] for i in order] == sorted(lengths, reverse=True)
    two = split_for_workers(lengths, 2, 1024, batch_cost=64)
    costs = [padded_cost([lengths[i] for i in s], 1024, 64) for s in two]
    # The long rows go together: both shares pad little, and the slower costs well under the whole.
    assert sorted(lengths[i] for i in two[0]) == [110, 115, 120, 125]
    assert max(costs) < 0.6 * padded_cost(lengths, 1024, 64)
    # A share handed to another process costs more: the first (a replica's) gets less of the batch.
    even = [50] * 16
    assert [len(s) for s in split_for_workers(even, 2, 1024, batch_cost=64)] == [8, 8]
    assert [len(s) for s in split_for_workers(even, 2, 1024, batch_cost=64, share_cost=200)] == [6, 10]
    assert sorted(map(len, split_for_workers([7], 3, 1024))) == [0, 0, 1]  # a share may be empty
    with pytest.raises(ValueError):
        split_for_workers(lengths, 0, 1024)
