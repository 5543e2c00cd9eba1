"""The training step's data: interpreter feedback mask, group advantages, degenerate groups, weights."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import pytest
import torch

from retool.backends.interface.types import AdamParams, Datum, ForwardBackwardResult, OptimStepResult
from retool.train.step import (
    NotAPrefixError,
    build_datum,
    build_step_data,
    group_advantages,
    is_degenerate,
    mean_reduction_weights,
    pack_micro_batches,
    train_step,
)


@dataclass
class Turn:
    prompt_tokens: list[int]
    completion_tokens: list[int]
    logprobs: list[float]


@dataclass
class Traj:
    turns: list[Turn]
    reward: float = -1.0
    extra: dict = field(default_factory=dict)


def three_turn_trajectory() -> tuple[Traj, set[int], dict[int, float]]:
    """Prompt, call, observation, call, observation, answer; returns the sampled positions (in the full
    sequence) and the sampler logprob of each."""
    prompt0 = [101, 102, 103, 104]  # system + user + assistant header
    comp0 = [11, 12, 13]  # a tool call, ending with the end-of-turn token the sampler emitted
    obs0 = [201, 202, 203, 204, 205]  # tool observation + next assistant header
    comp1 = [21, 22]
    obs1 = [301, 302]
    comp2 = [31, 32, 33, 34]  # the answer
    lp0, lp1, lp2 = [-0.1, -0.2, -0.3], [-1.1, -1.2], [-2.1, -2.2, -2.3, -2.4]
    p1 = prompt0 + comp0 + obs0
    p2 = p1 + comp1 + obs1
    traj = Traj(turns=[Turn(prompt0, comp0, lp0), Turn(p1, comp1, lp1), Turn(p2, comp2, lp2)], reward=1.0)
    sampled: dict[int, float] = {}
    pos = len(prompt0)
    for lp in lp0:
        sampled[pos] = lp
        pos += 1
    pos += len(obs0)
    for lp in lp1:
        sampled[pos] = lp
        pos += 1
    pos += len(obs1)
    for lp in lp2:
        sampled[pos] = lp
        pos += 1
    return traj, set(sampled), sampled


def test_mask_marks_exactly_the_sampled_tokens_after_the_shift() -> None:
    traj, sampled_positions, sampled_lp = three_turn_trajectory()
    full = traj.turns[-1].prompt_tokens + traj.turns[-1].completion_tokens
    datum = build_datum(traj, advantage=0.75)
    assert datum.input_tokens == full[:-1]
    assert datum.target_tokens == full[1:]
    # Datum position i predicts full[i + 1].
    nonzero_adv = {i + 1 for i, a in enumerate(datum.advantages) if a != 0.0}
    nonzero_w = {i + 1 for i, w in enumerate(datum.weights) if w != 0.0}
    assert nonzero_adv == sampled_positions
    assert nonzero_w == sampled_positions
    for i, lp in enumerate(datum.logprobs):
        if i + 1 in sampled_positions:
            assert lp == sampled_lp[i + 1]
            assert datum.advantages[i] == 0.75
        else:
            assert lp == 0.0 and datum.advantages[i] == 0.0 and datum.weights[i] == 0.0
    # Observation tokens never carry advantage: 201..205 and 301, 302 are all masked.
    for i, tok in enumerate(datum.target_tokens):
        if tok >= 200:
            assert datum.advantages[i] == 0.0


def test_mask_with_the_real_rollout_types() -> None:
    from retool.data.problem import Problem
    from retool.env import ReToolOutcome
    from retool.rollout import AssistantTurn, Trajectory, Transition

    traj, sampled_positions, _ = three_turn_trajectory()
    steps = tuple(
        Transition(AssistantTurn(t.prompt_tokens, t.completion_tokens, t.logprobs, "x"), 0.0, False)
        for t in traj.turns
    )
    real = Trajectory(
        problem=Problem("p", "q", "1"),
        group_index=0,
        transitions=steps,
        reward=-1.0,
        outcome=ReToolOutcome(stop_reason="answer"),
    )
    datum = build_datum(real, advantage=-0.5)
    assert {i + 1 for i, a in enumerate(datum.advantages) if a != 0.0} == sampled_positions
    assert len(datum) == len(real.full_tokens()) - 1


def test_prompt_that_rewrites_history_is_refused() -> None:
    traj, _, _ = three_turn_trajectory()
    traj.turns[1].prompt_tokens[2] = 999
    with pytest.raises(NotAPrefixError, match="turn 1"):
        build_datum(traj, advantage=1.0)


def test_group_advantages_are_centred() -> None:
    adv = group_advantages([1.0, -1.0, -1.0, -1.0])
    assert adv == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert sum(adv) == pytest.approx(0.0)
    assert group_advantages([]) == []
    assert is_degenerate([1.0, 1.0]) and is_degenerate([-1.0] * 8) and not is_degenerate([1.0, -1.0])


def _traj(reward: float, n_completion: int, seed: int) -> Traj:
    prompt = [1, 2, 3 + seed]
    comp = [10 + (seed + k) % 50 for k in range(n_completion)]
    return Traj(turns=[Turn(prompt, comp, [-0.5] * n_completion)], reward=reward)


def test_degenerate_groups_are_skipped_and_counted() -> None:
    groups = [
        [_traj(1.0, 3, 0), _traj(-1.0, 4, 1)],  # trained
        [_traj(-1.0, 3, 2), _traj(-1.0, 5, 3)],  # all wrong
        [_traj(1.0, 2, 4), _traj(1.0, 2, 5)],  # all right
        [_traj(-1.0, 2, 6), _traj(1.0, 6, 7), _traj(1.0, 1, 8)],  # trained
    ]
    data = build_step_data(groups)
    assert data.n_groups == 4
    assert data.n_degenerate == 2
    assert data.n_trajectories == 9
    assert len(data.datums) == 5
    # Weights: 1 / (n_tokens * N) on sampled positions, so each datum's weights sum to 1 / N.
    for d in data.datums:
        assert sum(d.weights) == pytest.approx(1.0 / 5)
    assert sum(w for d in data.datums for w in d.weights) == pytest.approx(1.0)
    # Advantages of the last group: R - mean(R) = (-1 - 1/3, 1 - 1/3, 1 - 1/3).
    adv_last = [next(a for a in d.advantages if a != 0.0) for d in data.datums[2:]]
    assert adv_last == pytest.approx([-4 / 3, 2 / 3, 2 / 3])


def test_the_step_samplers_verdict_is_read_not_decided_again() -> None:
    groups = [[_traj(1.0, 3, 0), _traj(-1.0, 4, 1)], [_traj(1.0, 2, 2), _traj(-1.0, 2, 3)]]
    assert len(build_step_data(groups).datums) == 4  # no verdict given: both groups' rewards differ
    data = build_step_data(groups, informative=[False, True])
    assert data.n_degenerate == 1 and len(data.datums) == 2
    assert data.datum_index == [[None, None], [0, 1]]
    assert data.advantages[0] == [1.0, -1.0]  # a group left out still has its advantages reported
    with pytest.raises(ValueError, match="1 informative verdicts for 2 groups"):
        build_step_data(groups, informative=[True])


def test_all_degenerate_gives_no_datums() -> None:
    data = build_step_data([[_traj(-1.0, 2, 0), _traj(-1.0, 3, 1)]])
    assert data.datums == [] and data.n_degenerate == 1


def test_trajectory_without_sampled_tokens_is_not_trained() -> None:
    empty = Traj(turns=[], reward=-1.0)
    data = build_step_data([[_traj(1.0, 2, 0), empty]])
    assert len(data.datums) == 1 and data.n_empty == 1
    assert sum(data.datums[0].weights) == pytest.approx(1.0)


def test_packing_respects_padded_area_and_covers_everything() -> None:
    datums = [Datum(list(range(n)), list(range(n))) for n in (50, 10, 30, 30, 5, 70, 20)]
    batches = pack_micro_batches(datums, max_tokens=100)
    assert sorted(i for b in batches for i in b) == list(range(len(datums)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(len(datums[i]) for i in b) <= 100


# --- the weights give the exact mean gradient -------------------------------------------------------


def _is_loss(table: torch.Tensor, datums: list[Datum]) -> torch.Tensor:
    """Sum-reduced importance-sampling loss of a toy policy (a logit table indexed by input token)."""
    total = table.new_zeros(())
    for d in datums:
        logits = table[torch.tensor(d.input_tokens)]
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(d.target_tokens)[:, None])[:, 0]
        ratio = torch.exp(lp - torch.tensor(d.logprobs))
        total = total - (torch.tensor(d.weights) * ratio * torch.tensor(d.advantages)).sum()
    return total


def test_weights_make_the_accumulated_gradient_the_mean_over_trained_datums() -> None:
    torch.manual_seed(0)
    vocab = 64
    groups = [
        [_traj(1.0, 3, 0), _traj(-1.0, 7, 1), _traj(-1.0, 2, 2)],
        [_traj(-1.0, 5, 3), _traj(-1.0, 4, 4)],  # degenerate: must not count in N
        [_traj(-1.0, 9, 5), _traj(1.0, 1, 6)],
    ]
    data = build_step_data(groups)
    table = torch.randn(vocab, vocab, requires_grad=True)
    # Accumulate over micro-batches, as a backend does (sum of w * loss).
    for batch in pack_micro_batches(data.datums, max_tokens=12):
        _is_loss(table, [data.datums[i] for i in batch]).backward()
    accumulated = table.grad.clone()
    table.grad = None
    # Reference: per-datum token mean, then the plain mean over the 5 trained datums.
    trained = [t for g in (groups[0], groups[2]) for t in g]
    advs = group_advantages([1.0, -1.0, -1.0]) + group_advantages([-1.0, 1.0])
    ref = table.new_zeros(())
    for traj, adv in zip(trained, advs, strict=True):
        d = build_datum(traj, adv, weight=1.0)
        n = sum(1 for w in d.weights if w)
        ref = ref + _is_loss(table, [d]) / n
    (ref / len(trained)).backward()
    assert torch.allclose(accumulated, table.grad, rtol=1e-5, atol=1e-7)
    assert accumulated.abs().sum() > 0
    assert len(pack_micro_batches(data.datums, max_tokens=12)) > 1


class RecordingClient:
    one_call_per_step = False  # the TrainingClient capability train_step reads

    def __init__(self) -> None:
        self.calls: list[list[Datum]] = []
        self.optim_steps = 0
        self.optim_after: list[int] = []  # backward batches done when each optimizer step ran

    async def forward_backward_async(self, datums, loss_fn, loss_config=None) -> ForwardBackwardResult:
        self.calls.append(list(datums))
        n = sum(1 for d in datums for w in d.weights if w)
        return ForwardBackwardResult(
            loss=float(len(datums)), trained_tokens=n, ratio_mean=1.0, clip_fraction=0.25
        )

    async def optim_step_async(self, adam: AdamParams) -> OptimStepResult:
        self.optim_steps += 1
        self.optim_after.append(len(self.calls))
        return OptimStepResult(grad_norm=0.5, lr=adam.lr)


def test_train_step_does_one_optimizer_step_over_all_micro_batches() -> None:
    data = build_step_data([[_traj(1.0, 30, i), _traj(-1.0, 40, i + 1)] for i in range(0, 8, 2)])
    client = RecordingClient()
    result = asyncio.run(
        train_step(
            client,
            data.datums,
            loss_fn="ppo",
            loss_config=None,
            adam=AdamParams(lr=1e-3),
            micro_batch_tokens=90,
        )
    )
    assert client.optim_steps == 1
    assert sum(len(c) for c in client.calls) == 8 and len(client.calls) == result.n_micro_batches > 1
    assert client.optim_after == [len(client.calls)]  # the one optimizer step after the last backward
    assert result.forward_backward is not None and result.forward_backward.loss == 8.0
    assert math.isclose(result.forward_backward.clip_fraction, 0.25)
    assert result.metrics()["policy/lr"] == 1e-3


def test_no_datums_no_optimizer_step() -> None:
    client = RecordingClient()
    result = asyncio.run(
        train_step(client, [], loss_fn="ppo", loss_config=None, adam=AdamParams(), micro_batch_tokens=10)
    )
    assert client.optim_steps == 0 and not result.optimizer_stepped


def test_micro_batch_mismatch_metrics_merge_per_measured_token() -> None:
    from retool.train.step import TrainStepResult, merge_forward_backward

    a = ForwardBackwardResult(
        0.0, 3, mismatch_tokens=3, logprob_diff_mean=0.1, logprob_diff_max=0.5, kl_k3=0.01
    )
    b = ForwardBackwardResult(
        0.0, 1, mismatch_tokens=1, logprob_diff_mean=0.5, logprob_diff_max=0.9, kl_k3=0.05, ratio_outside=1.0
    )
    merged = merge_forward_backward([a, b])
    assert merged.mismatch_tokens == 4 and merged.logprob_diff_max == 0.9  # a max stays a max
    assert merged.logprob_diff_mean == pytest.approx((3 * 0.1 + 0.5) / 4)
    assert merged.kl_k3 == pytest.approx((3 * 0.01 + 0.05) / 4) and merged.ratio_outside == 0.25
    metrics = TrainStepResult(2, 2, True, merged).metrics()
    assert metrics["offpolicy/logprob_diff_max"] == 0.9 and metrics["offpolicy/ratio_outside"] == 0.25
    # cross entropy (nothing measured) reports no mismatch at all
    assert "offpolicy/kl_k3" not in TrainStepResult(1, 1, True, ForwardBackwardResult(0.0, 3)).metrics()


def test_mean_reduction_refuses_unmasked_datum() -> None:
    with pytest.raises(ValueError, match="without sampled tokens"):
        mean_reduction_weights([Datum([1, 2], [2, 3], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0])])


def test_weights_give_the_mean_gradient_on_the_local_backend(tiny_model_dir) -> None:
    """Real backend: packed, weighted forward_backward calls accumulate exactly
    mean_d( mean_{t in completion(d)} ppo_loss_t ), computed here independently with autograd."""
    local = pytest.importorskip("retool.backends.local.client")
    client = local.LocalTrainingClient(
        tiny_model_dir, lora=None, device="cpu", dtype="float32", micro_batch_tokens=40
    )
    gen = torch.Generator().manual_seed(0)
    vocab = client.vocab_size

    def traj(reward: float, n_prompt: int, n_comp: int) -> Traj:
        prompt = torch.randint(0, vocab, (n_prompt,), generator=gen).tolist()
        comp = torch.randint(0, vocab, (n_comp,), generator=gen).tolist()
        # Sampler logprobs off the learner's by a little, so ratios differ from 1 and some clip.
        old = (torch.randn(n_comp, generator=gen) * 0.3 - 6.0).tolist()
        return Traj(turns=[Turn(prompt, comp, old)], reward=reward)

    groups = [
        [traj(1.0, 5, 3), traj(-1.0, 4, 9), traj(-1.0, 6, 2)],
        [traj(-1.0, 3, 4), traj(-1.0, 5, 5)],  # degenerate
        [traj(1.0, 7, 6), traj(-1.0, 2, 1)],
    ]
    data = build_step_data(groups)
    params = client.trainable_parameters()
    for d in data.datums:  # recompute old logprobs near the learner's so the ratio is O(1)
        ids = torch.tensor([d.input_tokens])
        lp = client.target_logprobs(ids, torch.ones_like(ids), torch.tensor([d.target_tokens]))[0].detach()
        noise = torch.randn(len(d), generator=gen) * 0.3
        d.logprobs[:] = [float(lp[i] + noise[i]) if w else 0.0 for i, w in enumerate(d.weights)]
    result = client.forward_backward(data.datums, "ppo", {"clip_low": 0.8, "clip_high": 1.28})
    assert result.clip_fraction > 0
    got = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    ref = torch.zeros(())
    for d in data.datums:
        ids = torch.tensor([d.input_tokens])
        lp = client.target_logprobs(ids, torch.ones_like(ids), torch.tensor([d.target_tokens]))[0]
        m = torch.tensor([w != 0.0 for w in d.weights])
        ratio = torch.exp(lp - torch.tensor(d.logprobs))
        adv = torch.tensor(d.advantages)
        per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
        ref = ref + per_token[m].mean()
    (ref / len(data.datums)).backward()
    for g, p in zip(got, params, strict=True):
        assert torch.allclose(g, p.grad, rtol=1e-4, atol=1e-7)
