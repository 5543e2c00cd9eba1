"""Pure evaluation metrics over per-problem records: no I/O, no clocks, no global state.

A *record* is one problem's JSON dict as written by the eval runner: ``{"id", "reference", "seed",
"candidates": [candidate, ...]}``; a *candidate* is one sampled answer (trajectory) with the keys
``answer, correct, valid_format, code_calls, turns, stop_reason, exec_latencies, exec_errors,
exec_timeouts, self_corrected, completion_tokens``. Every function here reads only those keys, so the
summary of an eval is a function of its records alone (which is what makes a resumed eval's summary
equal an uninterrupted one's).

Definitions (N candidates per problem, c of them correct):
- Average@N: mean over problems of c / N (the expected accuracy of one answer).
- Pass@N: share of problems with c >= 1.
- pass@k (k <= N): the unbiased Codex estimator, mean over problems of 1 - C(N-c, k) / C(N, k).
- maj@N: majority vote over normalised answers (candidates without an answer do not vote). A tie
  between several most-voted answers is scored as its expectation under a uniformly random
  tie-break: (tied answers that are correct) / (tied answers). A problem where nobody answered
  scores 0. An answer group counts as correct when at least half of its members were verified correct
  (they normally all agree; normalisation only merges spellings).
- self-correction (``self_corrected``: an execution failed or timed out, the model called the tool again
  and ended correct): ``self_correction_rate`` over all candidates (as in the training metrics) and
  ``self_correction_given_error`` over candidates that hit an execution error (``None`` if none did).
- 95% bootstrap CI for Average@N: resample problems with replacement (seeded), percentile interval.
  ``headline_intervals`` gives the same kind of interval for Average@N, Pass@N, the format rate and the
  tool-call rate, each the mean over problems of a per-problem value (the viewer's error bars).
- Paired gain of B over A on the same problems (``paired_gain``): the mean of the per-problem accuracy
  differences, with a paired bootstrap interval (problems resampled together, so what both models find
  easy or hard cancels out and the interval measures the gain, not the spread of problem difficulty).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TypedDict

import numpy as np

from retool.evaluate.store import CandidateRecord as Candidate
from retool.evaluate.store import ProblemRecord as Record
from retool.jsonl import JsonObject, JsonValue


class PairedGain(TypedDict):
    gain: float
    ci95: list[float]  # [lo, hi]
    problems: int


class Interval(TypedDict):
    """A mean over problems and its bootstrap interval."""

    value: float
    lo: float
    hi: float


def _candidates(records: Sequence[Record]) -> list[Candidate]:
    return [c for r in records for c in r["candidates"]]


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def n_correct(record: Record) -> int:
    return sum(1 for c in record["candidates"] if c.get("correct"))


def _share(record: Record, hit: Callable[[Candidate], bool]) -> float:
    """The share of one problem's candidates for which ``hit`` holds (a problem with none scores 0)."""
    cands = record["candidates"]
    return sum(1 for c in cands if hit(c)) / len(cands) if cands else 0.0


def per_problem_accuracy(records: Sequence[Record]) -> list[float]:
    """c / N for each problem (a problem with no candidates scores 0)."""
    return [_share(r, lambda c: bool(c.get("correct"))) for r in records]


def average_at_n(records: Sequence[Record]) -> float:
    return _mean(per_problem_accuracy(records))


def pass_at_n(records: Sequence[Record]) -> float:
    return _mean([1.0 if n_correct(r) > 0 else 0.0 for r in records])


def pass_at_k_estimate(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with n samples, c correct (Chen et al. 2021): 1 - C(n-c,k)/C(n,k)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k(records: Sequence[Record], k: int) -> float:
    return _mean([pass_at_k_estimate(len(r["candidates"]), n_correct(r), k) for r in records])


def pass_at_k_curve(records: Sequence[Record]) -> dict[int, float]:
    """pass@k for every k from 1 to the smallest candidate count over problems."""
    if not records:
        return {}
    n_min = min(len(r["candidates"]) for r in records)
    return {k: pass_at_k(records, k) for k in range(1, n_min + 1)}


_LATEX_NOISE = re.compile(r"\\[,!;: ]|\\left|\\right|\\displaystyle|\$")
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?|°")


def normalize_answer(answer: str | None) -> str | None:
    """A canonical spelling for voting: strips LaTeX spacing, $, \\text{}, degrees, %, trailing dots, and
    writes numbers canonically (``"070" -> "70"``, ``"12.0" -> "12"``, ``"1,000" -> "1000"``)."""
    if answer is None:
        return None
    s = _LATEX_NOISE.sub("", answer)
    s = _TEXT_WRAP.sub(r"\1", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "").replace("%", "").replace("dfrac", "frac").replace("tfrac", "frac")
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d*)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)", s):
        value = float(s)
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return repr(value)
    return s or None


def majority_score(record: Record) -> float:
    """maj@N score of one problem (see module docstring for the tie rule)."""
    groups: dict[str, list[bool]] = {}
    for c in record["candidates"]:
        key = normalize_answer(c.get("answer"))
        if key is not None:
            groups.setdefault(key, []).append(bool(c["correct"]))
    if not groups:
        return 0.0
    top = max(len(v) for v in groups.values())
    tied = [v for v in groups.values() if len(v) == top]
    return sum(1.0 for v in tied if sum(v) * 2 >= len(v)) / len(tied)


def maj_at_n(records: Sequence[Record]) -> float:
    return _mean([majority_score(r) for r in records])


def bootstrap_ci(
    values: Sequence[float], *, resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (resampled with replacement, seeded)."""
    if not values:
        return (0.0, 0.0)
    arr = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(arr), size=(resamples, len(arr)))
    means = arr[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return (float(lo), float(hi))


def paired_gain(
    before: Sequence[Record],
    after: Sequence[Record],
    *,
    resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> PairedGain:
    """Average@N of ``after`` minus ``before`` on the same problems, with its paired bootstrap interval.

    Problems are matched by ``id``; both evals must cover the same set (a mismatch is an error, since a
    gain over different problems means nothing).
    """
    acc_a = {str(r["id"]): a for r, a in zip(before, per_problem_accuracy(before), strict=True)}
    acc_b = {str(r["id"]): a for r, a in zip(after, per_problem_accuracy(after), strict=True)}
    if set(acc_a) != set(acc_b):
        missing = sorted(set(acc_a) ^ set(acc_b))
        raise ValueError(f"paired_gain needs the same problems in both evals; unmatched ids: {missing[:5]}")
    ids = sorted(acc_a)
    diffs = [acc_b[i] - acc_a[i] for i in ids]
    lo, hi = bootstrap_ci(diffs, resamples=resamples, confidence=confidence, seed=seed)
    return {"gain": _mean(diffs), "ci95": [lo, hi], "problems": len(ids)}


def headline_intervals(
    records: Sequence[Record], *, resamples: int = 1000, seed: int = 0
) -> dict[str, Interval]:
    """Average@N, Pass@N, the format rate and the tool-call rate as means over problems of a per-problem
    value, each with its percentile bootstrap interval over problems (``bootstrap_ci``). A candidate
    missing a key counts as not having it (older records, see ``CandidateRecord``)."""
    per_problem = {
        "average_at_n": per_problem_accuracy(records),
        "pass_at_n": [1.0 if n_correct(r) > 0 else 0.0 for r in records],
        "format_rate": [_share(r, lambda c: bool(c.get("valid_format"))) for r in records],
        "tool_call_rate": [_share(r, lambda c: int(c.get("code_calls", 0)) > 0) for r in records],
    }
    out: dict[str, Interval] = {}
    for key, values in per_problem.items():
        lo, hi = bootstrap_ci(values, resamples=resamples, seed=seed)
        out[key] = {"value": _mean(values), "lo": lo, "hi": hi}
    return out


def _had_exec_error(c: Candidate) -> bool:
    return int(c.get("exec_errors", 0)) + int(c.get("exec_timeouts", 0)) > 0


def summarize(
    records: Sequence[Record], *, bootstrap_resamples: int = 2000, bootstrap_seed: int = 0
) -> JsonObject:
    """Every metric of an eval, as a JSON-ready dict. Deterministic for given records."""
    cands = _candidates(records)
    n_values = sorted({len(r["candidates"]) for r in records})
    latencies = [float(x) for c in cands for x in c.get("exec_latencies", [])]
    erred = [c for c in cands if _had_exec_error(c)]
    acc = per_problem_accuracy(records)
    lo, hi = bootstrap_ci(acc, resamples=bootstrap_resamples, seed=bootstrap_seed)
    stop_reasons = Counter(str(c.get("stop_reason")) for c in cands)
    tokens = [int(c.get("completion_tokens", 0)) for c in cands]
    n_exec = len(latencies)
    exec_errors = sum(int(c.get("exec_errors", 0)) for c in cands)
    exec_timeouts = sum(int(c.get("exec_timeouts", 0)) for c in cands)
    val_n: JsonValue = n_values[0] if len(n_values) == 1 else list[JsonValue](n_values)
    return {
        "problems": len(records),
        "candidates": len(cands),
        "val_n": val_n,
        "average_at_n": average_at_n(records),
        "average_at_n_ci95": [lo, hi],
        "pass_at_n": pass_at_n(records),
        "pass_at_k": {str(k): v for k, v in pass_at_k_curve(records).items()},
        "maj_at_n": maj_at_n(records),
        "format_rate": _mean([1.0 if c["valid_format"] else 0.0 for c in cands]),
        "tool_call_rate": _mean([1.0 if int(c["code_calls"]) > 0 else 0.0 for c in cands]),
        "mean_code_calls": _mean([float(c["code_calls"]) for c in cands]),
        "mean_turns": _mean([float(c["turns"]) for c in cands]),
        "correct_without_code_rate": _mean(
            [1.0 if c["correct"] and int(c["code_calls"]) == 0 else 0.0 for c in cands]
        ),
        "self_correction_rate": _mean([1.0 if c.get("self_corrected") else 0.0 for c in cands]),
        "self_correction_given_error": (
            _mean([1.0 if c.get("self_corrected") else 0.0 for c in erred]) if erred else None
        ),
        "executions": n_exec,
        "exec_error_rate": exec_errors / n_exec if n_exec else 0.0,
        "exec_timeout_rate": exec_timeouts / n_exec if n_exec else 0.0,
        "mean_exec_latency": _mean(latencies),
        "total_exec_latency": float(sum(latencies)),
        "tokens_generated": int(sum(tokens)),
        "mean_completion_tokens": _mean([float(t) for t in tokens]),
        "stop_reasons": dict(sorted(stop_reasons.items())),
    }
