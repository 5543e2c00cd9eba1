"""The local backend's instruments on the tiny model: the policy's entropy from the training forward, the KL
to the starting policy (the LoRA adapter switched off) and its penalty, each against a direct torch
computation on the same datums."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from retool.backends.interface.types import AdamParams, Datum
from retool.backends.local.client import LocalTrainingClient
from retool.backends.local.datums_pass import DatumsPass
from retool.train.step import merge_forward_backward

PPO = {"clip_low": 0.8, "clip_high": 1.28}
MEASURE = {**PPO, "measure_ref_kl": 1.0}


def _client(model_dir: Path, *, lora: bool = True, share_prefix: bool = True) -> LocalTrainingClient:
    torch.set_num_threads(1)
    return LocalTrainingClient(
        model_dir,
        lora={"rank": 4, "alpha": 8} if lora else None,
        device="cpu",
        seed=0,
        micro_batch_tokens=4096,  # one micro-batch: the rows share their first 40 inputs
        share_train_prefix=share_prefix,
    )


@pytest.fixture
def lora_client(tiny_model_dir: Path) -> Iterator[LocalTrainingClient]:
    client = _client(tiny_model_dir)
    yield client
    client.close()


def _datums() -> list[Datum]:
    """Three rows sharing 40 input tokens (the shared-prefix path runs them once); row 0's trained
    positions start inside that prefix. Sampler logprobs 0, so ratios differ from 1; weights 1 / (n * 3)."""
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 200, (40,), generator=gen).tolist()
    out = []
    for k, (extra, first_trained) in enumerate([(12, 30), (9, 44), (15, 42)]):
        ids = prefix + torch.randint(3, 200, (extra + 1,), generator=gen).tolist()
        n = len(ids) - 1
        trained = [i >= first_trained for i in range(n)]
        count = sum(trained)
        out.append(
            Datum(
                ids[:-1],
                ids[1:],
                logprobs=[-5.0 if t else 0.0 for t in trained],
                advantages=[(1.0, -1.0, 0.5)[k] if t else 0.0 for t in trained],
                weights=[1.0 / (count * 3) if t else 0.0 for t in trained],
            )
        )
    return out


def _direct(model: torch.nn.Module, datums: list[Datum]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per datum, at its trained positions: the softmax entropy and the target logprob, one plain forward
    of one row each."""
    entropies, logprobs = [], []
    with torch.no_grad():
        for d in datums:
            logits = model(input_ids=torch.tensor([d.input_tokens])).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            at = torch.tensor(d.weights) != 0
            entropies.append(-(logp.exp() * logp).sum(-1)[at])
            logprobs.append(logp.gather(-1, torch.tensor(d.target_tokens)[:, None])[:, 0][at])
    return entropies, logprobs


@pytest.mark.parametrize("share_prefix", [True, False])
def test_entropy_is_the_softmax_entropy_over_the_trained_positions(
    tiny_model_dir: Path, share_prefix: bool
) -> None:
    client = _client(tiny_model_dir, lora=False, share_prefix=share_prefix)
    try:
        datums = _datums()
        result = client.forward(datums, "ppo", PPO)
        entropies, _ = _direct(client.model, datums)
        want = float(torch.cat(entropies).mean())
        assert result.entropy == pytest.approx(want, rel=1e-5)
        assert 0 < want < float(torch.log(torch.tensor(float(client.vocab_size))))
        assert result.ref_kl is None  # not asked for
    finally:
        client.close()


def test_reference_kl_is_zero_at_the_start_and_grows_with_training(lora_client: LocalTrainingClient) -> None:
    datums = _datums()
    first = lora_client.forward_backward(datums, "ppo", MEASURE)
    assert first.ref_kl == 0.0  # the adapter starts at zero: the policy is its start
    for _ in range(3):
        lora_client.optim_step(AdamParams(lr=0.05))
        lora_client.forward_backward(datums, "ppo", MEASURE)
    later = lora_client.forward(datums, "ppo", MEASURE)
    _, policy = _direct(lora_client.model, datums)
    with lora_client.model.disable_adapter():
        _, start = _direct(lora_client.model, datums)
    d = torch.cat(start) - torch.cat(policy)
    want = float((d.exp() - d - 1).mean())
    assert want > 1e-4
    assert later.ref_kl == pytest.approx(want, rel=1e-4)


def _gradient(
    client: LocalTrainingClient, datums: list[Datum], config: dict[str, float]
) -> tuple[float, torch.Tensor]:
    client._zero_grad()
    loss = client.forward_backward(datums, "ppo", config).loss
    grad = torch.cat([p.grad.flatten() for p in client.trainable_parameters() if p.grad is not None])
    client._zero_grad()
    return loss, grad


def test_the_penalty_adds_coef_times_k3_and_pulls_towards_the_start(lora_client: LocalTrainingClient) -> None:
    datums = _datums()
    coef = {**PPO, "ref_kl_coef": 0.5}
    # identical policy (the adapter at zero): the penalty and its gradient are 0
    plain_loss, plain_grad = _gradient(lora_client, datums, PPO)
    kl_loss, kl_grad = _gradient(lora_client, datums, coef)
    assert kl_loss == plain_loss
    assert torch.equal(kl_grad, plain_grad)
    # moved away from the start: the loss grows by coef * sum(w * k3), the gradient changes
    lora_client.forward_backward(datums, "ppo", PPO)
    for _ in range(2):
        lora_client.optim_step(AdamParams(lr=0.05))
        lora_client.forward_backward(datums, "ppo", PPO)
    lora_client._zero_grad()
    plain_loss, plain_grad = _gradient(lora_client, datums, PPO)
    kl_loss, kl_grad = _gradient(lora_client, datums, coef)
    ref_kl = lora_client.forward(datums, "ppo", MEASURE).ref_kl
    assert ref_kl is not None and ref_kl > 0
    # every datum's weights sum to 1/3, so sum(w * k3) is the token mean only per datum: recompute it
    _, policy = _direct(lora_client.model, datums)
    with lora_client.model.disable_adapter():
        _, start = _direct(lora_client.model, datums)
    weighted = 0.0
    for d, lp, ref in zip(datums, policy, start, strict=True):
        k3 = (ref - lp).exp() - (ref - lp) - 1
        weighted += float((k3 * torch.tensor([w for w in d.weights if w])).sum())
    assert kl_loss - plain_loss == pytest.approx(0.5 * weighted, rel=1e-4)
    assert not torch.allclose(kl_grad, plain_grad)


def test_full_fine_tuning_has_no_reference(tiny_model_dir: Path) -> None:
    client = _client(tiny_model_dir, lora=False)
    try:
        assert client.reference_kl_unavailable is not None
        assert "full fine-tuning" in client.reference_kl_unavailable
        with pytest.raises(ValueError, match="reference policy"):
            client.forward(_datums(), "ppo", MEASURE)
    finally:
        client.close()


def test_shares_of_a_call_merge_into_the_whole_calls_means(lora_client: LocalTrainingClient) -> None:
    """Data-parallel processes each run a share of the call's datums (``DatumsPass.merge``); the training
    loop's micro-batches are separate calls (``merge_forward_backward``): both give the whole's means."""
    datums = _datums()
    lora_client.forward_backward(datums, "ppo", PPO)
    lora_client.optim_step(AdamParams(lr=0.05))
    whole = lora_client.forward(datums, "ppo", MEASURE)
    shares = [[0], [1, 2]]
    passes = [
        (rows, lora_client._run_datums([datums[i] for i in rows], "ppo", MEASURE, False)) for rows in shares
    ]
    merged = DatumsPass.merge(passes, len(datums)).tally.result()
    calls = merge_forward_backward(
        [lora_client.forward([datums[i] for i in rows], "ppo", MEASURE) for rows in shares]
    )
    assert whole.entropy is not None and whole.ref_kl is not None
    for result in (merged, calls):
        assert result.entropy == pytest.approx(whole.entropy, rel=1e-5)
        assert result.ref_kl == pytest.approx(whole.ref_kl, rel=1e-4)
    assert merge_forward_backward([whole, lora_client.forward(datums, "ppo", PPO)]).ref_kl == pytest.approx(
        whole.ref_kl
    )
