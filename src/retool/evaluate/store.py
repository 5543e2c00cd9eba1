"""The eval's on-disk state: an append-only per-problem JSONL plus a summary JSON beside it, and the
shape of its records (``problem_record`` holding one ``candidate_record`` per sampled trajectory).

Crash safety: each record is one line written with a single ``write`` and flushed + fsynced, so a kill
leaves at most one partial *last* line, which ``load`` discards (truncating the file back to the last
complete line). A damaged line anywhere else is not guessed at: it is an error naming the line. The
summary is replaced atomically (write to a temporary file, then ``os.replace``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypedDict, cast

from retool.data.problem import Problem
from retool.env.retool import retool_outcome
from retool.errors import UserError
from retool.jsonl import JsonObject, read_jsonl_objects
from retool.protocol.chat import Message
from retool.rollout.records import Decode, TrajectoryRecord, trajectory_record
from retool.rollout.types import Trajectory

logger = logging.getLogger(__name__)


class CandidateRecord(TypedDict, total=False):
    """One sampled trajectory of an eval problem (``candidate_record``; see ``retool.evaluate.metrics``).

    Not total: records read back from older files, or summarised by the viewer, may miss keys.
    """

    index: int
    answer: str | None
    correct: bool
    valid_format: bool
    reward: float
    code_calls: int
    turns: int
    stop_reason: str
    exec_latencies: list[float]
    exec_errors: int
    exec_timeouts: int
    self_corrected: bool
    completion_tokens: int
    total_tokens: int
    sample_seconds: float
    exec_seconds: float
    final_text_tail: str
    messages: Sequence[Message]  # with --save-transcripts
    trajectory: TrajectoryRecord  # with --save-transcripts


class ProblemRecord(TypedDict, total=False):
    """One line of the eval's records file: a problem and its candidates (``problem_record``)."""

    id: str
    index: int
    reference: str
    data_source: str | None
    mode: str
    seed: int
    n: int
    n_correct: int
    candidates: list[CandidateRecord]


class EvalSummary(TypedDict, total=False):
    """The summary JSON beside the records (written by the runner's session; read back on resume)."""

    version: int
    status: str  # complete | incomplete
    output: str
    settings: JsonObject  # ``retool.evaluate.settings.build_settings``
    completed: int
    total: int
    failed_problems: list[str]
    metrics: JsonObject  # ``retool.evaluate.metrics.summarize``
    timing: dict[str, int | float]


class EvalStoreError(UserError, RuntimeError):
    """An output file that cannot be resumed safely; the message says which file and why."""


def summary_path_for(output: str | Path) -> Path:
    """``out.jsonl`` -> ``out.summary.json``; any other name gets ``.summary.json`` appended."""
    path = Path(output)
    if path.suffix == ".jsonl":
        return path.with_suffix(".summary.json")
    return path.with_name(path.name + ".summary.json")


class ResultStore:
    def __init__(self, output: str | Path) -> None:
        self.path = Path(output)
        self.summary_path = summary_path_for(self.path)

    @contextlib.contextmanager
    def claimed(self) -> Iterator[None]:
        """Inside, this process is the output's only writer: an exclusive lock on the JSONL itself, which the
        kernel releases when the process ends, however it ends. Two evaluations appending to one output (a
        rerun while the first still runs, e.g. left running by a killed parent) would interleave their
        records, and each one's resume truncates the other's unfinished last line; the second gets
        ``EvalStoreError`` instead. A run that fails before writing anything leaves no empty file behind."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        with self.path.open("ab") as fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise EvalStoreError(
                    f"{self.path}: another evaluation is writing this output now (the same command still "
                    "running?); wait for it or stop it, or choose another --output"
                ) from None
            try:
                yield
            except BaseException:
                if created and self.path.stat().st_size == 0 and not self.summary_path.exists():
                    self.path.unlink()
                raise

    def load(self) -> dict[str, ProblemRecord]:
        """Finished records by problem id; drops (and truncates away) a partial last line."""
        if not self.path.exists():
            return {}
        data = self.path.read_bytes()
        records: dict[str, ProblemRecord] = {}
        good_end = 0
        pos = 0
        line_no = 0
        while pos < len(data):
            line_no += 1
            nl = data.find(b"\n", pos)
            end = len(data) if nl < 0 else nl
            raw = data[pos:end]
            is_last = nl < 0 or data[nl + 1 :].strip() == b""
            try:
                record = json.loads(raw) if raw.strip() else None
                if record is not None and (not isinstance(record, dict) or "id" not in record):
                    raise ValueError("not a record object with an 'id'")
            except ValueError as exc:
                if is_last:
                    logger.warning("%s: discarding a partial last line (%d bytes)", self.path, len(raw))
                    break
                raise EvalStoreError(
                    f"{self.path}:{line_no}: damaged record in the middle of the file ({exc}); "
                    "fix or remove that line, or write to a new --output"
                ) from None
            # A parsed line whose newline never reached the disk is kept and completed below.
            good_end = len(data) if nl < 0 else nl + 1
            if record is not None:
                if str(record["id"]) in records:
                    logger.warning(
                        "%s:%d: duplicate record for %r; keeping the first", self.path, line_no, record["id"]
                    )
                else:
                    records[str(record["id"])] = cast(ProblemRecord, record)
            if nl < 0:
                break
            pos = nl + 1
        if good_end < len(data) or (data and not data[:good_end].endswith(b"\n")):
            with self.path.open("r+b") as fh:
                fh.truncate(good_end)
                if good_end and not data[:good_end].endswith(b"\n"):
                    fh.seek(good_end)
                    fh.write(b"\n")
                fh.flush()
                os.fsync(fh.fileno())
        return records

    def append(self, record: ProblemRecord) -> None:
        line = (json.dumps(record, ensure_ascii=False, sort_keys=False) + "\n").encode("utf-8")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    def read_summary(self) -> EvalSummary | None:
        if not self.summary_path.exists():
            return None
        try:
            summary: EvalSummary = json.loads(self.summary_path.read_text(encoding="utf-8"))
            return summary
        except (OSError, ValueError) as exc:
            raise EvalStoreError(f"{self.summary_path}: unreadable summary ({exc})") from None

    def write_summary(self, summary: EvalSummary) -> None:
        self.summary_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.summary_path.with_name(self.summary_path.name + ".tmp")
        tmp.write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, self.summary_path)


def candidate_record(traj: Trajectory, save_transcript: bool = False) -> CandidateRecord:
    """One trajectory as a JSON-ready candidate (see ``retool.evaluate.metrics`` for the keys)."""
    outcome = retool_outcome(traj.outcome)
    results = outcome.exec_results
    record: CandidateRecord = {
        "index": int(traj.group_index),
        "answer": outcome.answer,
        "correct": bool(outcome.correct),
        "valid_format": bool(outcome.valid_format),
        "reward": float(traj.reward),
        "code_calls": outcome.code_calls,
        "turns": len(traj.turns),
        "stop_reason": str(outcome.stop_reason),
        "exec_latencies": [round(float(r.latency), 6) for r in results],
        "exec_errors": sum(1 for r in results if not r.ok and not r.timed_out),
        "exec_timeouts": sum(1 for r in results if r.timed_out),
        "self_corrected": bool(outcome.had_error_then_correct),
        "completion_tokens": int(traj.completion_token_count),
        "total_tokens": len(traj.full_tokens()),
        "sample_seconds": round(float(traj.sample_seconds), 4),
        "exec_seconds": round(float(outcome.exec_seconds), 4),
        "final_text_tail": outcome.final_text[-400:],
    }
    if save_transcript:
        record["messages"] = outcome.messages
    return record


def problem_record(
    problem: Problem, index: int, mode: str, seed: int, candidates: Sequence[CandidateRecord]
) -> ProblemRecord:
    """One line of the records file: a problem and its candidates (in branch order)."""
    return {
        "id": problem.id,
        "index": index,
        "reference": str(problem.answer),
        "data_source": problem.data_source,
        "mode": mode,
        "seed": seed,
        "n": len(candidates),
        "n_correct": sum(c["correct"] for c in candidates),
        "candidates": list(candidates),
    }


def read_problem_records(path: str | Path) -> list[ProblemRecord]:
    """Every record of a finished eval's records file, in file order (``ResultStore.load`` resumes one)."""
    return [cast(ProblemRecord, obj) for obj in read_jsonl_objects(path)]


def attach_eval_transcripts(
    candidates: Sequence[CandidateRecord],
    trajectories: Sequence[Trajectory],
    *,
    mode: str,
    decode: Decode | None,
) -> None:
    """Add each candidate's ``"trajectory"`` record (same shape as training; spans from the turn structure).

    The advantage is the group-centred reward over the problem's candidates (``A_i = R_i - mean(R)``),
    what training would use.
    """
    rewards = [float(t.reward) for t in trajectories]
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    for candidate, traj, reward in zip(candidates, trajectories, rewards, strict=True):
        candidate["trajectory"] = trajectory_record(
            traj, source="eval", advantage=reward - mean, mode=mode, decode=decode
        )
