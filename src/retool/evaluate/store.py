"""The eval's on-disk state: an append-only per-problem JSONL plus a summary JSON beside it, and the
shape of its records (``problem_record`` holding one ``candidate_record`` per sampled trajectory).

Crash safety: each record is one line written with a single ``write`` and flushed + fsynced, so a kill
leaves at most one partial *last* line, which ``load`` discards (truncating the file back to the last
complete line). A damaged line anywhere else is not guessed at: it is an error naming the line. The
summary is replaced atomically (write to a temporary file, then ``os.replace``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from retool.data.problem import Problem
from retool.errors import UserError
from retool.rollout.records import Decode, trajectory_record
from retool.rollout.types import Trajectory

logger = logging.getLogger(__name__)


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

    def load(self) -> dict[str, dict[str, Any]]:
        """Finished records by problem id; drops (and truncates away) a partial last line."""
        if not self.path.exists():
            return {}
        data = self.path.read_bytes()
        records: dict[str, dict[str, Any]] = {}
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
                    records[str(record["id"])] = record
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

    def append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, ensure_ascii=False, sort_keys=False) + "\n").encode("utf-8")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    def read_summary(self) -> dict[str, Any] | None:
        if not self.summary_path.exists():
            return None
        try:
            return json.loads(self.summary_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise EvalStoreError(f"{self.summary_path}: unreadable summary ({exc})") from None

    def write_summary(self, summary: dict[str, Any]) -> None:
        self.summary_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.summary_path.with_name(self.summary_path.name + ".tmp")
        tmp.write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, self.summary_path)


def candidate_record(traj: Trajectory, save_transcript: bool = False) -> dict[str, Any]:
    """One trajectory as a JSON-ready candidate (see ``retool.evaluate.metrics`` for the keys)."""
    results = list(traj.exec_results or [])
    record: dict[str, Any] = {
        "index": int(traj.group_index),
        "answer": traj.answer,
        "correct": bool(traj.correct),
        "valid_format": bool(traj.valid_format),
        "reward": float(traj.reward),
        "code_calls": _count(traj.code_calls),
        "turns": len(traj.turns),
        "stop_reason": str(traj.stop_reason),
        "exec_latencies": [round(float(r.latency), 6) for r in results],
        "exec_errors": sum(1 for r in results if not r.ok and not r.timed_out),
        "exec_timeouts": sum(1 for r in results if r.timed_out),
        "self_corrected": bool(traj.had_error_then_correct),
        "completion_tokens": int(traj.completion_token_count),
        "total_tokens": len(traj.full_tokens()),
        "sample_seconds": round(float(traj.sample_seconds), 4),
        "exec_seconds": round(float(traj.exec_seconds), 4),
        "final_text_tail": (traj.final_text or "")[-400:],
    }
    if save_transcript:
        record["messages"] = traj.messages
    return record


def problem_record(
    problem: Problem, index: int, mode: str, seed: int, candidates: Sequence[dict[str, Any]]
) -> dict[str, Any]:
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


def _count(value: int | Sequence[object] | None) -> int:
    if isinstance(value, int):
        return value
    return len(value or ())


def attach_eval_transcripts(
    candidates: Sequence[dict[str, Any]],
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
