"""Per-step training metrics (docs/spec.md §6) and ``metrics.jsonl`` (trackers: ``retool.train.trackers``).

Definitions (all over the step's trajectories unless said otherwise):

- task: ``reward_mean``, ``correct_rate``, ``format_rate`` (final answer in a valid format),
  ``degenerate_group_rate`` (groups with all rewards equal / groups), ``void_turn_rate`` (SimpleTIR's void
  turn, ``retool.train.step.is_void``: the last turn has neither a complete call nor an answer),
  ``truncated_rate`` (cut by a token budget, ``is_overlong``); both over every sampled trajectory,
  whether or not the filters (``filter/void_rate``, ``filter/overlong_rate``: over the trajectories of
  trained groups) leave it out.
- sampling: ``groups_sampled`` (every round of dynamic sampling included), ``groups_informative`` (their
  rewards differ), ``informative_share`` (informative / sampled; 1 - ``degenerate_group_rate``),
  ``groups_kept``, ``rounds``.
- category: ``category/<name>/pass_rate``, correct / trajectories of the step's groups of each category
  (``ProblemSource.category``: a Mathematics module; by default the problem's ``data_source``).
- tool: ``code_share``, the tool-call rate (trajectories with >= 1 code call / trajectories; the eval's
  ``tool_call_rate``), ``mean_code_calls``,
  ``correct_without_code_rate`` (correct and no call / trajectories), ``correct_with_code_rate``,
  ``self_correction_rate`` (a call failed, a later one was retried and the trajectory ended correct /
  trajectories), ``self_correction_given_error`` (the same over trajectories that hit an error),
  ``error_rate_correct`` / ``error_rate_wrong`` (correct / wrong trajectories with >= 1 tool error: a
  failed or timed-out execution, a dead executor, an unparsable turn; ``retool.train.roc.tool_errors``),
  ``errors_per_trajectory``.
- roc (Resample-on-Correct, 0 when off): ``error_rate_correct_kept`` / ``error_rate_wrong_kept`` (the same
  over the trajectories kept to train); ``sampling/roc_dropped`` (trajectories it left out).
- env: over this step's executions: ``exec_calls``, ``exec_success_rate``, ``exec_error_rate`` (failures
  other than timeouts and memory-limit kills), ``exec_timeout_rate``, ``exec_memory_limit_rate``,
  ``exec_mean_latency``, ``exec_max_latency`` (seconds).
- faults, this step: ``trajectories_lost`` (ended by an infrastructure failure: ``sampler_error`` +
  ``executor_error``), ``verify_errors`` / ``verify_timeouts`` (answers the verifier could not check,
  scored -1). Since the trainer's components started (``fault_counters``): ``sandbox_worker_failures``
  (calls lost to a dead sandbox worker), ``sandbox_worker_restarts``, ``verifier_worker_restarts``,
  ``remote_calls`` / ``remote_retries`` / ``remote_timeouts`` / ``remote_failures`` /
  ``remote_replays`` (guarded backend calls, see ``retool.backends.remote.guarded``).
- policy: ``ratio_mean/min/max``, ``clip_fraction``, ``loss``, ``grad_norm``, ``lr`` (from the backend),
  ``response_length`` (mean completion tokens: sampled tokens per trajectory). Two entropy figures not to
  confuse: ``entropy``, the exact entropy of the policy's next-token distribution (whole vocabulary, nats)
  averaged over the completion tokens of the datums trained this step, computed by the local backend in
  its training forward (``None`` on a remote service); ``sampled_nll``, the mean negative logprob the
  sampler gave its own tokens over every completion token sampled this step (any backend): a Monte Carlo
  estimate of the sampling policy's entropy at temperature 1, a cross-entropy otherwise. ``ref_kl``: the
  k3 estimate of KL(policy || starting policy), ``exp(d) - d - 1`` with ``d = lp_start - lp`` averaged
  over the trained completion tokens, the start being the LoRA adapter switched off (local backend with
  LoRA, every ``train.ref_kl_every`` steps; ``None`` otherwise); before the first optimizer step it is 0.
- stop: share of each stop reason.
- time: ``refresh``, ``rollout`` (wall), ``sample`` and ``execute`` (summed over trajectories; they
  overlap, so they can exceed the wall time), ``train``, ``checkpoint``, ``step`` (wall), seconds.
- tokens: ``prompt``, ``completion``, ``observation``, ``total`` (sums), ``trained`` (sampled tokens in
  trained datums).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from retool.backends.interface.clients import TrainingClient
from retool.data.problem import Problem
from retool.env.retool import ReToolOutcome, retool_outcome
from retool.jsonl import JsonValue, read_jsonl_objects
from retool.rollout.types import STOP_REASONS, Trajectory  # the rollout stage owns the stop reasons
from retool.sandbox.base import ExecResult
from retool.train.checkpoint import RunWriteError
from retool.train.roc import tool_error_metrics
from retool.train.step import is_overlong, is_void, trajectory_tokens

logger = logging.getLogger(__name__)


def _rate(num: float, den: float) -> float:
    return num / den if den else 0.0


# One line of ``metrics.jsonl``: numbers, and a few lists and strings (problem ids, reward lists).
MetricsRecord = dict[str, JsonValue]


# Stops that say the infrastructure failed (a dead sampler or sandbox), not the policy.
INFRA_STOPS = frozenset({"sampler_error", "executor_error"})


class StepLostError(RuntimeError):
    """Every trajectory of a step ended in an infrastructure failure (a dead sampler or sandbox)."""


def raise_if_step_lost(groups: Sequence[Sequence[Trajectory]], step: int) -> None:
    """Stop the run when a whole step was lost to infrastructure failures.

    One lost trajectory is absorbed (it ends, is counted, the step goes on); a step with nothing but
    lost trajectories means the sampler or the sandbox is down, and going on would only burn steps that
    train nothing. Raised before the step trains or checkpoints, so a resume redoes it.
    """
    outcomes = [t.outcome for g in groups for t in g]
    if not outcomes or not all(o.stop_reason in INFRA_STOPS for o in outcomes):
        return
    reasons = sorted({o.stop_reason for o in outcomes})
    first = next((o.error for o in outcomes if o.error), "no error text")
    raise StepLostError(
        f"step {step}: all {len(outcomes)} trajectories ended in infrastructure failures ({', '.join(reasons)}); "
        f"first error: {first}. Nothing of this step was trained or saved; fix the cause and resume"
    )


def fault_counters(client: TrainingClient, executor: object, verifier: object) -> dict[str, float]:
    """Fault counters of the trainer's components since they started (absent where a component has none).

    Cumulative, so a chart shows when faults happened; a resumed run starts them again from 0.
    """
    out: dict[str, float] = {}
    out.update(client.fault_counters())
    stats = getattr(executor, "stats", None)
    for name in ("worker_failures", "worker_restarts"):
        if isinstance(getattr(stats, name, None), int):
            out[f"faults/sandbox_{name}"] = float(getattr(stats, name))
    kills = getattr(getattr(verifier, "stats", None), "worker_kills", None)
    if isinstance(kills, int):
        out["faults/verifier_worker_restarts"] = float(kills)
    return out


def rollout_metrics(groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
    """Task, tool, environment, stop-reason and token metrics of one step's trajectories."""
    trajs = [t for g in groups for t in g]
    outcomes = [retool_outcome(t.outcome) for t in trajs]
    n = len(trajs)
    m: dict[str, float] = {}
    m["task/reward_mean"] = _rate(sum(float(t.reward) for t in trajs), n)
    m["task/correct_rate"] = _rate(sum(o.correct for o in outcomes), n)
    m["task/format_rate"] = _rate(sum(o.valid_format for o in outcomes), n)
    m["task/trajectories"] = float(n)
    m["task/void_turn_rate"] = _rate(sum(is_void(t) for t in trajs), n)
    m["task/truncated_rate"] = _rate(sum(is_overlong(t) for t in trajs), n)
    m.update(_tool_metrics(outcomes))
    m.update(tool_error_metrics(trajs))
    m.update(_exec_metrics([r for o in outcomes for r in o.exec_results]))
    for reason in STOP_REASONS:
        m[f"stop/{reason}"] = _rate(sum(o.stop_reason == reason for o in outcomes), n)
    m["faults/trajectories_lost"] = float(sum(o.stop_reason in INFRA_STOPS for o in outcomes))
    m["faults/verify_errors"] = float(sum(o.reward_status == "error" for o in outcomes))
    m["faults/verify_timeouts"] = float(sum(o.reward_status == "timeout" for o in outcomes))
    m.update(_token_metrics(trajs))
    m["time/sample"] = sum(float(t.sample_seconds) for t in trajs)
    m["time/execute"] = sum(float(o.exec_seconds) for o in outcomes)
    return m


def category_pass_rates(
    problems: Sequence[Problem], groups: Sequence[Sequence[Trajectory]], category_of: Callable[[Problem], str]
) -> dict[str, float]:
    """``category/<name>/pass_rate`` of the categories sampled: correct over trajectories, every group of
    ``groups`` (one per problem of ``problems``, in order) counted."""
    passed: dict[str, int] = defaultdict(int)
    attempts: dict[str, int] = defaultdict(int)
    for problem, group in zip(problems, groups, strict=True):
        category = category_of(problem)
        passed[category] += sum(1 for t in group if t.outcome.correct)
        attempts[category] += len(group)
    return {f"category/{c}/pass_rate": _rate(passed[c], attempts[c]) for c in sorted(attempts)}


def _tool_metrics(outcomes: Sequence[ReToolOutcome]) -> dict[str, float]:
    """How often the tool was called, and how the calls went for correct answers (``tool/*``)."""
    n = len(outcomes)
    with_code = [o.code_calls > 0 for o in outcomes]
    self_corrected = sum(o.had_error_then_correct for o in outcomes)
    hit_error = sum(any(not r.ok for r in o.exec_results) for o in outcomes)
    return {
        "tool/code_share": _rate(sum(with_code), n),
        "tool/mean_code_calls": _rate(sum(o.code_calls for o in outcomes), n),
        "tool/correct_without_code_rate": _rate(
            sum(o.correct and not wc for o, wc in zip(outcomes, with_code, strict=True)), n
        ),
        "tool/correct_with_code_rate": _rate(
            sum(o.correct and wc for o, wc in zip(outcomes, with_code, strict=True)), n
        ),
        "tool/self_correction_rate": _rate(self_corrected, n),
        "tool/self_correction_given_error": _rate(self_corrected, hit_error),
    }


def _exec_metrics(results: Sequence[ExecResult]) -> dict[str, float]:
    """This step's executions (``env/*``): how they ended and how long they took."""
    k = len(results)
    return {
        "env/exec_calls": float(k),
        "env/exec_success_rate": _rate(sum(r.ok and not r.timed_out for r in results), k),
        "env/exec_timeout_rate": _rate(sum(bool(r.timed_out) for r in results), k),
        "env/exec_error_rate": _rate(sum(r.status == "error" for r in results), k),
        "env/exec_memory_limit_rate": _rate(sum(r.status == "memory_limit" for r in results), k),
        "env/exec_mean_latency": _rate(sum(float(r.latency) for r in results), k),
        "env/exec_max_latency": max((float(r.latency) for r in results), default=0.0),
    }


def _token_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Prompt, completion, observation and total tokens of the step, the mean response length and the
    mean negative sampler logprob of the completion tokens (``policy/sampled_nll``)."""
    prompt = completion = observation = total = 0
    nll = 0.0
    for t in trajs:
        if not t.turns:
            continue
        tokens, logprobs, sampled = trajectory_tokens(t)
        first_prompt = len(t.turns[0].prompt_tokens)
        done = sum(sampled)
        nll -= sum(lp for lp, s in zip(logprobs, sampled, strict=True) if s)
        prompt += first_prompt
        completion += done
        observation += len(tokens) - first_prompt - done
        total += len(tokens)
    return {
        "tokens/prompt": float(prompt),
        "tokens/completion": float(completion),
        "tokens/observation": float(observation),
        "tokens/total": float(total),
        "policy/response_length": _rate(completion, len(trajs)),
        "policy/sampled_nll": _rate(nll, completion),
    }


class MetricsLog:
    """Appends one JSON object per step to ``metrics.jsonl``, flushed and fsynced (it is the record)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def offset(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def append(self, record: MetricsRecord) -> None:
        """Append one line, all of it or nothing: a failed write (ENOSPC...) is cut back off the file, so no
        torn line is left behind, and raises ``RunWriteError`` naming the file and the step."""
        line = json.dumps(_finite(record), sort_keys=True)
        size = self.offset()
        try:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.truncate(self.path, size)  # shrinking needs no space
            raise RunWriteError(
                f"appending step {record.get('step')}'s metrics to {self.path} failed: "
                f"{type(exc).__name__}: {exc}; the file still ends with the previous step, and a resume "
                f"restores the line from the latest checkpoint (retool train --resume {self.path.parent})"
            ) from exc

    def read(self) -> list[MetricsRecord]:
        if not self.path.exists():
            return []
        return read_jsonl_objects(self.path)


def _finite(obj: JsonValue) -> JsonValue:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def scalars_of(record: MetricsRecord) -> dict[str, float]:
    """The numeric, finite entries of a metrics record (trackers take scalars only)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(float(value)):
            out[key] = float(value)
    return out
