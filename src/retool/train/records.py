"""The trajectory record: one finished trajectory as the viewer reads it, and the JSONL writer of a run.

This module owns the record shape (``RECORD_VERSION``) that training (``trajectories.jsonl`` beside
``metrics.jsonl``, in the run folder the trainer owns) and evaluation (``--save-transcripts``: a
candidate's ``"trajectory"``) both write, so one viewer (``retool.view``) reads both. A record holds the messages, each assistant turn (text, parsed kind, sampler stop,
code, executor result, the observation fed back), reward, advantage, stop reason, token counts and the
token spans of the whole sequence, each marked trained or masked.

Where "trained" comes from (``mask_source``):

- ``"datum"``: the training datum's own weights (a position with weight 0 is masked); the mask is read
  off the datum the trainer received, never recomputed from the turns.
- ``"untrained"``: the trajectory was rolled out but no datum was trained on it (a degenerate group, all
  rewards equal, or nothing sampled); every span says ``trained: false``.
- ``"turn_structure"``: evaluation, where there is no datum: completion tokens count as sampled
  (``trained: true``, what training *would* weight) and prompt / observation tokens as masked.

Spans cover the full token sequence (the last turn's prompt + completion) in order, split where the turn
structure changes (``role``: ``prompt`` for the first prompt, ``completion`` for sampled tokens,
``observation`` for what came back between turns: interpreter output and chat-template glue) and where
the trained flag changes. Token ``j`` is trained when datum position ``j - 1`` (which predicts it) has a
non-zero weight; token 0 is never predicted, so never trained.

Model output is hostile text: the record stores it verbatim; escaping is the renderer's job.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from retool.backends.types import Datum
from retool.train.step import group_advantages, trajectory_tokens

logger = logging.getLogger(__name__)

RECORD_VERSION = 1
TRAJECTORIES_FILE = "trajectories.jsonl"

MaskSource = Literal["datum", "untrained", "turn_structure"]
Decode = Callable[[list[int]], str]
GroupsPerStep = int | Literal["all"]


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, end)`` of the full sequence with one role, one turn and one trained flag."""

    start: int
    end: int
    role: str  # prompt | completion | observation
    turn: int  # the assistant turn it belongs to (an observation: the turn whose call it answers)
    trained: bool

    def to_json(self, tokens: Sequence[int], decode: Decode | None) -> dict[str, Any]:
        return {
            "start": self.start,
            "end": self.end,
            "role": self.role,
            "turn": self.turn,
            "trained": self.trained,
            # None (not "") when there is no tokenizer: the viewer then says the text was not decoded.
            "text": decode(list(tokens[self.start : self.end])) if decode is not None else None,
        }


def datum_tokens(datum: Datum) -> list[int]:
    """The full token sequence a datum was shifted from (``input_tokens`` + the last target)."""
    if not datum.target_tokens:
        return list(datum.input_tokens)
    return [*datum.input_tokens, datum.target_tokens[-1]]


def trained_flags_from_datum(datum: Datum) -> list[bool]:
    """Per full-sequence token: was it trained? Token ``j`` is predicted by position ``j - 1``."""
    return [False, *(w != 0.0 for w in datum.weights)]


def _role_runs(traj: Any) -> list[tuple[int, int, str, int]]:
    """(start, end, role, turn) of each turn-structure segment, from the turns' token lists."""
    runs: list[tuple[int, int, str, int]] = []
    pos = 0
    for index, turn in enumerate(traj.turns):
        prompt_len = len(turn.prompt_tokens)
        if prompt_len > pos:  # the first prompt, or what came back after the previous turn
            runs.append((pos, prompt_len, "prompt" if index == 0 else "observation", max(index - 1, 0)))
        end = prompt_len + len(turn.completion_tokens)
        if end > prompt_len:
            runs.append((prompt_len, end, "completion", index))
        pos = end
    return runs


def build_spans(traj: Any, trained: Sequence[bool]) -> list[Span]:
    """Split the turn-structure segments further wherever the trained flag changes."""
    spans: list[Span] = []
    for start, end, role, turn in _role_runs(traj):
        run_start = start
        for j in range(start + 1, end + 1):
            if j == end or trained[j] != trained[run_start]:
                spans.append(Span(run_start, j, role, turn, bool(trained[run_start])))
                run_start = j
    return spans


def _exec_json(result: Any) -> dict[str, Any]:
    return {
        "ok": bool(getattr(result, "ok", False)),
        "stdout": str(getattr(result, "stdout", "") or ""),
        "stderr": str(getattr(result, "stderr", "") or ""),
        "returncode": getattr(result, "returncode", None),
        "timed_out": bool(getattr(result, "timed_out", False)),
        "latency": round(float(getattr(result, "latency", 0.0) or 0.0), 6),
        "truncated": bool(getattr(result, "truncated", False)),
        "memory_killed": bool(getattr(result, "memory_killed", False)),
    }


def _turn_records(traj: Any) -> list[dict[str, Any]]:
    """Each assistant turn with the call it made, what the executor answered and what the model saw."""
    codes = list(getattr(traj, "codes", None) or [])
    results = list(getattr(traj, "exec_results", None) or [])
    observations = list(getattr(traj, "observations", None) or [])
    trimmed = list(getattr(traj, "observations_trimmed", None) or [])
    out: list[dict[str, Any]] = []
    call = 0  # executed calls happen in turn order, one per tool turn (only the last may go unexecuted)
    for index, turn in enumerate(traj.turns):
        kind = str(getattr(turn, "kind", "") or "")
        entry: dict[str, Any] = {
            "index": index,
            "text": str(getattr(turn, "text", "") or ""),
            "kind": kind,
            "sampler_stop": str(getattr(turn, "sampler_stop", "") or ""),
            "completion_tokens": len(getattr(turn, "completion_tokens", None) or []),
            "code": None,
            "exec": None,
            "observation": None,
            "observation_trimmed": False,
        }
        if kind == "tool" and call < len(codes):
            entry["code"] = codes[call]
            if call < len(results):
                entry["exec"] = _exec_json(results[call])
            if call < len(observations):
                entry["observation"] = observations[call]
                entry["observation_trimmed"] = bool(trimmed[call]) if call < len(trimmed) else False
            call += 1
        out.append(entry)
    return out


def _has_tokens(traj: Any) -> bool:
    return all(hasattr(t, "prompt_tokens") and hasattr(t, "completion_tokens") for t in traj.turns)


def trajectory_record(
    traj: Any,
    *,
    source: Literal["train", "eval"],
    advantage: float | None,
    datum: Datum | None = None,
    step: int | None = None,
    mode: str = "retool",
    decode: Decode | None = None,
) -> dict[str, Any]:
    """One finished trajectory as a JSON-ready record (see the module docstring for the span rules).

    ``datum``: the datum trained on this trajectory (weights as the trainer received them), or None.
    For ``source="train"`` a missing datum means the trajectory was not trained (``"untrained"``); for
    ``source="eval"`` the spans come from the turn structure. ``decode`` turns token ids into text (the
    protocol's ``decode``); without it spans carry ``text: null``. Objects that lack token lists (test
    fakes) give a record without spans.

    Long because the record is one flat literal of the schema's fields; split up, the schema would be
    spread over helpers.
    """
    problem = traj.problem
    tokens: list[int] = []
    sampled: list[bool] = []
    if traj.turns and _has_tokens(traj):
        tokens, _, sampled = trajectory_tokens(traj)
    mask_source: MaskSource
    weight: float | None = None
    if datum is not None:
        if datum_tokens(datum) != tokens:
            raise ValueError(
                f"problem {problem.id!r} branch {traj.group_index}: the datum is not this trajectory's"
            )
        trained = trained_flags_from_datum(datum)
        mask_source = "datum"
        weight = next((w for w in datum.weights if w != 0.0), None)
    elif source == "eval":
        trained = list(sampled)
        mask_source = "turn_structure"
    else:
        trained = [False] * len(tokens)
        mask_source = "untrained"
    spans = build_spans(traj, trained) if tokens else []
    n_prompt = len(traj.turns[0].prompt_tokens) if tokens else 0
    n_completion = sum(sampled)
    results = list(getattr(traj, "exec_results", None) or [])
    code_calls = traj.code_calls if isinstance(traj.code_calls, int) else len(traj.code_calls or ())
    return {
        "version": RECORD_VERSION,
        "source": source,
        "step": step,
        # the policy version that sampled it (training; lags ``step - 1`` by up to max_steps_off_policy)
        "policy_version": getattr(traj, "policy_version", None),
        "mode": mode,
        "problem_id": str(problem.id),
        "problem_index": int(getattr(traj, "problem_index", 0) or 0),
        "group_index": int(traj.group_index),
        "question": str(getattr(problem, "question", "")),
        "reference": str(getattr(problem, "answer", "")),
        "data_source": str(getattr(problem, "data_source", "") or ""),
        "answer": traj.answer,
        "correct": bool(traj.correct),
        "valid_format": bool(traj.valid_format),
        "reward": float(traj.reward),
        "reward_status": str(getattr(traj, "reward_status", "") or ""),
        "advantage": None if advantage is None else float(advantage),
        "stop_reason": str(traj.stop_reason),
        "error": getattr(traj, "error", None),
        "code_calls": int(code_calls),
        "exec_errors": sum(1 for r in results if not r.ok or r.timed_out),
        "sample_seconds": round(float(getattr(traj, "sample_seconds", 0.0) or 0.0), 4),
        "exec_seconds": round(float(getattr(traj, "exec_seconds", 0.0) or 0.0), 4),
        "mask_source": mask_source,
        "datum_weight": weight,
        "tokens": {
            "prompt": n_prompt,
            "completion": n_completion,
            "observation": len(tokens) - n_prompt - n_completion,
            "total": len(tokens),
            "trained": sum(s.end - s.start for s in spans if s.trained),
        },
        "messages": list(getattr(traj, "messages", None) or []),
        "turns": _turn_records(traj),
        "spans": [s.to_json(tokens, decode) for s in spans],
    }


# -- training: which datum belongs to which trajectory ----------------------------------------------


def match_datums(groups: Sequence[Sequence[Any]], datums: Sequence[Datum]) -> dict[tuple[int, int], Datum]:
    """Map (group, branch) -> the datum trained on that trajectory, matched by token sequence.

    Matching by content (not by replaying the order ``build_step_data`` happens to use) keeps this right
    when the step's datum selection changes (filters, dynamic sampling). Two branches with identical
    tokens share a reward, hence an advantage, so which of their datums goes where does not matter.
    """
    by_tokens: dict[tuple[int, ...], list[Datum]] = {}
    for datum in datums:
        by_tokens.setdefault(tuple(datum_tokens(datum)), []).append(datum)
    out: dict[tuple[int, int], Datum] = {}
    for g, group in enumerate(groups):
        for b, traj in enumerate(group):
            if not traj.turns:
                continue
            found = by_tokens.get(tuple(trajectory_tokens(traj)[0]))
            if found:
                out[(g, b)] = found.pop(0)
    return out


def datum_advantage(datum: Datum) -> float | None:
    """The advantage a datum carries on its trained positions (the same on all of them)."""
    return next((a for a, w in zip(datum.advantages, datum.weights, strict=False) if w != 0.0), None)


# -- the run's trajectories.jsonl ---------------------------------------------------------------------


def select_groups(n_groups: int, groups_per_step: GroupsPerStep, seed: int, step: int) -> list[int]:
    """Which groups of a step to keep: all, none, or a seeded sample (the same again on a redone step)."""
    if groups_per_step == "all" or groups_per_step >= n_groups:
        return list(range(n_groups))
    if groups_per_step <= 0:
        return []
    rng = random.Random(seed * 1_000_003 + step)
    return sorted(rng.sample(range(n_groups), groups_per_step))


class TrajectoryLog:
    """Appends sampled trajectories of each training step to ``trajectories.jsonl``.

    One ``write`` + flush + fsync per step, so a kill leaves at most a partial last line (readers skip
    it). On the first step a process writes, records of that step and later ones (left by a run killed
    after its last checkpoint and now resumed, or a partial line) are cut away first, which keeps the
    file in step with ``metrics.jsonl`` without the loop having to call a repair.
    """

    def __init__(self, path: str | Path, groups_per_step: GroupsPerStep = 2, seed: int = 0) -> None:
        self.path = Path(path)
        self.groups_per_step = groups_per_step
        self.seed = seed
        self._checked = False

    def write_step(
        self,
        step: int,
        groups: Sequence[Sequence[Any]],
        datums: Sequence[Datum],
        decode: Decode | None = None,
    ) -> int:
        """Record the selected groups of ``step``; returns how many trajectories were written.

        Never raises: the log is a by-product of training, so a failure here is logged, not fatal.
        """
        try:
            return self._write_step(step, groups, datums, decode)
        except Exception:
            logger.exception("writing the trajectories of step %d to %s failed", step, self.path)
            return 0

    def _write_step(
        self, step: int, groups: Sequence[Sequence[Any]], datums: Sequence[Datum], decode: Decode | None
    ) -> int:
        if not self._checked:
            cut_from_step(self.path, step)
            self._checked = True
        chosen = select_groups(len(groups), self.groups_per_step, self.seed, step)
        if not chosen:
            return 0
        matched = match_datums(groups, datums)
        lines: list[str] = []
        for g in chosen:
            group = groups[g]
            advantages = group_advantages([float(t.reward) for t in group])
            for b, traj in enumerate(group):
                datum = matched.get((g, b))
                advantage = datum_advantage(datum) if datum is not None else advantages[b]
                record = trajectory_record(
                    traj, source="train", advantage=advantage, datum=datum, step=step, decode=decode
                )
                record["group"] = g
                lines.append(json.dumps(record, ensure_ascii=False))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in lines))
            fh.flush()
            os.fsync(fh.fileno())
        return len(lines)


def cut_from_step(path: Path, step: int) -> int:
    """Truncate ``path`` before its first record with ``step >= step`` or its first unreadable line.

    Returns the bytes removed. Records are appended in step order, so everything after that point is
    from steps that will be redone.
    """
    if not path.exists():
        return 0
    offset = 0
    cut: int | None = None
    with path.open("rb") as fh:
        for raw in fh:
            try:
                obj = json.loads(raw) if raw.strip() else {}
                bad = not raw.endswith(b"\n") or int(obj.get("step", 0) or 0) >= step
            except (ValueError, AttributeError, TypeError):
                bad = True
            if bad:
                cut = offset
                break
            offset += len(raw)
    if cut is None:
        return 0
    size = path.stat().st_size
    with path.open("r+b") as fh:
        fh.truncate(cut)
        fh.flush()
        os.fsync(fh.fileno())
    logger.info("%s: dropped %d bytes of trajectories from step %d on (redone now)", path, size - cut, step)
    return size - cut


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of a ``trajectories.jsonl``, read-only; an unreadable line (a run being written) is skipped."""
    with Path(path).open(encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, Mapping):
                yield dict(obj)


# -- evaluation ---------------------------------------------------------------------------------------


def attach_eval_transcripts(
    candidates: Sequence[dict[str, Any]], trajectories: Sequence[Any], *, mode: str, decode: Decode | None
) -> None:
    """Add each candidate's ``"trajectory"`` record (same shape as training; spans from the turn structure).

    The advantage is the group-centred reward over the problem's candidates, what training would use.
    """
    advantages = group_advantages([float(t.reward) for t in trajectories])
    for candidate, traj, advantage in zip(candidates, trajectories, advantages, strict=True):
        candidate["trajectory"] = trajectory_record(
            traj, source="eval", advantage=advantage, mode=mode, decode=decode
        )
