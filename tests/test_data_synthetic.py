"""The synthetic task family: seeded, held-out test split, correct canonical code, kinds and flags."""

from __future__ import annotations

import contextlib
import io

import pytest

from retool.data.synthetic import (
    ALL_KINDS,
    EASY_KINDS,
    HARD_KINDS,
    generate_problems,
    generate_tasks,
    parse_source,
)


def _run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})  # trusted: the family's own canonical code
    return out.getvalue().strip()


def test_seeded_and_deterministic() -> None:
    a = generate_tasks(50, seed=3)
    b = generate_tasks(50, seed=3)
    c = generate_tasks(50, seed=4)
    assert a == b
    assert [t.question for t in a] != [t.question for t in c]


def test_canonical_code_prints_the_answer_for_every_kind() -> None:
    for kind in ALL_KINDS:
        for task in generate_tasks(6, seed=1, kinds=[kind]):
            assert task.kind == kind
            assert task.hard == (kind in HARD_KINDS)
            assert _run(task.code) == str(task.answer), task


def test_test_split_is_held_out_for_hard_problems() -> None:
    train = {t.question for t in generate_tasks(5000, seed=0, split="train")}
    test = generate_tasks(200, seed=0, split="test")
    assert not [t.question for t in test if t.hard and t.question in train]
    assert [t.id for t in test] == sorted({t.id for t in test})


def test_mix_and_data_source() -> None:
    tasks = generate_tasks(400, seed=0, hard_fraction=0.5)
    hard = sum(t.hard for t in tasks)
    assert 140 < hard < 260
    assert {t.kind for t in tasks} == set(ALL_KINDS)
    problems = generate_problems(20, seed=0)
    for p, t in zip(problems, generate_tasks(20, seed=0), strict=True):
        assert p.answer == str(t.answer)
        assert parse_source(p.data_source) == (t.kind, t.hard)
    assert all(not t.hard for t in generate_tasks(30, seed=0, hard_fraction=0.0))
    assert all(t.kind in EASY_KINDS for t in generate_tasks(30, seed=0, hard_fraction=0.0))


def test_bad_arguments_are_clear() -> None:
    with pytest.raises(ValueError, match="unknown task kinds"):
        generate_tasks(3, kinds=["nope"])
    with pytest.raises(ValueError, match="split"):
        generate_tasks(3, split="dev")
    with pytest.raises(ValueError, match="hard_fraction"):
        generate_tasks(3, hard_fraction=1.5)
    assert parse_source("dapo") is None
