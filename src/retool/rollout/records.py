"""The trajectory record: one finished trajectory as the viewer reads it.

This module owns the record shape (``RECORD_VERSION``) that training (``trajectories.jsonl``, written by
``retool.train.records.TrajectoryLog``) and evaluation (``--save-transcripts``: a candidate's
``"trajectory"``) both write, so one viewer (``retool.view``) reads both. It sits next to the
``Trajectory`` it records. A record holds the messages, each assistant turn (text, parsed kind, sampler stop,
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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypedDict

from retool.backends.interface.types import Datum
from retool.env.retool import ReToolOutcome, retool_outcome
from retool.protocol.chat import Message
from retool.rollout.types import Trajectory, trajectory_tokens
from retool.sandbox.base import ExecResult

RECORD_VERSION = 1

MaskSource = Literal["datum", "untrained", "turn_structure"]
Decode = Callable[[list[int]], str]


class SpanRecord(TypedDict):
    start: int
    end: int
    role: str
    turn: int
    trained: bool
    text: str | None


class ExecRecord(TypedDict):
    ok: bool
    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    latency: float
    truncated: bool
    memory_killed: bool


class TurnRecord(TypedDict):
    index: int
    text: str
    kind: str
    sampler_stop: str
    completion_tokens: int
    code: str | None
    exec: ExecRecord | None
    observation: str | None
    observation_trimmed: bool


class TokenCounts(TypedDict, total=False):
    prompt: int
    completion: int
    observation: int
    total: int
    trained: int


class TrajectoryRecord(TypedDict, total=False):
    """One line of ``trajectories.jsonl`` (or an eval candidate's ``"trajectory"``).

    Not total: the viewer also shows eval candidates saved without a transcript, which carry only the
    summary keys (``transcript: False``), and records read back from disk are whatever the file holds.
    """

    version: int
    source: str
    step: int | None
    policy_version: int | None
    mode: str
    problem_id: str
    problem_index: int
    group_index: int
    group: int  # training: the group's index among the step's groups
    question: str
    reference: str
    data_source: str
    answer: str | None
    correct: bool
    valid_format: bool
    reward: float
    reward_status: str
    advantage: float | None
    stop_reason: str
    error: str | None
    code_calls: int
    exec_errors: int
    sample_seconds: float
    exec_seconds: float
    mask_source: str
    datum_weight: float | None
    tokens: TokenCounts
    messages: Sequence[Message]
    turns: list[TurnRecord]
    spans: list[SpanRecord]
    final_text_tail: str
    transcript: bool


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, end)`` of the full sequence with one role, one turn and one trained flag."""

    start: int
    end: int
    role: str  # prompt | completion | observation
    turn: int  # the assistant turn it belongs to (an observation: the turn whose call it answers)
    trained: bool

    def to_json(self, tokens: Sequence[int], decode: Decode | None) -> SpanRecord:
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


def _role_runs(traj: Trajectory) -> list[tuple[int, int, str, int]]:
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


def build_spans(traj: Trajectory, trained: Sequence[bool]) -> list[Span]:
    """Split the turn-structure segments further wherever the trained flag changes."""
    spans: list[Span] = []
    for start, end, role, turn in _role_runs(traj):
        run_start = start
        for j in range(start + 1, end + 1):
            if j == end or trained[j] != trained[run_start]:
                spans.append(Span(run_start, j, role, turn, bool(trained[run_start])))
                run_start = j
    return spans


def _exec_json(result: ExecResult) -> ExecRecord:
    return {
        "ok": result.ok,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "returncode": result.returncode,
        "timed_out": result.timed_out,
        "latency": round(float(result.latency), 6),
        "truncated": result.truncated,
        "memory_killed": result.memory_killed,
    }


def _turn_records(traj: Trajectory, outcome: ReToolOutcome) -> list[TurnRecord]:
    """Each assistant turn with the call it made, what the executor answered and what the model saw."""
    codes, results = outcome.codes, outcome.exec_results
    observations, trimmed = outcome.observations, outcome.observations_trimmed
    out: list[TurnRecord] = []
    call = 0  # executed calls happen in turn order, one per tool turn (only the last may go unexecuted)
    for index, turn in enumerate(traj.turns):
        entry: TurnRecord = {
            "index": index,
            "text": turn.text,
            "kind": turn.kind,
            "sampler_stop": turn.sampler_stop,
            "completion_tokens": len(turn.completion_tokens),
            "code": None,
            "exec": None,
            "observation": None,
            "observation_trimmed": False,
        }
        if turn.kind == "tool" and call < len(codes):
            entry["code"] = codes[call]
            if call < len(results):
                entry["exec"] = _exec_json(results[call])
            if call < len(observations):
                entry["observation"] = observations[call]
                entry["observation_trimmed"] = bool(trimmed[call]) if call < len(trimmed) else False
            call += 1
        out.append(entry)
    return out


def _trained_flags(
    traj: Trajectory, tokens: list[int], sampled: list[bool], source: str, datum: Datum | None
) -> tuple[list[bool], MaskSource, float | None]:
    """Per token: trained or not; where that came from; the datum's weight (None without a datum)."""
    if datum is not None:
        if datum_tokens(datum) != tokens:
            raise ValueError(
                f"problem {traj.problem.id!r} branch {traj.group_index}: the datum is not this trajectory's"
            )
        weight = next((w for w in datum.weights if w != 0.0), None)
        return trained_flags_from_datum(datum), "datum", weight
    if source == "eval":
        return list(sampled), "turn_structure", None
    return [False] * len(tokens), "untrained", None


def trajectory_record(
    traj: Trajectory,
    *,
    source: Literal["train", "eval"],
    advantage: float | None,
    datum: Datum | None = None,
    step: int | None = None,
    mode: str = "retool",
    decode: Decode | None = None,
) -> TrajectoryRecord:
    """One finished trajectory as a JSON-ready record (see the module docstring for the span rules).

    ``datum``: the datum trained on this trajectory (weights as the trainer received them), or None.
    For ``source="train"`` a missing datum means the trajectory was not trained (``"untrained"``); for
    ``source="eval"`` the spans come from the turn structure. ``decode`` turns token ids into text (the
    protocol's ``decode``); without it spans carry ``text: null``.
    """
    tokens, _, sampled = trajectory_tokens(traj)
    trained, mask_source, weight = _trained_flags(traj, tokens, sampled, source, datum)
    spans = build_spans(traj, trained) if tokens else []
    problem, outcome = traj.problem, retool_outcome(traj.outcome)
    return {
        "version": RECORD_VERSION,
        "source": source,
        "step": step,
        # the policy version that sampled it (training; lags ``step - 1`` by up to max_steps_off_policy)
        "policy_version": traj.policy_version,
        "mode": mode,
        "problem_id": str(problem.id),
        "problem_index": traj.problem_index,
        "group_index": traj.group_index,
        "question": problem.question,
        "reference": problem.answer,
        "data_source": problem.data_source or "",
        "answer": outcome.answer,
        "correct": outcome.correct,
        "valid_format": outcome.valid_format,
        "reward": float(traj.reward),
        "reward_status": outcome.reward_status,
        "advantage": None if advantage is None else float(advantage),
        "stop_reason": outcome.stop_reason,
        "error": outcome.error,
        "code_calls": outcome.code_calls,
        "exec_errors": outcome.exec_errors,
        "sample_seconds": round(traj.sample_seconds, 4),
        "exec_seconds": round(outcome.exec_seconds, 4),
        "mask_source": mask_source,
        "datum_weight": weight,
        "tokens": _token_counts(traj, tokens, sampled, spans),
        "messages": list(outcome.messages),
        "turns": _turn_records(traj, outcome),
        "spans": [s.to_json(tokens, decode) for s in spans],
    }


def _token_counts(traj: Trajectory, tokens: list[int], sampled: list[bool], spans: list[Span]) -> TokenCounts:
    n_prompt = len(traj.turns[0].prompt_tokens) if tokens else 0
    n_completion = sum(sampled)
    return {
        "prompt": n_prompt,
        "completion": n_completion,
        "observation": len(tokens) - n_prompt - n_completion,
        "total": len(tokens),
        "trained": sum(s.end - s.start for s in spans if s.trained),
    }
