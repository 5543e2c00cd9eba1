"""The eval runner and its resumable store, driven by a scripted fake rollout (no model, no tokenizer)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from retool.components import Components
from retool.config import Config
from retool.data.problem import Problem
from retool.env import AssistantTurn, ReToolGroupBuilder, ReToolOutcome
from retool.evaluate import EvalError, ResultStore, problem_seed, run_eval, summary_path_for
from retool.rollout import RolloutRequest, Trajectory, Transition
from retool.sandbox.base import ExecResult

PROBLEMS = [Problem(id=f"q{i}", question=f"What is {i}+{i}?", answer=str(2 * i)) for i in range(6)]


def fake_trajectory(
    problem: Problem, branch: int, correct: bool, use_tools: bool, failed: bool
) -> Trajectory:
    """A finished trajectory: 7 sampled tokens of 12 (two turns and one 0.125 s call with tools)."""
    if use_tools:
        turns = [
            AssistantTurn(list(range(3)), [3, 4], [-0.1] * 2, "call"),
            AssistantTurn(list(range(7)), list(range(7, 12)), [-0.1] * 5, "x"),
        ]
    else:
        turns = [AssistantTurn(list(range(5)), list(range(5, 12)), [-0.1] * 7, "x")]
    return Trajectory(
        problem=problem,
        group_index=branch,
        transitions=(
            *(Transition(t, 0.0, False) for t in turns[:-1]),
            Transition(turns[-1], 1.0 if correct else -1.0, True),
        ),
        reward=1.0 if correct else -1.0,
        sample_seconds=0.01,
        outcome=ReToolOutcome(
            stop_reason="sampler_error" if failed else "answer",
            answer=problem.answer if correct else "wrong",
            correct=correct,
            valid_format=True,
            codes=("print(2 + 2)",) if use_tools else (),
            exec_results=(ExecResult(True, "4\n", "", 0, False, 0.125),) if use_tools else (),
            use_tools=use_tools,
        ),
    )


def outcome(seed: int, branch: int) -> bool:
    """Scripted correctness, a pure function of the per-problem seed: independent of batch composition."""
    return (seed >> branch) & 1 == 1


class FakeRollout:
    """Stands in for ``run_rollout``; records how it was called."""

    def __init__(self, fail_ids: set[str] | None = None, crash_after: int | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.fail_ids = fail_ids or set()
        self.crash_after = crash_after

    async def __call__(self, request: RolloutRequest) -> list[list[Trajectory]]:
        if self.crash_after is not None and len(self.calls) >= self.crash_after:
            raise RuntimeError("backend went away")
        (group,) = request.groups
        assert isinstance(group, ReToolGroupBuilder)
        p, tool = group.problem, group.setup.tool
        self.calls.append(
            {"ids": [p.id], "seed": request.seed, "use_tools": tool is not None, "executor": tool}
        )
        await asyncio.sleep(0)
        out = [
            fake_trajectory(
                p, b, outcome(request.seed, b), tool is not None, p.id in self.fail_ids and b == 0
            )
            for b in range(group.group_size)
        ]
        return [list(reversed(out))]  # out of order on purpose: the runner sorts by branch


def components() -> Components:
    """Stand-ins: the fake rollout never touches them, only passes them through."""
    return Components(
        backend=None,  # type: ignore[arg-type]  # an eval samples; it never trains
        protocol=object(),  # type: ignore[arg-type]
        verifier=object(),  # type: ignore[arg-type]
        executor="EXECUTOR",  # type: ignore[arg-type]
        sampler=object(),  # type: ignore[arg-type]
    )


def run(output: Path, problems=PROBLEMS, *, mode: str = "retool", rollout: FakeRollout | None = None, **kw):
    kw.setdefault("val_n", 4)
    return asyncio.run(
        run_eval(
            problems,
            components(),
            config=Config(),
            mode=mode,
            output=output,
            rollout_fn=rollout or FakeRollout(),
            **kw,
        )
    )


def expected_average(problems: list[Problem], seed: int, n: int) -> float:
    return sum(sum(outcome(problem_seed(seed, p.id), b) for b in range(n)) / n for p in problems) / len(
        problems
    )


def test_records_and_summary(tmp_path: Path) -> None:
    out = tmp_path / "ev.jsonl"
    fake = FakeRollout()
    summary = run(out, rollout=fake, seed=3, identity={"model": "m", "dataset": "toy"})
    lines = out.read_text().splitlines()
    assert len(lines) == len(PROBLEMS)
    rec = json.loads(lines[0])
    assert [c["index"] for c in rec["candidates"]] == [0, 1, 2, 3]
    assert {
        "answer",
        "correct",
        "code_calls",
        "turns",
        "stop_reason",
        "exec_latencies",
        "completion_tokens",
    } <= set(rec["candidates"][0])
    assert rec["seed"] == problem_seed(3, rec["id"])
    assert summary["status"] == "complete"
    assert summary["metrics"]["average_at_n"] == pytest.approx(expected_average(PROBLEMS, 3, 4))
    assert summary["metrics"]["mean_exec_latency"] == pytest.approx(0.125)
    assert summary["metrics"]["mean_turns"] == 2.0
    s = summary["settings"]
    assert (s["mode"], s["model"], s["dataset"], s["val_n"], s["seed"]) == ("retool", "m", "toy", 4, 3)
    assert {"budgets", "verifier", "tool_format", "temperature", "top_p", "checkpoint"} <= set(s)
    assert json.loads(summary_path_for(out).read_text()) == summary
    # every call: one problem, its own seed, tools on, the executor passed
    assert all(len(c["ids"]) == 1 and c["use_tools"] and c["executor"] == "EXECUTOR" for c in fake.calls)


def test_text_only_registers_no_tool(tmp_path: Path) -> None:
    fake = FakeRollout()
    summary = run(tmp_path / "t.jsonl", mode="text-only", rollout=fake)
    assert all(c["use_tools"] is False and c["executor"] is None for c in fake.calls)
    assert summary["metrics"]["mean_code_calls"] == 0.0 and summary["settings"]["mode"] == "text-only"


def test_results_do_not_depend_on_concurrency(tmp_path: Path) -> None:
    a = run(tmp_path / "a.jsonl", concurrency=1)
    b = run(tmp_path / "b.jsonl", concurrency=6)
    assert a["metrics"] == b["metrics"]


def test_resume_skips_finished_and_discards_partial_line(tmp_path: Path) -> None:
    full = run(tmp_path / "full.jsonl")
    out = tmp_path / "part.jsonl"
    with pytest.raises(RuntimeError, match="went away"):  # a run that died after two problems...
        run(out, rollout=FakeRollout(crash_after=2), concurrency=1)
    assert json.loads(summary_path_for(out).read_text())["status"] == "incomplete"
    with out.open("ab") as fh:  # ...while writing the third
        fh.write(b'{"id": "q2", "candidates": [{"answ')
    fake = FakeRollout()
    resumed = run(out, rollout=fake)
    assert sorted(c["ids"][0] for c in fake.calls) == ["q2", "q3", "q4", "q5"]
    assert resumed["metrics"] == full["metrics"] and resumed["status"] == "complete"
    assert len(out.read_text().splitlines()) == len(PROBLEMS)
    assert resumed["timing"]["sessions"] == 2
    # a rerun of a finished eval does nothing
    fake2 = FakeRollout()
    again = run(out, rollout=fake2)
    assert fake2.calls == [] and again["metrics"] == full["metrics"]


def test_settings_mismatch_is_a_clear_error(tmp_path: Path) -> None:
    out = tmp_path / "e.jsonl"
    run(out, problems=PROBLEMS[:2], seed=0)
    before = out.read_bytes()
    with pytest.raises(EvalError, match=r"val_n: 4 -> 5"):
        run(out, val_n=5)
    with pytest.raises(EvalError, match=r"mode"):
        run(out, mode="text-only")
    cfg = Config()
    cfg.sampling.top_p = 0.5
    with pytest.raises(EvalError, match=r"top_p: 1\.0 -> 0\.5"):
        asyncio.run(
            run_eval(
                PROBLEMS,
                components(),
                config=cfg,
                mode="retool",
                output=out,
                val_n=4,
                rollout_fn=FakeRollout(),
            )
        )
    assert out.read_bytes() == before  # nothing lost


def test_output_without_summary_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "orphan.jsonl"
    out.write_text('{"id": "q0", "candidates": []}\n')
    with pytest.raises(EvalError, match="summary"):
        run(out)


def test_a_second_writer_of_one_output_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    import subprocess
    import sys

    from retool.evaluate import EvalStoreError

    out = tmp_path / "e.jsonl"
    run(out, problems=PROBLEMS[:2])
    before = out.read_bytes(), summary_path_for(out).read_bytes()
    # Another process is writing the output (an earlier run of the same command, still going): it holds the
    # store's claim until it exits.
    holder = (
        "import sys, time\n"
        "from retool.evaluate import ResultStore\n"
        "with ResultStore(sys.argv[1]).claimed():\n"
        "    print('claimed', flush=True)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", holder, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "claimed"
        fake = FakeRollout()
        with pytest.raises(EvalStoreError, match="another evaluation is writing this output"):
            run(out, rollout=fake)
        assert fake.calls == []
        assert (out.read_bytes(), summary_path_for(out).read_bytes()) == before
    finally:
        proc.kill()
        proc.wait()
    # The claim ends with the process, however it ended (here: killed): the output resumes.
    assert run(out, problems=PROBLEMS[:2])["status"] == "complete"


def test_a_fresh_run_that_fails_before_writing_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "nothing.jsonl"
    with pytest.raises(RuntimeError, match="went away"):
        run(out, rollout=FakeRollout(crash_after=0), concurrency=1)
    # it wrote its incomplete summary first, so the (empty) output stays with it, resumable
    assert json.loads(summary_path_for(out).read_text())["status"] == "incomplete"

    def full_disk(self: ResultStore, summary: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ResultStore, "write_summary", full_disk)
    fresh = tmp_path / "refused.jsonl"
    with pytest.raises(OSError, match="No space"):
        run(fresh)
    assert not fresh.exists() and not summary_path_for(fresh).exists()


def test_sampler_errors_are_retried_not_recorded(tmp_path: Path) -> None:
    out = tmp_path / "s.jsonl"
    summary = run(out, rollout=FakeRollout(fail_ids={"q1"}))
    assert summary["status"] == "incomplete" and summary["failed_problems"] == ["q1"]
    assert "q1" not in {json.loads(line)["id"] for line in out.read_text().splitlines()}
    fake = FakeRollout()
    summary = run(out, rollout=fake)
    assert [c["ids"] for c in fake.calls] == [["q1"]] and summary["status"] == "complete"


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(EvalError, match="mode"):
        run(tmp_path / "x.jsonl", mode="tools")
    with pytest.raises(EvalError, match="unique"):
        run(tmp_path / "y.jsonl", problems=[PROBLEMS[0], PROBLEMS[0]])


def test_store_damaged_middle_line_is_an_error(tmp_path: Path) -> None:
    store = ResultStore(tmp_path / "d.jsonl")
    store.path.write_text(
        '{"id": "a", "candidates": []}\n{"id": "b", "candi\n{"id": "c", "candidates": []}\n'
    )
    with pytest.raises(Exception, match=r"d\.jsonl:2"):
        store.load()


def test_store_keeps_complete_line_without_newline(tmp_path: Path) -> None:
    store = ResultStore(tmp_path / "n.jsonl")
    store.path.write_text('{"id": "a", "candidates": []}\n{"id": "b", "candidates": []}')
    assert sorted(store.load()) == ["a", "b"]
    assert store.path.read_text().endswith("}\n")
    store.append({"id": "c", "candidates": []})
    assert sorted(ResultStore(store.path).load()) == ["a", "b", "c"]


def test_summary_path_for() -> None:
    assert summary_path_for("r/x.jsonl") == Path("r/x.summary.json")
    assert summary_path_for("r/x.out") == Path("r/x.out.summary.json")


def test_named_dataset_prefers_local_dir(fixture_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from retool.config import DataConfig
    from retool.env import SourceOptions, make_source

    env = make_source("aime2025", SourceOptions(data=DataConfig(data_dir=str(fixture_data))))
    problems = env.problems("test")
    assert env.source == str(fixture_data / "aime2025.jsonl") and len(problems) == 12
    assert problems[0].id == "2025-I-1" and problems[0].answer == "70"
    monkeypatch.setenv("RETOOL_DATA_DIR", str(fixture_data))
    env = make_source("math500")
    problems = env.problems("test")
    rows = sum(1 for line in (fixture_data / "math500.jsonl").open() if line.strip())
    assert env.source.endswith("math500.jsonl") and len(problems) == rows >= 30
    assert len({p.id for p in problems}) == rows and "/" in problems[0].id  # MATH's unique_id paths


def test_missing_path_is_a_data_error(tmp_path: Path) -> None:
    from retool.data import DataError
    from retool.env import make_source

    with pytest.raises(DataError):
        make_source(str(tmp_path / "nope.jsonl")).problems("test")


def test_cli_refuses_mismatched_resume_before_loading_a_model(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from retool.cli import app

    data = tmp_path / "probs.jsonl"
    data.write_text("".join(json.dumps(p.to_dict()) + "\n" for p in PROBLEMS))
    out = tmp_path / "e.jsonl"
    run(out, identity={"model": "no-such-model", "dataset": str(data)})
    before = out.read_bytes()
    args = [
        "eval",
        "--mode",
        "retool",
        "--model",
        "no-such-model",
        "--dataset",
        str(data),
        "--val-n",
        "5",
        "-o",
        str(out),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "val_n: 4 -> 5" in result.output and "Traceback" not in result.output
    assert out.read_bytes() == before
    bad = CliRunner().invoke(
        app, ["eval", "--mode", "tools", "--dataset", str(data), "-o", str(tmp_path / "x.jsonl")]
    )
    assert bad.exit_code == 2 and "--mode" in bad.output


def test_eval_checkpoint_resolves_through_the_train_layout(tmp_path: Path) -> None:
    from retool.train.checkpoint import CheckpointError, backend_state_of

    ckpts = tmp_path / "run" / "checkpoints"
    for step in ("step_000005", "step_000010"):
        (ckpts / step / "backend").mkdir(parents=True)
        (ckpts / step / "trainer_state.json").write_text(
            json.dumps({"step": int(step[-2:]), "backend_state": "backend", "backend_state_is_local": True})
        )
    (ckpts / "latest").write_text("step_000010\n")
    want = str(ckpts / "step_000010" / "backend")
    assert backend_state_of(str(tmp_path / "run")) == want
    assert backend_state_of(str(ckpts)) == want
    assert backend_state_of(str(ckpts / "step_000005")) == str(ckpts / "step_000005" / "backend")
    assert backend_state_of(str(ckpts / "step_000005" / "backend")) == str(ckpts / "step_000005" / "backend")
    assert backend_state_of("tinker://run-1/weights/5") == "tinker://run-1/weights/5"
    # The local backend's own state folder holds a file of the same name, with other keys: passed through.
    (ckpts / "step_000005" / "backend" / "trainer_state.json").write_text(
        json.dumps({"step": 5, "lora": None})
    )
    assert backend_state_of(str(ckpts / "step_000005" / "backend")) == str(ckpts / "step_000005" / "backend")
    (ckpts / "latest").write_text("step_000099\n")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        backend_state_of(str(tmp_path / "run"))


def test_save_transcripts_keeps_messages(tmp_path: Path) -> None:
    class WithMessages(FakeRollout):
        async def __call__(self, request: RolloutRequest) -> list[list[Trajectory]]:
            groups = await super().__call__(request)
            return [
                [
                    replace(
                        t,
                        outcome=replace(
                            t.outcome, messages=({"role": "user", "content": t.problem.question},)
                        ),
                    )
                    for t in groups[0]
                ]
            ]

    run(tmp_path / "a.jsonl", problems=PROBLEMS[:1], rollout=WithMessages(), save_transcripts=True)
    run(tmp_path / "b.jsonl", problems=PROBLEMS[:1], rollout=WithMessages())
    a = json.loads((tmp_path / "a.jsonl").read_text())
    b = json.loads((tmp_path / "b.jsonl").read_text())
    assert a["candidates"][0]["messages"] == [{"role": "user", "content": PROBLEMS[0].question}]
    assert "messages" not in b["candidates"][0]


def test_prompt_settings_are_recorded_and_old_summaries_still_match() -> None:
    from retool.config import load_config
    from retool.evaluate.settings import build_settings, settings_differences

    def settings(*overrides: str) -> dict[str, Any]:
        return build_settings(
            load_config(None, list(overrides)), mode="retool", val_n=2, seed=0, tool_format="x"
        )

    base = settings()
    older = {k: v for k, v in base.items() if k not in ("enable_thinking", "chat_template")}
    assert settings_differences(older, base) == []
    assert settings_differences(base, settings("model.enable_thinking=false")) == ["enable_thinking"]
    assert settings_differences(base, settings("model.chat_template='{{ x }}'")) == ["chat_template"]


def test_cli_flags_override_the_config_only_when_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every ``retool eval`` default comes from the config; ``--temperature`` / ``--top-p`` and the rest
    apply only when passed (they used to replace the config's sampling even when absent)."""
    from typer.testing import CliRunner

    from retool.cli import app
    from retool.evaluate import cli as eval_cli

    seen: list[Any] = []

    def fake_evaluate(cfg: Config, **kw: Any) -> dict:
        seen.append((cfg, kw))
        raise EvalError("stop here")

    monkeypatch.setattr(eval_cli, "evaluate", fake_evaluate)
    base = ["eval", "--mode", "retool", "-o", str(tmp_path / "e.jsonl")]
    CliRunner().invoke(app, [*base, "--set", "sampling.top_p=0.9", "--set", "eval.val_n=3"])
    cfg, kw = seen[-1]
    assert (cfg.sampling.temperature, cfg.sampling.top_p, cfg.eval.val_n) == (1.0, 0.9, 3)
    assert (cfg.eval.dataset, cfg.eval.seed, cfg.eval.concurrency, cfg.eval.save_transcripts) == (
        "aime2025",
        0,
        4,
        False,
    )
    assert kw["dataset_fields"] == {} and kw["checkpoint"] is None
    given = ["--top-p", "0.7", "--temperature", "0.6", "--val-n", "5", "--dataset", "math500"]
    given += ["--data-dir", str(tmp_path), "--save-transcripts", "--question-field", "q"]
    result = CliRunner().invoke(app, [*base, "--set", "sampling.top_p=0.9", *given])
    assert result.exit_code == 2 and "stop here" in result.output
    cfg, kw = seen[-1]
    assert (cfg.sampling.temperature, cfg.sampling.top_p, cfg.eval.val_n) == (0.6, 0.7, 5)
    assert (cfg.eval.dataset, cfg.data.data_dir, cfg.eval.save_transcripts) == (
        "math500",
        str(tmp_path),
        True,
    )
    assert kw["dataset_fields"] == {"question_field": "q"}
