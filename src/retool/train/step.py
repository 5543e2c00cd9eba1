"""One RL training step over finished rollouts: datums with the interpreter feedback mask, group-centred
advantages, micro-batch packing, mean-reduction weights, ``forward_backward`` per micro-batch and one
``optim_step``.

Reduction (why the weights look the way they do): every backend sums ``weight * per-token loss`` over
tokens and datums (Tinker semantics; adapters for services that normalise on the server undo that).
The loop wants the gradient of

    L = (1 / N) * sum_d (1 / n_d) * sum_{t in completion(d)} loss_t

i.e. a per-datum token mean, then a plain mean over the N datums actually trained (skipped degenerate
groups do not count). So every sampled completion position of datum ``d`` gets weight ``1 / (n_d * N)``
and every prompt / observation position weight 0. Because the factor lives in the weights, splitting the
datums into micro-batches of any shape accumulates exactly the same gradient.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from retool.backends.interface.clients import TrainingClient
from retool.backends.interface.types import AdamParams, Datum, ForwardBackwardResult, LossName
from retool.backends.training.packing import pack_micro_batches as backend_pack
from retool.rollout.types import (
    NotAPrefixError as NotAPrefixError,
)  # re-exported: the datum builder raises it
from retool.rollout.types import Trajectory, trajectory_tokens

logger = logging.getLogger(__name__)

# Rewards closer than this are "equal": the group carries no learning signal.
_DEGENERATE_TOL = 1e-9


def build_datum(traj: Trajectory, advantage: float, weight: float = 1.0) -> Datum:
    """One datum over the whole trajectory, shifted by one, with the interpreter feedback mask.

    Position ``i`` predicts token ``i + 1``. Where that token was sampled by the model it carries the
    sampler's logprob, ``advantage`` and ``weight``; prompt and observation tokens carry 0 / 0 / 0.
    """
    tokens, logprobs, sampled = trajectory_tokens(traj)
    if len(tokens) < 2:
        raise ValueError("a trajectory needs at least two tokens to make a datum")
    mask = sampled[1:]
    return Datum(
        input_tokens=tokens[:-1],
        target_tokens=tokens[1:],
        logprobs=[lp if m else 0.0 for lp, m in zip(logprobs[1:], mask, strict=True)],
        advantages=[float(advantage) if m else 0.0 for m in mask],
        weights=[float(weight) if m else 0.0 for m in mask],
    )


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """A_i = R_i - mean(R) within one question's group."""
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    return [float(r) - mean for r in rewards]


def is_degenerate(rewards: Sequence[float]) -> bool:
    """All rewards equal (all right or all wrong): every advantage is zero, nothing to learn."""
    return not rewards or max(rewards) - min(rewards) <= _DEGENERATE_TOL


def is_informative(group: Sequence[Trajectory]) -> bool:
    """The one test of a sampled group: its rewards differ, so its advantages carry a gradient. The step
    sampler applies it once per group it keeps (``retool.train.sampling``: ``Collected.group_informative``)
    and ``build_step_data`` trains the groups it marks."""
    return not is_degenerate([float(t.reward) for t in group])


def completion_positions(datum: Datum) -> int:
    """How many positions of a datum are sampled completion tokens (non-zero weight)."""
    return sum(1 for w in datum.weights if w != 0.0)


def mean_reduction_weights(datums: Sequence[Datum]) -> list[Datum]:
    """Return copies whose weights are ``1 / (n_d * N)`` on sampled positions (see module docstring)."""
    n_datums = len(datums)
    out: list[Datum] = []
    for datum in datums:
        n_tokens = completion_positions(datum)
        if n_tokens == 0:
            raise ValueError("a datum without sampled tokens cannot be trained; filter it first")
        w = 1.0 / (n_tokens * n_datums)
        out.append(replace(datum, weights=[w if x != 0.0 else 0.0 for x in datum.weights]))
    return out


def pack_micro_batches(datums: Sequence[Datum], max_tokens: int) -> list[list[int]]:
    """Indices of datums grouped so each micro-batch's padded area (rows x longest row) <= max_tokens.

    The backends' packer over the datums' lengths (one packer for the whole project); a datum longer than
    the budget gets a batch alone.
    """
    return [list(batch) for batch in backend_pack([len(d) for d in datums], max_tokens)]


def is_void(traj: Trajectory) -> bool:
    """SimpleTIR's void turn: the trajectory's last turn has neither a complete call nor a final answer.

    An invalid turn (a broken or extra call, text after a call) or an answer turn without a
    ``\\boxed{}`` (the verifier found no answer) is void. Such turns are full of low-probability tokens;
    SimpleTIR leaves the whole trajectory out of the update to avoid the gradient spikes they cause.
    """
    reason = traj.outcome.stop_reason
    return reason == "invalid" or (reason == "answer" and traj.outcome.reward_status == "no_answer")


def is_overlong(traj: Trajectory) -> bool:
    """Cut by a token budget: the trajectory ran out of context, or its last turn hit the per-turn cap.

    Its reward judges an unfinished attempt, not the policy's answer (DAPO's overlong filtering).
    """
    if traj.outcome.stop_reason == "context_full":
        return True
    turns = traj.turns
    return bool(turns) and turns[-1].sampler_stop == "length"


@dataclass
class StepData:
    """The datums one step trains on, and what was skipped."""

    datums: list[Datum]
    n_groups: int
    n_degenerate: int
    n_trajectories: int
    n_empty: int  # trajectories without a sampled token (e.g. the sampler failed): nothing to train
    advantages: list[list[float]] = field(default_factory=list)
    n_void: int = 0  # left out by the void-turn filter
    n_overlong: int = 0  # left out by the overlong filter (and not already by the void-turn one)
    # Per group, per trajectory: the index of its datum in ``datums``, or None when it was not trained.
    datum_index: list[list[int | None]] = field(default_factory=list)


def build_step_data(
    groups: Sequence[Sequence[Trajectory]],
    *,
    informative: Sequence[bool] | None = None,
    drop_void: bool = False,
    drop_overlong: bool = False,
) -> StepData:
    """Datums of every informative group, weighted for the exact mean over trained datums.

    ``informative`` is the step sampler's verdict on each group (``Collected.group_informative``), read,
    not decided again. Only without one (groups that did not come through the step sampler) is
    ``is_informative`` applied here.
    ``drop_void`` / ``drop_overlong`` leave such trajectories out of the update. Their rewards still
    count in their group's mean (the baseline is the policy's, filters only withhold gradient), and the
    mean-reduction weights count only the datums actually trained.
    """
    if informative is None:  # no step sampler's verdict to read: the same test, so the same groups train
        informative = [is_informative(g) for g in groups]
    elif len(informative) != len(groups):
        raise ValueError(f"{len(informative)} informative verdicts for {len(groups)} groups")
    raw: list[Datum] = []
    n_degenerate = n_empty = n_void = n_overlong = 0
    all_advantages: list[list[float]] = []
    index: list[list[int | None]] = []
    for group, trains in zip(groups, informative, strict=True):
        rewards = [float(t.reward) for t in group]
        advantages = group_advantages(rewards)
        all_advantages.append(advantages)
        slots: list[int | None] = [None] * len(group)
        index.append(slots)
        if not trains:
            n_degenerate += 1
            continue
        for k, (traj, adv) in enumerate(zip(group, advantages, strict=True)):
            if not any(turn.completion_tokens for turn in traj.turns):
                n_empty += 1
                continue
            if drop_void and is_void(traj):
                n_void += 1
                continue
            if drop_overlong and is_overlong(traj):
                n_overlong += 1
                continue
            slots[k] = len(raw)
            raw.append(build_datum(traj, adv))
    return StepData(
        datums=mean_reduction_weights(raw) if raw else [],
        n_groups=len(groups),
        n_degenerate=n_degenerate,
        n_trajectories=sum(len(g) for g in groups),
        n_empty=n_empty,
        advantages=all_advantages,
        n_void=n_void,
        n_overlong=n_overlong,
        datum_index=index,
    )


@dataclass
class TrainStepResult:
    n_datums: int
    n_micro_batches: int
    optimizer_stepped: bool
    forward_backward: ForwardBackwardResult | None
    grad_norm: float = 0.0
    lr: float = 0.0
    padded_tokens: int = 0
    real_tokens: int = 0
    seconds: float = 0.0

    def metrics(self) -> dict[str, float | None]:
        """The step's ``train/*``, ``policy/*`` and ``offpolicy/*`` metrics; ``policy/entropy`` and
        ``policy/ref_kl`` are ``None`` where the backend did not measure them (a remote service; the
        reference KL off this step; no datums)."""
        fb = self.forward_backward
        out: dict[str, float | None] = {
            "train/datums": float(self.n_datums),
            "train/micro_batches": float(self.n_micro_batches),
            "train/optimizer_stepped": float(self.optimizer_stepped),
            "train/padded_tokens": float(self.padded_tokens),
            "train/real_tokens": float(self.real_tokens),
            "policy/grad_norm": self.grad_norm,
            "policy/lr": self.lr,
            "policy/entropy": fb.entropy if fb is not None else None,
            "policy/ref_kl": fb.ref_kl if fb is not None else None,
        }
        if fb is not None:
            out.update(fb.as_metrics("policy/"))
            if fb.mismatch_tokens:  # RL losses: how far the sampler's logprobs are from the trainer's
                out["offpolicy/logprob_diff_mean"] = fb.logprob_diff_mean
                out["offpolicy/logprob_diff_max"] = fb.logprob_diff_max
                out["offpolicy/kl_k3"] = fb.kl_k3
                out["offpolicy/ratio_outside"] = fb.ratio_outside
                out["offpolicy/tis_truncated"] = fb.tis_truncated
        return out


def merge_forward_backward(results: Sequence[ForwardBackwardResult]) -> ForwardBackwardResult:
    """Combine micro-batch results: losses add (weights already hold the reduction), ratios token-weighted."""
    total_tokens = sum(r.trained_tokens for r in results)
    denom = total_tokens or 1

    def weighted(attr: str) -> float:
        if not total_tokens:
            return sum(getattr(r, attr) for r in results) / max(len(results), 1)
        return sum(getattr(r, attr) * r.trained_tokens for r in results) / denom

    # Backend extras are per-call figures (means, efficiencies): combine them token-weighted too.
    extra: dict[str, float] = {}
    for key in {k for r in results for k in r.extra}:
        have = [r for r in results if key in r.extra]
        tokens = sum(r.trained_tokens for r in have)
        if tokens:
            extra[key] = sum(r.extra[key] * r.trained_tokens for r in have) / tokens
        else:
            extra[key] = sum(r.extra[key] for r in have) / len(have)
    measured = sum(r.mismatch_tokens for r in results)

    def per_measured(attr: str) -> float:
        return sum(getattr(r, attr) * r.mismatch_tokens for r in results) / measured if measured else 0.0

    def where_measured(attr: str) -> float | None:
        """Token-weighted over the calls that measured ``attr``; None when none did."""
        have = [(getattr(r, attr), r.trained_tokens) for r in results if getattr(r, attr) is not None]
        tokens = sum(n for _, n in have)
        if not have:
            return None
        return sum(v * n for v, n in have) / tokens if tokens else sum(v for v, _ in have) / len(have)

    return ForwardBackwardResult(
        loss=sum(r.loss for r in results),
        trained_tokens=total_tokens,
        ratio_mean=weighted("ratio_mean"),
        ratio_min=min((r.ratio_min for r in results), default=1.0),
        ratio_max=max((r.ratio_max for r in results), default=1.0),
        clip_fraction=weighted("clip_fraction"),
        mismatch_tokens=measured,
        logprob_diff_mean=per_measured("logprob_diff_mean"),
        logprob_diff_max=max((r.logprob_diff_max for r in results), default=0.0),
        kl_k3=per_measured("kl_k3"),
        ratio_outside=per_measured("ratio_outside"),
        tis_truncated=per_measured("tis_truncated"),
        entropy=where_measured("entropy"),
        ref_kl=where_measured("ref_kl"),
        extra=extra,
    )


async def train_step(
    client: TrainingClient,
    datums: Sequence[Datum],
    *,
    loss_fn: LossName,
    loss_config: dict[str, float] | None,
    adam: AdamParams,
    micro_batch_tokens: int,
) -> TrainStepResult:
    """``forward_backward`` on every micro-batch, then exactly one ``optim_step`` (none without datums).

    ``datums`` must already carry their reduction weights (``build_step_data``). A client that says
    ``one_call_per_step`` (a remote service whose reduction divides the step's gradient by the datums it
    accumulated, ``retool.backends.training.reduction``) gets the whole step in one call; the service batches it.
    """
    start = time.perf_counter()
    if not datums:
        return TrainStepResult(0, 0, False, None, seconds=time.perf_counter() - start)
    if client.one_call_per_step:
        batches = [list(range(len(datums)))]
    else:
        batches = pack_micro_batches(datums, micro_batch_tokens)
    results: list[ForwardBackwardResult] = []
    padded = 0
    for batch in batches:
        chunk = [datums[i] for i in batch]
        padded += max(len(d) for d in chunk) * len(chunk)
        results.append(await client.forward_backward_async(chunk, loss_fn, loss_config))
    optim = await client.optim_step_async(adam)
    return TrainStepResult(
        n_datums=len(datums),
        n_micro_batches=len(batches),
        optimizer_stepped=True,
        forward_backward=merge_forward_backward(results),
        grad_norm=float(optim.grad_norm),
        lr=float(optim.lr),
        padded_tokens=padded,
        real_tokens=sum(len(d) for d in datums),
        seconds=time.perf_counter() - start,
    )
