"""Cold-start SFT data and training: protocol-built sequences, assistant-only weights, real tool output."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from retool.config import SFTConfig, SFTOptimizerConfig, dump_config, load_config
from retool.data.synthetic import generate_tasks
from retool.pipeline.model import build_demo_model, protocol_for, task_texts
from retool.recipes.tiny.styles import SFTMix, build_example, build_sft_examples, choose_style
from retool.train.sft import train_sft, train_sft_as_configured
from retool.train.trace import answer_text


def _observe(code: str) -> str:
    import contextlib
    import io

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(code, {})  # trusted canonical code (and its deliberately broken variant) only
    except Exception as exc:
        return f"Traceback (most recent call last):\n{type(exc).__name__}: {exc}\n"
    return out.getvalue()


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    texts = task_texts(generate_tasks(200, seed=0))
    return build_demo_model(tmp_path_factory.mktemp("demo_model"), texts, size="test")


@pytest.fixture(scope="module")
def protocol(demo_model: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return protocol_for(AutoTokenizer.from_pretrained(demo_model))


def test_tiny_model_prompt_is_short_and_hermes(protocol) -> None:  # type: ignore[no-untyped-def]
    assert protocol.fmt.name == "hermes"
    prompt = protocol.build_prompt(protocol.initial_messages("What is 3 + 4?"))
    # The fixed system block is one phrase token; the question's digits are single tokens.
    assert len(prompt) < 45
    text_mode = protocol_for(protocol.tokenizer, use_tools=False)
    assert protocol.decode(text_mode.build_prompt(text_mode.initial_messages("Q"))).count("# Tools") == 0
    digits = [protocol.decode([t]) for t in protocol.encode("12345")]
    assert digits == ["1", "2", "3", "4", "5"]


@pytest.mark.parametrize("style", ["direct", "tool", "error_fix"])
def test_example_weights_cover_exactly_the_assistant_turns(protocol, style: str) -> None:  # type: ignore[no-untyped-def]
    task = generate_tasks(1, seed=0, kinds=["mul_big"])[0]
    ex = build_example(task, style, protocol, _observe, random.Random(0))
    assert len(ex.tokens) == len(ex.weights)
    prompt = protocol.build_prompt(protocol.initial_messages(task.question))
    assert ex.tokens[: len(prompt)] == prompt and not any(ex.weights[: len(prompt)])
    # Split the weighted tokens into contiguous assistant spans.
    spans, cur = [], []
    for tok, w in zip(ex.tokens, ex.weights, strict=True):
        if w:
            cur.append(tok)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    texts = [protocol.decode(s) for s in spans]
    end = protocol.decode([protocol.end_of_turn_id])
    assert texts[-1] == answer_text(task.answer) + end
    calls = {"direct": 0, "tool": 1, "error_fix": 2}[style]
    assert len(texts) == calls + 1
    if calls:
        assert texts[-2] == protocol.fmt.render_call(task.code) + end
        assert protocol.fmt.parse(texts[-2][: -len(end)]).code == task.code
        # The observation (the real output) is in the sequence but carries no weight.
        full = protocol.decode(ex.tokens)
        assert f"<tool_response>\n{task.answer}\n" in full
    if style == "error_fix":
        assert "Error" in protocol.decode(ex.tokens)


def test_mix_shares(protocol) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(0)
    mix = SFTMix(hard_tool=0.4, hard_error_fix=0.1, easy_tool=0.0)
    hard = [t for t in generate_tasks(400, seed=0) if t.hard]
    easy = [t for t in generate_tasks(100, seed=0) if not t.hard]
    styles = [choose_style(t, mix, rng) for t in hard]
    assert 0.3 < styles.count("tool") / len(styles) < 0.5
    assert 0.04 < styles.count("error_fix") / len(styles) < 0.18
    assert {choose_style(t, mix, rng) for t in easy} == {"direct"}
    with pytest.raises(ValueError):
        SFTMix(hard_tool=0.8, hard_error_fix=0.3)


def test_sft_through_the_local_backend_lowers_the_loss(demo_model: Path, protocol) -> None:  # type: ignore[no-untyped-def]
    import torch

    from retool.backends.local.client import LocalTrainingClient

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only add contention
    examples = build_sft_examples(generate_tasks(64, seed=0), protocol, _observe, seed=0)
    client = LocalTrainingClient(str(demo_model), lora=None, device="cpu", dtype="float32", seed=0)
    report = train_sft(
        client, examples, steps=30, batch_size=8, lr=1e-2, optimizer=SFTOptimizerConfig(warmup=3)
    )
    client.close()
    torch.set_num_threads(threads)
    assert len(report.losses) == 30
    assert sum(report.losses[-5:]) / 5 < 0.7 * sum(report.losses[:3]) / 3
    assert report.styles and sum(report.styles.values()) == 64


def test_two_stage_sft_draws_its_last_steps_from_the_final_examples(protocol) -> None:  # type: ignore[no-untyped-def]
    """The second stage (``final_examples``) takes over exactly for the last ``final_steps`` steps."""
    from retool.backends.interface.types import ForwardBackwardResult, OptimStepResult

    tasks = generate_tasks(40, seed=1)
    first = build_sft_examples(tasks, protocol, _observe, SFTMix(1.0, 0.0, 1.0), seed=0)
    final = build_sft_examples(tasks, protocol, _observe, SFTMix(0.0, 0.0, 0.0), seed=1)
    final_tokens = {tuple(ex.tokens) for ex in final}

    class Recorder:
        def __init__(self) -> None:
            self.batches: list[list[tuple[int, ...]]] = []

        async def forward_backward_async(self, datums, loss_fn, loss_config=None):  # type: ignore[no-untyped-def]
            self.batches.append([(*d.input_tokens, d.target_tokens[-1]) for d in datums])
            return ForwardBackwardResult(loss=1.0, trained_tokens=1)

        async def optim_step_async(self, adam):  # type: ignore[no-untyped-def]
            return OptimStepResult(grad_norm=0.0, lr=adam.lr)

    rec = Recorder()
    report = train_sft(rec, first, steps=10, batch_size=4, final_examples=final, final_steps=3)  # type: ignore[arg-type]
    assert len(rec.batches) == 10 and report.examples == len(first) + len(final)
    in_final = [all(seq in final_tokens for seq in batch) for batch in rec.batches]
    assert in_final == [False] * 7 + [True] * 3
    # The first stage's examples are all tool transcripts, the final ones all direct answers.
    assert {ex.style for ex in final} == {"direct"} and {ex.style for ex in first} == {"tool"}
    with pytest.raises(ValueError, match="final_examples"):
        train_sft(rec, first, steps=4, final_steps=2)  # type: ignore[arg-type]
    # [sft] as configured: with epochs, the steps cover both stages' examples; the last share from the final ones.
    rec = Recorder()
    config = load_config(None, ["sft.epochs=0.5", "sft.batch_size=4", "sft.final_share=0.25"])
    report = train_sft_as_configured(rec, first, config, final_examples=final)  # type: ignore[arg-type]
    steps = -(-(len(first) + len(final)) // 8)  # ceil(0.5 * examples / 4)
    assert len(rec.batches) == report.steps == steps
    last = round(0.25 * steps)
    assert [all(seq in final_tokens for seq in b) for b in rec.batches] == [False] * (steps - last) + [
        True
    ] * last
    assert SFTConfig(final_share=0.2).final_steps_of(1500) == 300
    assert SFTConfig(final_share=0.2).final_steps_of(3) == 1
    assert SFTConfig().final_steps_of(10) == 0


def test_sft_epochs_size_the_steps_to_the_examples() -> None:
    """``sft.epochs`` > 0 covers the examples that many times whatever ``steps`` says (a growing pool is
    trained on as thoroughly as a small one); 0 keeps ``steps``."""
    assert SFTConfig(steps=24, batch_size=8).steps_for(1042) == 24
    assert SFTConfig(steps=24, batch_size=8, epochs=2.0).steps_for(1042) == 261  # ceil(2 * 1042 / 8)
    assert SFTConfig(steps=24, batch_size=8, epochs=1.0).steps_for(16) == 2
    assert SFTConfig(batch_size=8, epochs=0.01).steps_for(3) == 1
    with pytest.raises(ValueError):
        SFTConfig(epochs=-1.0)


def test_the_sft_loop_reads_its_own_optimizer_settings(protocol, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``[sft.optimizer]`` (apart from RL's ``[optimizer]``) reaches every optimizer step; its defaults are
    the settings the SFT stage always had (beta2 0.98, 10 warm-up steps), and it survives a saved config."""
    from retool.backends.interface.types import ForwardBackwardResult, OptimStepResult

    class Recorder:
        def __init__(self) -> None:
            self.adams: list[object] = []

        async def forward_backward_async(self, datums, loss_fn, loss_config=None):  # type: ignore[no-untyped-def]
            return ForwardBackwardResult(loss=1.0, trained_tokens=1)

        async def optim_step_async(self, adam):  # type: ignore[no-untyped-def]
            self.adams.append(adam)
            return OptimStepResult(grad_norm=0.0, lr=adam.lr)

    examples = build_sft_examples(generate_tasks(8, seed=0), protocol, _observe, seed=0)
    default = Recorder()
    train_sft(default, examples, steps=12, batch_size=2, lr=1.0)  # type: ignore[arg-type]
    first = default.adams[0]
    assert (first.beta1, first.beta2, first.eps, first.weight_decay, first.grad_clip_norm) == (
        0.9,
        0.98,
        1e-8,
        0.0,
        1.0,
    )  # type: ignore[attr-defined]
    assert [a.lr for a in default.adams[:10]] == [(k + 1) / 10 for k in range(10)]  # type: ignore[attr-defined]

    cfg = load_config("tiny", ["sft.optimizer.beta2=0.9", "sft.optimizer.warmup=2", "optimizer.beta2=0.5"])
    saved = tmp_path / "config.toml"
    saved.write_text(dump_config(cfg))
    assert load_config(saved) == cfg  # the nested table is written and read back
    tuned = Recorder()
    train_sft(tuned, examples, steps=4, batch_size=2, lr=1.0, optimizer=cfg.sft.optimizer)  # type: ignore[arg-type]
    assert {a.beta2 for a in tuned.adams} == {0.9}  # type: ignore[attr-defined]  # not RL's 0.5
    assert [a.lr for a in tuned.adams[:2]] == [0.5, 1.0]  # type: ignore[attr-defined]


def _traces(protocol, tmp_path: Path, n: int = 24) -> Path:  # type: ignore[no-untyped-def]
    """A trace file as ``retool data coldstart`` writes it: tool trajectories of ``n`` synthetic tasks."""
    from retool.train.sft import write_examples

    examples = build_sft_examples(
        generate_tasks(n, seed=3), protocol, _observe, SFTMix(1.0, 0.0, 1.0), seed=0
    )
    path = tmp_path / "traces.jsonl"
    write_examples(examples, path)
    return path


# Small and on one process: the demo preset otherwise trains 1500 steps on one process per core.
DATA_SETS = ["--set", "backend.processes=1", "--set", "sft.optimizer.warmup=2", "--steps", "30"]


def test_retool_sft_data_trains_the_configs_model_on_a_trace_file(
    demo_model: Path, protocol, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    import json

    from typer.testing import CliRunner

    from retool.cli import app
    from retool.components import build_components

    data, out = _traces(protocol, tmp_path), tmp_path / "sft"
    args = ["sft", "--data", str(data), "--out", str(out), "--set", f"model.name={demo_model}", *DATA_SETS]
    result = CliRunner().invoke(app, [*args, "--lr", "1e-2", "--batch-size", "8"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "sft_report.json").read_text())
    assert report["traces"] == {"read": 24, "used": 24, "over_budget": 0}
    assert report["sft"]["steps"] == 30 and len(report["losses"]) == 30
    assert sum(report["losses"][-5:]) / 5 < 0.7 * sum(report["losses"][:3]) / 3
    assert "sft step" in result.output  # the progress display's lines
    # The folder is an ordinary model: what `retool eval --model OUT/model_sft` loads.
    config = load_config("demo-tiny", [f"model.name={out / 'model_sft'}", "backend.processes=1"])
    with build_components(config, tools=False) as parts:
        assert parts.protocol.fmt.name == "hermes"


def test_retool_sft_data_refuses_traces_of_another_model_or_over_the_budgets(
    demo_model: Path, protocol, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    from typer.testing import CliRunner

    from retool.cli import app
    from retool.pipeline.model import protocol_for

    compact = protocol_for(protocol.tokenizer, system_prompt="compact")  # another system prompt
    data, out = _traces(compact, tmp_path, n=4), tmp_path / "sft"
    args = ["sft", "--data", str(data), "--out", str(out), "--set", f"model.name={demo_model}", *DATA_SETS]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert f"{data}:1: trace" in result.output and "was not tokenised for model.name" in result.output
    assert "retool data coldstart --model" in result.output
    # The model's own traces, every one longer than a turn may be.
    (tmp_path / "own").mkdir()
    own = _traces(protocol, tmp_path / "own", n=4)
    tight = ["--set", "rollout.max_tokens_per_turn=2"]
    over = CliRunner().invoke(app, ["sft", "--data", str(own), *args[3:], *tight])
    assert over.exit_code == 2 and "every trace is over the RL budgets" in over.output


def test_sft_progress_logs_a_line_every_few_steps_with_the_time_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from retool.train.sft import SFTProgress

    progress = SFTProgress(steps=25, every=10)
    with caplog.at_level("INFO", logger="retool.train.sft"):
        for step in range(25):
            progress(step, 1.0)
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split("  ")[0] for line in lines] == ["sft step 10/25", "sft step 20/25", "sft step 25/25"]
    assert all("loss 1.0000" in line and "ETA" in line for line in lines) and lines[-1].endswith("ETA 0s")
