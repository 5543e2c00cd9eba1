"""The demo's DeepMind Mathematics task (``retool demo --recipe mathematics``): its settings, the
held-out slice, the cold start's pieces (few-shot turns, a sampled transcript re-tokenised without them, the
problems of each round of expert iteration; what a round keeps is tests/test_train_expert_iteration.py's)
and (slow) a few-step slice of the whole recipe on SmolLM2 over fixture rows of the official generator."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from retool.data.mathematics import module_of
from retool.env.mathematics import MathematicsSource
from retool.pipeline.settings import options_as
from retool.protocol import ChatProtocol
from retool.recipes.demo import recipe_settings, run_demo
from retool.recipes.mathematics import MathematicsOptions, cold_start_of
from retool.recipes.mathematics import task as mathematics_task
from retool.recipes.mathematics.task import (
    FEW_SHOT,
    coldstart_chunk,
    coldstart_expert_iteration,
    coldstart_problems,
    few_shot_messages,
    trajectory_example,
)
from retool.train.trace import build_trajectory


def test_the_mathematics_preset_and_fields() -> None:
    settings = recipe_settings("mathematics")
    assert settings.recipe == "mathematics" and settings.as_dict()["recipe"] == "mathematics"
    assert settings.config.data.source == "mathematics" and settings.config.eval.dataset == "mathematics"
    assert settings.eval_modes == ("text-only", "retool") == settings.base_eval_modes
    assert (
        settings.eval_temperature == 0.0 and options_as(settings, MathematicsOptions).mathematics_problems > 0
    )
    assert "sympy" in settings.config.sandbox.preimport


def test_coldstart_problems_cover_every_module_and_are_seeded(fixture_data: Path) -> None:
    source = MathematicsSource(fixture_data / "mathematics")
    a, b = coldstart_problems(source, 1, 0), coldstart_problems(source, 1, 1)
    assert len(a) == 56 and len({module_of(p) for p in a}) == 56
    assert a == coldstart_problems(source, 1, 0) and a != b
    assert len(coldstart_problems(source, 5, 0)) == 112  # two train rows per module in the fixture


def _protocol(qwen_tokenizers: dict) -> ChatProtocol:
    return ChatProtocol(qwen_tokenizers["Qwen2.5-Instruct"], "markdown", system_prompt="compact")


def test_a_sampled_transcript_is_retokenised_without_the_few_shot_turns(qwen_tokenizers: dict) -> None:
    plain = _protocol(qwen_tokenizers)
    outputs = {code: f"<out {i}>" for i, (_, code) in enumerate(FEW_SHOT)}
    shots = few_shot_messages(plain, outputs)
    assert len(shots) == 4 * len(FEW_SHOT) and shots[0]["content"] == FEW_SHOT[0][0]
    prompted = plain.with_examples(shots)
    question = "What is 12 - 5*3?"
    assert prompted.initial_messages(question)[1:-1] == shots and plain.initial_messages(question)[1:-1] == []
    call = plain.fmt.render_call("print(12 - 5*3)")
    sampled = [
        *prompted.initial_messages(question),
        plain.assistant_message(call),
        plain.tool_message("-3"),
        plain.assistant_message("\\boxed{-3}"),
    ]
    from retool.data.problem import Problem

    problem = Problem(
        "mathematics-train-arithmetic__mixed-1", question, "-3", "mathematics/arithmetic__mixed"
    )
    example = trajectory_example(plain, problem, sampled, 1 + len(shots), max_observation_tokens=48)
    assert example is not None
    tokens, weights, _ = build_trajectory(plain, question, [(call, "x")], "\\boxed{-3}", lambda _: "-3", 48)
    assert (example.tokens, example.weights) == (tokens, weights)
    text = plain.decode(example.tokens)
    assert FEW_SHOT[0][0] not in text and question in text
    # A transcript without a call is not a code-integrated trace.
    assert (
        trajectory_example(
            plain,
            problem,
            [*prompted.initial_messages(question), plain.assistant_message("\\boxed{-3}")],
            1 + len(shots),
            48,
        )
        is None
    )


def test_later_cold_start_rounds_draw_other_problems_of_every_module(fixture_data: Path) -> None:
    source = MathematicsSource(fixture_data / "mathematics")
    first = coldstart_problems(source, 1, 0)
    later = coldstart_problems(source, 1, 0, round_index=1, exclude={p.id for p in first})
    assert len(later) == 56 and not {p.id for p in first} & {p.id for p in later}
    assert {module_of(p) for p in later} == {module_of(p) for p in first}
    # The fixture holds two train rows a module: a third round finds none left.
    both = {p.id for p in [*first, *later]}
    assert coldstart_problems(source, 1, 0, round_index=2, exclude=both) == []


def test_the_cold_start_is_one_few_shot_round_unless_asked_for_more() -> None:
    settings = recipe_settings("mathematics")
    cold = cold_start_of(options_as(settings, MathematicsOptions))
    assert (cold.rounds, cold.per_module, cold.samples, cold.temperature) == (1, 4, 1, 0.0)
    assert cold.max_trajectories is None and cold.keep == 1
    more = recipe_settings(
        "mathematics", ["recipe.coldstart_rounds=3", "recipe.coldstart_max_trajectories=500"]
    )
    cold = cold_start_of(options_as(more, MathematicsOptions))
    assert (cold.rounds, cold.max_trajectories) == (3, 500)


def test_a_cold_start_round_keeps_about_two_sampler_batches_in_flight() -> None:
    assert coldstart_chunk(32, 4) == 16  # 64 trajectories in flight, not 256 problems x 4
    assert coldstart_chunk(8, 1) == 16 and coldstart_chunk(2, 8) == 1  # never below one problem


def test_the_cold_start_rolls_out_its_rounds_in_those_chunks(
    fixture_data: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen = []

    def stop(backend, plan, train, settings, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(settings)
        raise RuntimeError("stop")

    monkeypatch.setattr(mathematics_task, "run_expert_iteration", stop)
    settings = recipe_settings("mathematics", ["backend.sample_batch_size=32", "recipe.coldstart_rounds=3"])
    cold = cold_start_of(options_as(settings, MathematicsOptions))
    with pytest.raises(RuntimeError, match="stop"):
        coldstart_expert_iteration(
            SimpleNamespace(backend=None),  # type: ignore[arg-type]
            settings.config,
            cold,
            out=tmp_path,
            train=lambda pool: None,  # type: ignore[arg-type,return-value]
            data_dir=fixture_data,
        )
    assert seen[0].chunk_problems == coldstart_chunk(32, cold.round_samples) == 64 // cold.round_samples


@pytest.mark.slow
def test_a_few_step_slice_of_the_recipe_on_smollm2(
    tmp_path: Path, smollm2_file: Path, mathematics_slice: Path
) -> None:
    """Base eval, the cold start (SmolLM2's own greedy attempts), SFT, one RL step, both modes evaluated:
    on two modules whose questions the base model answers with a call (sums, remainders)."""
    small = [
        "lora.rank=4",
        "lora.alpha=8",
        "sft.steps=2",
        "sft.batch_size=2",
        "train.steps=1",
        "rollout.questions_per_step=2",
        "rollout.group_size=2",
        "filters.dynamic_sampling=false",
        "checkpoint.every=0",
        "backend.sample_batch_size=8",
        "recipe.coldstart_rows=2",
        "recipe.mathematics_problems=1",
        "pipeline.base_eval_problems=1",
        "pipeline.plots=false",
    ]
    out = tmp_path / "run"
    result = run_demo(recipe_settings("mathematics", small, out=str(out), data_dir=str(mathematics_slice)))

    cold = json.loads((out / "coldstart" / "report.json").read_text())
    assert cold["problems"] == 4 and cold["sampled"] == 4 and cold["kept"] >= 1
    kept = [json.loads(x) for x in (out / "coldstart" / "train.jsonl").read_text().splitlines()]
    assert all(FEW_SHOT[0][0] not in k["text"] for k in kept)  # trained without the few-shot turns
    metrics = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert all(pid.startswith("mathematics-train-") for row in metrics for pid in row["problem_ids"])
    held_out = [json.loads(x)["id"] for x in (out / "tasks" / "test.jsonl").read_text().splitlines()]
    assert len(held_out) == 3 and {h.split("-")[1] for h in held_out} == {"interpolate", "extrapolate"}
    assert {(r["model"], r["mode"]) for r in result.table} == {
        (m, mode) for m in ("base", "sft", "rl") for mode in ("text-only", "retool")
    }
    table = (out / "report.md").read_text()
    assert "Acc interpolate" in table and "Acc extrapolate" in table and "Acc hard" not in table
    assert "interpolate_accuracy" in result.gain and "extrapolate_accuracy" in result.gain
