"""The GSM8K recipe's task (``retool demo --recipe gsm8k``): ReTool's two stages on a real dataset.

Owns what differs from the synthetic task family, and nothing of the pipeline itself (``retool.pipeline.run``):

- the problem source RL trains on: GSM8K's train split (``retool.env.gsm8k``), checked against the test split so that no
  test question is ever trained on (``strict``: a leak stops the run instead of being filtered);
- the held-out problems: a seeded slice of GSM8K's test split (the whole split with ``n >= 1319``);
- the cold-start trajectories: a seeded sample of train rows whose annotated solutions become tool
  trajectories in the model's own protocol (``retool.train.annotated``: one call per annotated step by
  default, REAL sandbox output, kept only if every observation matches its annotation, the answer verifies
  and the trajectory fits the RL budgets). They are written to ``<out>/coldstart/`` with the counts of
  dropped rows by reason, and read back from there when a run is resumed.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from retool.components import Components
from retool.config import Config
from retool.data.annotated import ParseFailure, parse_solution
from retool.data.gsm8k import TRAIN_FILE, gsm8k_problems, gsm8k_split
from retool.data.paths import data_dir as resolve_data_dir
from retool.data.problem import Problem
from retool.data.readers import DataError
from retool.env.gsm8k import Gsm8kSource
from retool.env.source import Split
from retool.jsonl import JsonObject
from retool.train.annotated import ConvertReport, convert_file, write_rejects
from retool.train.sft import SFTExample, read_examples, write_examples

logger = logging.getLogger(__name__)

TASK = "gsm8k"
COLDSTART_DIR = "coldstart"


def gsm8k_source(config: Config, max_solution_steps: int = 0) -> Gsm8kSource:
    """GSM8K's train split to train on, refusing to start if any train question is a test question;
    with ``max_solution_steps``, only problems whose reference solution has at most that many annotated
    steps (the test split is never filtered)."""
    if max_solution_steps > 0:
        return ShortSolutionSource(config.data.data_dir, max_solution_steps, shuffle=config.data.shuffle)
    return Gsm8kSource(config.data.data_dir, shuffle=config.data.shuffle, strict=True)


class ShortSolutionSource(Gsm8kSource):
    """GSM8K whose train split keeps the problems solved in at most ``max_steps`` annotated steps: an RL
    curriculum for a model that solves few long ones (a group whose every answer fails teaches nothing)."""

    def __init__(self, data_dir: str | None, max_steps: int, *, shuffle: bool = True) -> None:
        super().__init__(data_dir, shuffle=shuffle, strict=True, name=f"gsm8k (<= {max_steps} steps)")
        self.max_steps = max_steps

    def _read(self, split: Split) -> list[Problem]:
        problems = super()._read(split)
        if split != "train":
            return problems
        steps = solution_steps(train_file(self.data_dir))
        return [p for p in problems if 0 < steps.get(p.id, 0) <= self.max_steps]


def solution_steps(path: Path) -> dict[str, int]:
    """Annotated steps of each train solution (0: none parsed), by problem id (``gsm8k-train-<row>``)."""
    out: dict[str, int] = {}
    with path.open(encoding="utf-8") as fh:
        for i, line in enumerate(ln for ln in fh if ln.strip()):
            row = json.loads(line)
            parsed = parse_solution(str(row.get("answer", "")))
            out[f"gsm8k-train-{row.get('idx', i)}"] = (
                0 if isinstance(parsed, ParseFailure) else len(parsed.steps)
            )
    return out


def held_out_problems(n: int, data_dir: str | None, seed: int) -> list[Problem]:
    """``n`` GSM8K test problems drawn with ``seed`` (the whole split, in file order, when ``n`` covers it)."""
    test = gsm8k_split("test", data_dir)
    if n >= len(test):
        return [
            Problem(p.id.replace("gsm8k-test-", "gsm8k-"), p.question, p.answer, p.data_source) for p in test
        ]
    return gsm8k_problems(n, data_dir, seed=seed)


def train_file(data_dir: str | Path | None) -> Path:
    path = resolve_data_dir(data_dir) / TRAIN_FILE
    if not path.is_file():
        raise DataError(
            f"the GSM8K cold start needs {TRAIN_FILE} (looked in {path}); run `retool data fetch gsm8k` "
            "or pass --data-dir DIR"
        )
    return path


def coldstart_rows(path: Path, n: int, seed: int) -> set[int]:
    """``n`` row numbers (from 1) of ``path`` drawn with ``seed``: the rows the cold start converts."""
    with path.open(encoding="utf-8") as fh:
        total = sum(1 for line in fh if line.strip())
    return set(random.Random(f"retool-coldstart/{seed}").sample(range(1, total + 1), min(n, total)))


def coldstart_examples(
    parts: Components,
    config: Config,
    n_rows: int,
    seed: int,
    out: Path,
    *,
    steps_per_call: int = 1,
    text_only_share: float = 0.0,
) -> tuple[list[SFTExample], JsonObject]:
    """The cold-start trajectories of ``n_rows`` sampled GSM8K train rows, in ``parts``' protocol, executed
    in ``parts``' sandbox, ``steps_per_call`` annotated steps a call and ``text_only_share`` of the rows as
    plain reasoning with no tool; cached in ``out/coldstart/`` (a resumed run reads them back). Returns them
    and the conversion report (rows read, kept, calls, dropped by reason)."""
    folder = out / COLDSTART_DIR
    kept_file, report_file = folder / "train.jsonl", folder / "report.json"
    if kept_file.is_file() and report_file.is_file():
        return read_examples(kept_file), json.loads(report_file.read_text(encoding="utf-8"))
    assert parts.executor is not None, "cold-start observations come from the sandbox"
    source = train_file(config.data.data_dir)
    test_questions = [p.question for p in gsm8k_split("test", config.data.data_dir)]
    rows = sorted(coldstart_rows(source, n_rows, seed))
    text_rows = set(
        random.Random(f"retool-coldstart-text/{seed}").sample(rows, round(text_only_share * len(rows)))
    )
    examples, report = [], ConvertReport()
    for text_only, protocol, selected in (
        (False, parts.protocol, set(rows) - text_rows),
        (True, parts.protocol.with_tools(False), text_rows),
    ):
        if not selected:
            continue
        kept, part = convert_file(
            source,
            protocol,
            parts.executor,
            rows=selected,
            per_call=steps_per_call,
            held_out=test_questions,
            budgets=config.rollout,
            text_only=text_only,
        )
        examples += kept
        report.merge(part)
    if not examples:
        raise DataError(f"the GSM8K cold start kept none of {report.read} rows: {dict(report.dropped)}")
    folder.mkdir(parents=True, exist_ok=True)
    write_rejects(report, folder / "dropped.jsonl")
    write_examples(examples, folder / "train.partial")
    (folder / "train.partial").replace(kept_file)
    summary = report_summary(report)
    report_file.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    logger.info(
        "gsm8k cold start: %d of %d rows kept, dropped %s", report.kept, report.read, dict(report.dropped)
    )
    return examples, summary


def report_summary(report: ConvertReport) -> JsonObject:
    return {**report.as_dict(), "source": TRAIN_FILE}
