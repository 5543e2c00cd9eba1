"""DeepMind Mathematics as a problem source: its splits, the leak check, the names it is registered under, and
an attempt scored through the verifier with the benchmark's checker (fixture rows from the official
generator, ``tests/data/mathematics``)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from retool.config import DataConfig
from retool.data.mathematics import module_of, split_of
from retool.data.problem import Problem
from retool.env import make_source
from retool.env.mathematics import MathematicsList, MathematicsSource, mathematics_reference
from retool.env.registry import SourceOptions
from retool.env.scoring import Attempt
from retool.env.source import SourceError
from retool.recipes.mathematics.task import held_out_problems
from retool.reward.verifier import Verifier


def test_the_splits(fixture_data: Path) -> None:
    source = MathematicsSource(fixture_data / "mathematics")
    train, test = source.problems("train"), source.problems("test")
    assert len(train) == 112 and len(test) == 112 + 30
    assert {split_of(p) for p in test} == {"interpolate", "extrapolate"}
    assert module_of(train[0]) == "algebra__linear_1d" and source.leaked == []
    only = MathematicsSource(
        fixture_data / "mathematics", modules=["numbers__gcd"], test_splits=("extrapolate",)
    )
    assert {module_of(p) for p in only.problems("train")} == {"numbers__gcd"}
    with pytest.raises(SourceError, match="no test problems"):
        only.problems("test")  # numbers__gcd has no extrapolation test


def test_a_train_question_that_is_a_test_question_stops_the_run(fixture_data: Path, tmp_path: Path) -> None:
    folder = tmp_path / "leaky"
    shutil.copytree(fixture_data / "mathematics", folder)
    test_row = json.loads((folder / "mathematics_interpolate.jsonl").read_text().splitlines()[0])
    with (folder / "mathematics_train.jsonl").open("a") as fh:
        fh.write(json.dumps({**test_row, "id": "mathematics-train-leak-1", "split": "train"}) + "\n")
    with pytest.raises(SourceError, match="1 train questions are test questions"):
        MathematicsSource(folder).problems("train")
    lenient = MathematicsSource(folder, strict=False)
    assert len(lenient.problems("train")) == 112 and lenient.leaked == ["mathematics-train-leak-1"]


def test_registered_names(fixture_data: Path) -> None:
    options = SourceOptions(data=DataConfig(data_dir=str(fixture_data / "mathematics")))
    assert len(make_source("mathematics", options).problems("test")) == 142
    assert len(make_source("mathematics_interpolate", options).problems("test")) == 112
    assert len(make_source("mathematics_extrapolate", options).problems("test")) == 30


def test_held_out_slice_takes_the_first_questions_of_every_module(fixture_data: Path) -> None:
    problems = held_out_problems(1, fixture_data / "mathematics")
    assert len(problems) == 56 + 15
    assert all(p.id.endswith("-1") for p in problems)


def test_an_attempt_is_scored_by_the_benchmark_s_checker(fixture_data: Path) -> None:
    source = MathematicsSource(fixture_data / "mathematics")
    problem = next(p for p in source.problems("test") if module_of(p) == "numbers__is_prime")
    assert mathematics_reference(problem).startswith("\x00\x00mathematics\x00numbers__is_prime\x00")
    right = "no" if problem.answer == "False" else "yes"
    wrong = "True" if problem.answer == "False" else "False"

    async def scores() -> list[float]:
        with Verifier(workers=1) as verifier:
            out = []
            for text, stop in (
                (f"\\boxed{{{right}}}", "answer"),
                (f"\\boxed{{{wrong}}}", "answer"),
                ("", "max_turns"),
            ):
                out.append((await source.score(Attempt(problem, stop, text), verifier)).reward)
            listed = MathematicsList([problem], shuffle=False)
            out.append(
                (
                    await listed.score(Attempt(problem, "answer", f"\\boxed{{{problem.answer}}}"), verifier)
                ).reward
            )
            return out

    assert asyncio.run(scores()) == [1.0, -1.0, -1.0, 1.0]
    with pytest.raises(SourceError, match="not a DeepMind Mathematics problem"):
        mathematics_reference(Problem("x", "q", "1", "gsm8k"))
