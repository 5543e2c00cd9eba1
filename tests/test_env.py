"""The environment seam: envs by name or path, their splits and epochs, and their scoring."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from retool.config import DataConfig, load_config
from retool.data import DataError, Problem, prepare_dapo
from retool.env import (
    AssistantTurn,
    Attempt,
    DapoSource,
    FileSource,
    ProblemList,
    ProblemSource,
    Score,
    SourceError,
    SourceOptions,
    TaskFamilySource,
    make_source,
    register_source,
    registered_sources,
    source_from_config,
)

PROBLEMS = [Problem(f"p{i}", f"What is {i} + {i}?", str(2 * i)) for i in range(10)]


def test_builtin_names_are_registered() -> None:
    assert {"synthetic", "dapo", "aime2025", "aime2024", "math500"} <= set(registered_sources())


def test_a_file_reads_through_the_data_stage_with_the_configured_fields(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(
        '{"id": "a", "q": "1+1?", "a": "2"}\n{"id": "b", "q": "2+2?", "a": "4"}\n{"id": "c", "q": "", "a": "1"}\n'
    )
    env = source_from_config(
        DataConfig(source=str(path), question_field="q", answer_field="a", shuffle=False)
    )
    assert isinstance(env, FileSource) and env.source == str(path)
    assert [(p.id, p.question, p.answer) for p in env.epoch(0, 0)] == [("a", "1+1?", "2"), ("b", "2+2?", "4")]
    assert env.problems("test") == env.problems("train")  # a file is one split
    with pytest.raises(DataError, match=r"missing\.jsonl"):
        source_from_config(DataConfig(source=str(tmp_path / "missing.jsonl"))).problems("train")
    with pytest.raises(SourceError, match=r"data\.source"):
        source_from_config(DataConfig(source=""))


def test_epochs_are_seeded_permutations() -> None:
    env = ProblemList(PROBLEMS, shuffle=True)
    first, again, second = env.epoch(3, 0), env.epoch(3, 0), env.epoch(3, 1)
    assert (
        first == again and first != second and sorted(p.id for p in first) == sorted(p.id for p in PROBLEMS)
    )
    assert ProblemList(PROBLEMS, shuffle=False).epoch(3, 1) == PROBLEMS
    with pytest.raises(SourceError):
        ProblemList([]).problems("train")


def test_the_task_family_has_held_out_splits_from_its_options() -> None:
    cfg = load_config(
        "tiny", ["data.options.count=30", "data.options.test_count=7", "data.options.kinds=['mul_big']"]
    )
    env = source_from_config(cfg)
    assert isinstance(env, TaskFamilySource)
    train, test = env.problems("train"), env.problems("test")
    assert (len(train), len(test)) == (30, 7)
    assert {p.data_source for p in train + test} == {"tasks/mul_big/hard"}
    assert not {p.question for p in train} & {p.question for p in test}
    assert all(t.code.startswith("print(") for t in env.tasks("train"))
    with pytest.raises(SourceError, match="unknown task kinds"):
        make_source("synthetic", _synthetic_data({"kinds": ["nope"]})).problems("train")


def _synthetic_data(options: dict[str, object], source: str = "synthetic") -> SourceOptions:
    return SourceOptions(data=DataConfig(source=source, options=options))


@pytest.mark.parametrize(
    ("source", "options", "message"),
    [
        ("synthetic", {"count": 0}, r"data\.options\.count: .*greater than or equal to 1"),
        ("synthetic", {"cont": 5}, r"data\.options\.cont: Extra inputs"),
        ("gsm8k", {"count": 5}, "the 'gsm8k' source takes no options"),
        ("problems.jsonl", {"count": 5}, "a file or folder of problems, which takes no options"),
    ],
)
def test_a_source_refuses_options_it_does_not_take_in_one_line(
    source: str, options: dict[str, object], message: str
) -> None:
    with pytest.raises(SourceError, match=message) as caught:
        make_source(source, _synthetic_data(options, source))
    assert "\n" not in str(caught.value)


def test_data_options_belong_to_the_training_source_not_a_set_named_beside_it() -> None:
    """An evaluation set named beside a synthetic run (``retool eval --dataset``) keeps its defaults."""
    beside = _synthetic_data({"count": 5, "test_count": 3})  # data.source = synthetic
    assert len(make_source("synthetic", beside).problems("train")) == 5
    other = SourceOptions(data=DataConfig(source="gsm8k", options={"count": 5}))
    assert len(make_source("synthetic", other).problems("test")) == 200  # SyntheticSourceOptions' default


def test_named_sets_prefer_the_data_dir(fixture_data: Path) -> None:
    env = make_source("math500", SourceOptions(data=DataConfig(data_dir=str(fixture_data))))
    assert env.source == str(fixture_data / "math500.jsonl")
    problems = env.problems("test")
    assert len(problems) >= 30 and all(p.question and p.answer for p in problems[:5])


def test_dapo_from_a_prepared_folder_or_raw(fixture_data: Path, tmp_path: Path) -> None:
    raw = str(fixture_data / "dapo_math_sample.jsonl")
    prepare_dapo(raw, tmp_path / "dapo", dev_size=5, seed=0)
    prepared = make_source(str(tmp_path / "dapo"))
    assert isinstance(prepared, DapoSource) and len(prepared.problems("test")) == 5
    by_name = make_source("dapo", SourceOptions(data=DataConfig(data_dir=str(tmp_path))))
    assert by_name.source == str(tmp_path / "dapo")
    assert by_name.problems("train") == prepared.problems("train")
    in_memory = DapoSource(raw)  # the raw file, split by the same rule as `retool prepare dapo` (50 dev)
    train_file = [json.loads(x)["id"] for x in (tmp_path / "dapo" / "train.jsonl").read_text().splitlines()]
    assert len(in_memory.problems("test")) == 50
    assert len(in_memory.problems("train")) + 50 == len(train_file) + 5


def test_registered_envs_win_over_paths_and_score_their_own_way() -> None:
    class Halves(ProblemSource):
        name = "halves"

        @property
        def source(self) -> str:
            return "memory"

        def problems(self, split):  # type: ignore[no-untyped-def]
            return PROBLEMS[:5] if split == "train" else PROBLEMS[5:]

        async def score(self, attempt, verifier) -> Score:  # type: ignore[no-untyped-def]
            return Score(0.5, status=attempt.stop_reason)

    register_source("halves", lambda name, options: Halves())
    env = make_source("halves")
    assert [p.id for p in env.problems("test")] == [p.id for p in PROBLEMS[5:]]
    score = asyncio.run(env.score(Attempt(PROBLEMS[0], "invalid", "x"), verifier=None))
    assert score == Score(0.5, status="invalid")


def test_default_score_checks_only_answers() -> None:
    class Verifier:
        def __init__(self) -> None:
            self.calls: list[tuple[str, str]] = []

        async def ascore(self, text: str, ref: str):  # type: ignore[no-untyped-def]
            from retool.reward import RewardResult

            self.calls.append((text, ref))
            return RewardResult(1.0, True, True, ref, "ok")

    verifier = Verifier()
    answered = Attempt(PROBLEMS[2], "answer", "\\boxed{4}")
    cut = Attempt(PROBLEMS[2], "max_turns", "\\boxed{4}", (AssistantTurn([1], [2], [-0.1], "x"),))
    env = ProblemList(PROBLEMS)
    assert asyncio.run(env.score(answered, verifier)) == Score(1.0, True, True, "4", "ok")
    assert asyncio.run(env.score(cut, verifier)) == Score(-1.0, False, False, None, "")
    assert verifier.calls == [("\\boxed{4}", "4")]
