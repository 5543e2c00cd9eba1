"""``retool demo``: the whole pipeline on a tiny local model, on CPU, in minutes.

Steps (every artefact under one run folder):
1. synthetic tasks (train / held-out test) -> ``tasks/``
2. tiny model (tokenizer trained on the task text) -> ``model_init/``
3. cold-start SFT on code-interleaved trajectories -> ``model_sft/`` (an ordinary HF folder)
4. evaluation of the SFT model, text-only and retool modes -> ``eval/sft_*.jsonl``
5. RL with the real sandbox and verifier through ``retool.train.Trainer`` -> ``rl/`` (+ ``model_rl/``)
6. evaluation again -> ``eval/rl_*.jsonl``; before/after table -> ``report.md`` / ``report.json``;
   plots through ``retool.analyze`` -> ``analysis/``.

The library never prints: progress goes through ``on_event`` (the CLI renders it) and ``logging``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from retool.tasks.family import DEMO_KINDS, Task, generate_tasks, parse_source

logger = logging.getLogger(__name__)

Event = Callable[[str, dict[str, Any]], None]


@dataclass
class DemoSettings:
    """Every knob of the demo. Defaults are sized for < 10 minutes on 2 CPU cores (see the README)."""

    out: str = "runs/demo"
    seed: int = 0
    size: str = "demo"
    threads: int = 1  # torch intra-op threads; 1 leaves a core to the sandbox and verifier processes
    train_tasks: int = 1200
    test_tasks: int = 40
    hard_fraction: float = 0.5
    kinds: tuple[str, ...] = DEMO_KINDS
    # cold-start SFT
    sft_steps: int = 1500
    sft_batch: int = 16
    sft_lr: float = 3e-3
    sft_hard_tool: float = 0.35
    sft_hard_error_fix: float = 0.1
    sft_easy_tool: float = 0.3
    # evaluation
    val_n: int = 4
    eval_modes: tuple[str, ...] = ("text-only", "retool")
    # RL
    rl_steps: int = 40
    questions_per_step: int = 8
    group_size: int = 8
    rl_lr: float = 4e-4
    loss: str = "ppo"
    temperature: float = 1.0
    max_tokens_per_turn: int = 96
    max_code_calls: int = 2
    max_assistant_turns: int = 3
    max_trajectory_tokens: int = 640
    sandbox_workers: int = 2
    plots: bool = True

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eval_modes"] = list(self.eval_modes)
        d["kinds"] = list(self.kinds)
        return d


def demo_tasks(settings: DemoSettings) -> tuple[list[Task], list[Task]]:
    """The demo's seeded train split and held-out test split."""

    def split(name: str, n: int) -> list[Task]:
        return generate_tasks(
            n, seed=settings.seed, hard_fraction=settings.hard_fraction, kinds=settings.kinds, split=name
        )

    return split("train", settings.train_tasks), split("test", settings.test_tasks)


def cold_start_sft(
    client: Any,
    train: Sequence[Task],
    executor: Any,
    settings: DemoSettings,
    emit: Event,
    on_examples: Callable[[int], None] | None = None,
) -> Any:
    """Build the code-interleaved SFT trajectories (real sandbox output) and train on them; return the report."""
    from retool.tasks.model import protocol_for
    from retool.tasks.sft import SFTMix, build_sft_examples, train_sft

    protocol = protocol_for(client.tokenizer, True)
    mix = SFTMix(settings.sft_hard_tool, settings.sft_hard_error_fix, settings.sft_easy_tool)
    examples = build_sft_examples(train, protocol, sandbox_observer(executor), mix, seed=settings.seed)
    if on_examples is not None:
        on_examples(len(examples))
    return train_sft(
        client,
        examples,
        steps=settings.sft_steps,
        batch_size=settings.sft_batch,
        lr=settings.sft_lr,
        seed=settings.seed,
        on_step=lambda s, loss: emit("sft_step", {"step": s + 1, "steps": settings.sft_steps, "loss": loss}),
    )


@dataclass
class DemoResult:
    out: Path
    table: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    sft: dict[str, Any] = field(default_factory=dict)
    plots: list[str] = field(default_factory=list)


# -- shared components -----------------------------------------------------------------------------


def demo_config(settings: DemoSettings, model_dir: str | Path, run_dir: str | Path) -> Any:
    """The ``retool.config.Config`` the demo's RL and evaluation run under."""
    from retool.config import Config

    return Config.model_validate(
        {
            "model": {"name": str(model_dir), "tool_format": "auto", "max_context": 1024},
            "backend": {
                "kind": "local",
                "device": "cpu",
                "dtype": "float32",
                "micro_batch_tokens": 4096,
                "sample_batch_size": 64,
            },
            "lora": {"enabled": False},
            "data": {
                "train_path": "tasks",
                "seed": settings.seed,
                "task_count": settings.train_tasks,
                "task_hard_fraction": settings.hard_fraction,
            },
            "rollout": {
                "questions_per_step": settings.questions_per_step,
                "group_size": settings.group_size,
                "max_code_calls": settings.max_code_calls,
                "max_assistant_turns": settings.max_assistant_turns,
                "max_tokens_per_turn": settings.max_tokens_per_turn,
                "max_observation_tokens": 64,
                "max_trajectory_tokens": settings.max_trajectory_tokens,
            },
            "sampling": {"temperature": settings.temperature, "top_p": 1.0},
            "loss": {"name": settings.loss},
            "optimizer": {"lr": settings.rl_lr, "beta1": 0.9, "beta2": 0.95},
            "sandbox": _sandbox_section(settings),
            "reward": {"verify_workers": 1, "verify_timeout": 5.0},
            "logging": {"tracker": "none", "progress": False},
            "checkpoint": {"every": 0, "keep_last": 1},
            "train": {"steps": settings.rl_steps, "seed": settings.seed, "run_dir": str(run_dir)},
        }
    )


def _sandbox_section(settings: DemoSettings) -> dict[str, Any]:
    from retool.sandbox import strict_support

    strict, reason = strict_support()
    if not strict:
        logger.warning("sandbox: strict isolation unavailable here (%s); using isolation=none", reason)
    # Only the standard library is needed by the task family's code; no numpy/sympy start-up cost.
    return {
        "backend": "forkserver",
        "isolation": "strict" if strict else "none",
        "timeout": 5.0,
        "preimport": ["math"],
        "workers": settings.sandbox_workers,
    }


def make_executor(settings: DemoSettings) -> Any:
    from retool.config import SandboxConfig
    from retool.sandbox import make_executor as _make

    return _make(SandboxConfig.model_validate(_sandbox_section(settings)))


class _KeepOpen:
    """Lends an executor/verifier to a component that closes what it is given (the Trainer does)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def close(self) -> None:
        pass


def sandbox_observer(executor: Any) -> Callable[[str], str]:
    """SFT observations: the canonical code's REAL output through the sandbox executor."""

    def observe(code: str) -> str:
        return executor.format_tool_content(executor.run(code))

    return observe


def make_client(model_dir: str | Path, seed: int, checkpoint_dir: str | Path) -> Any:
    """Full fine-tuning local client (the tiny model has no use for LoRA)."""
    from retool.backends.local import LocalTrainingClient

    return LocalTrainingClient(
        str(model_dir),
        lora=None,
        device="cpu",
        dtype="float32",
        seed=seed,
        micro_batch_tokens=4096,
        sample_batch_size=64,
        checkpoint_dir=checkpoint_dir,
        max_context=1024,
    )


def save_hf(client: Any, folder: Path) -> Path:
    """Write the client's current weights + tokenizer as a plain HF folder (usable as ``--model``)."""
    folder.mkdir(parents=True, exist_ok=True)
    model = client.model
    if hasattr(model, "merge_and_unload"):  # never for full fine-tuning; kept for LoRA clients
        model = model.merge_and_unload()
    model.save_pretrained(folder)
    client.tokenizer.save_pretrained(folder)
    return folder


# -- evaluation ------------------------------------------------------------------------------------


def evaluate_modes(
    client: Any,
    problems: Sequence[Any],
    settings: DemoSettings,
    config: Any,
    out_dir: Path,
    label: str,
    executor: Any,
    verifier: Any,
) -> dict[str, dict[str, Any]]:
    """Run ``retool.evaluate.run_eval`` for each mode; return {mode: summary + per-difficulty stats}."""
    from retool.evaluate.runner import EvalComponents, run_eval
    from retool.tasks.model import protocol_for

    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for mode in settings.eval_modes:
        use_tools = mode == "retool"
        output = out_dir / f"{label}_{mode}.jsonl"

        async def go(mode: str = mode, use_tools: bool = use_tools, output: Path = output) -> dict[str, Any]:
            sampler = await client.sampling_client_async()
            comps = EvalComponents(
                sampler=sampler,
                protocol=protocol_for(client.tokenizer, use_tools),
                verifier=verifier,
                executor=executor if use_tools else None,
            )
            return await run_eval(
                list(problems),
                comps,
                config=config,
                mode=mode,
                output=output,
                val_n=settings.val_n,
                seed=settings.seed,
                identity={"model": label, "checkpoint": label, "dataset": "tasks-test"},
                concurrency=len(problems),
                bootstrap_resamples=200,
                save_transcripts=True,  # full trajectories for `retool view`
            )

        summary = asyncio.run(go())
        # run_eval's summary nests the metrics; keep them flat next to the per-difficulty numbers.
        flat = dict(summary.get("metrics", summary))
        flat.update(difficulty_breakdown(output))
        results[mode] = flat
    return results


def difficulty_breakdown(records_path: Path) -> dict[str, Any]:
    """Accuracy / tool-call rate / format rate on easy vs hard problems, from an eval's JSONL."""
    buckets: dict[str, list[dict[str, Any]]] = {"easy": [], "hard": []}
    with records_path.open(encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            rec = json.loads(line)
            parsed = parse_source(str(rec.get("data_source", "")))
            if parsed is None:
                continue
            buckets["hard" if parsed[1] else "easy"].extend(rec.get("candidates", []))
    out: dict[str, Any] = {}
    for name, cands in buckets.items():
        n = len(cands)
        out[f"{name}_candidates"] = n
        out[f"{name}_accuracy"] = sum(bool(c["correct"]) for c in cands) / n if n else 0.0
        out[f"{name}_tool_call_rate"] = sum(int(c["code_calls"]) > 0 for c in cands) / n if n else 0.0
        out[f"{name}_format_rate"] = sum(bool(c["valid_format"]) for c in cands) / n if n else 0.0
    return out


TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("average_at_n", "Average@N", "pct"),
    ("pass_at_n", "Pass@N", "pct"),
    ("format_rate", "Format", "pct"),
    ("mean_code_calls", "Code calls", "num"),
    ("easy_accuracy", "Acc easy", "pct"),
    ("hard_accuracy", "Acc hard", "pct"),
    ("easy_tool_call_rate", "Tool easy", "pct"),
    ("hard_tool_call_rate", "Tool hard", "pct"),
)


def table_rows(evals: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for stage, by_mode in evals.items():
        for mode, summary in by_mode.items():
            row = {"model": stage, "mode": mode}
            row.update({key: summary.get(key) for key, _, _ in TABLE_COLUMNS})
            rows.append(row)
    return rows


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    header = ["model", "mode"] + [title for _, title, _ in TABLE_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [str(row["model"]), str(row["mode"])]
        for key, _, kind in TABLE_COLUMNS:
            v = row.get(key)
            cells.append("-" if v is None else (f"{100 * v:.1f}%" if kind == "pct" else f"{v:.2f}"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- the pipeline ----------------------------------------------------------------------------------


def run_demo(settings: DemoSettings, on_event: Event | None = None) -> DemoResult:
    """Build, SFT, evaluate, RL, evaluate; write everything under ``settings.out``."""
    import torch

    from retool.reward import Verifier
    from retool.tasks.model import build_demo_model, protocol_for
    from retool.train.datasource import list_source
    from retool.train.loop import Trainer

    emit = on_event or (lambda kind, data: None)
    out = Path(settings.out)
    if (out / "report.json").exists() or (out / "rl").exists():
        raise FileExistsError(f"{out} already holds a demo run; choose another --out or remove it")
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(settings.as_dict(), indent=2) + "\n")
    torch.set_num_threads(max(1, settings.threads))
    torch.manual_seed(settings.seed)
    result = DemoResult(out=out)
    t_all = time.perf_counter()

    def phase(name: str, t0: float) -> None:
        result.timings[name] = round(time.perf_counter() - t0, 1)
        emit("phase_done", {"phase": name, "seconds": result.timings[name]})

    # 1. tasks
    t0 = time.perf_counter()
    train, test = demo_tasks(settings)
    write_tasks(out / "tasks" / "train.jsonl", train)
    write_tasks(out / "tasks" / "test.jsonl", test)
    phase("tasks", t0)

    # 2. tiny model
    t0 = time.perf_counter()
    emit("phase", {"phase": "model", "detail": f"building the tiny model ({settings.size})"})
    model_init = build_demo_model(out / "model_init", train, size=settings.size, seed=settings.seed)  # type: ignore[arg-type]
    phase("model", t0)

    executor = make_executor(settings)
    verifier = Verifier(workers=1, timeout=5.0)
    try:
        # 3. SFT
        t0 = time.perf_counter()
        client = make_client(model_init, settings.seed, out / "checkpoints")
        emit("phase", {"phase": "sft", "detail": f"{client.num_trainable_parameters():,} parameters"})
        report = cold_start_sft(client, train, executor, settings, emit)
        model_sft = save_hf(client, out / "model_sft")
        result.sft = report.as_dict()
        (out / "sft_report.json").write_text(json.dumps(result.sft, indent=2) + "\n")
        phase("sft", t0)

        # 4. evaluate SFT
        config = demo_config(settings, model_sft, out / "rl")
        problems = [t.to_problem() for t in test]
        evals: dict[str, dict[str, dict[str, Any]]] = {}
        t0 = time.perf_counter()
        emit(
            "phase", {"phase": "eval_sft", "detail": f"{len(problems)} held-out problems x {settings.val_n}"}
        )
        evals["sft"] = evaluate_modes(
            client, problems, settings, config, out / "eval", "sft", executor, verifier
        )
        emit("eval", {"model": "sft", "summaries": evals["sft"]})
        phase("eval_sft", t0)

        # 5. RL
        t0 = time.perf_counter()
        emit(
            "phase",
            {
                "phase": "rl",
                "detail": f"{settings.rl_steps} steps x {settings.questions_per_step} "
                f"questions x {settings.group_size} samples",
            },
        )
        trainer = Trainer(
            config,
            out / "rl",
            client=client,
            source=list_source([t.to_problem() for t in train]),
            executor=_KeepOpen(executor),
            verifier=_KeepOpen(verifier),
            protocol=protocol_for(client.tokenizer, True),
            on_step=lambda step, metrics: emit(
                "rl_step", {"step": step, "steps": settings.rl_steps, "metrics": metrics}
            ),
        )
        trainer.run()
        save_hf(client, out / "model_rl")
        phase("rl", t0)

        # 6. evaluate RL
        t0 = time.perf_counter()
        emit("phase", {"phase": "eval_rl", "detail": "same problems, settings and verifier"})
        evals["rl"] = evaluate_modes(
            client, problems, settings, config, out / "eval", "rl", executor, verifier
        )
        emit("eval", {"model": "rl", "summaries": evals["rl"]})
        phase("eval_rl", t0)
        client.close()
    finally:
        executor.close()
        verifier.close()

    # 7. report + plots
    result.table = table_rows(evals)
    result.timings["total"] = round(time.perf_counter() - t_all, 1)
    report_json = {
        "settings": settings.as_dict(),
        "table": result.table,
        "timings": result.timings,
        "sft": result.sft,
        "evals": evals,
    }
    (out / "report.json").write_text(json.dumps(report_json, indent=2, default=str) + "\n")
    (out / "report.md").write_text(markdown_table(result.table) + "\n")
    if settings.plots:
        result.plots = make_plots(out)
    from retool.view.site import write_view  # the trajectory viewer (`retool view`), into <out>/view/

    write_view([out], out / "view")
    return result


def write_tasks(path: Path, tasks: Sequence[Task]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for t in tasks:
            fh.write(
                json.dumps(
                    {
                        "id": t.id,
                        "question": t.question,
                        "answer": str(t.answer),
                        "data_source": t.data_source,
                        "kind": t.kind,
                        "hard": t.hard,
                        "code": t.code,
                    }
                )
                + "\n"
            )


def make_plots(out: Path) -> list[str]:
    """Comparison table + plots through ``retool.analyze`` (evals and the RL metrics log)."""
    try:
        from retool.analyze import analyze
    except ImportError:
        logger.warning("retool.analyze not available: no plots")
        return []
    inputs = sorted((out / "eval").glob("*.jsonl"))
    metrics = out / "rl" / "metrics.jsonl"
    if metrics.exists():
        inputs.append(metrics)
    try:
        res = analyze(inputs, out / "analysis", plots=True)
    except Exception:  # plots are a by-product; never lose the run's numbers over them
        logger.exception("retool.analyze failed; the report files are still in %s", out)
        return []
    return [str(p) for p in res.files if str(p).endswith(".png")]


# -- `retool sft` on its own -----------------------------------------------------------------------


def run_sft(
    settings: DemoSettings,
    model: str | Path | None = None,
    on_event: Event | None = None,
    evaluate: bool = True,
) -> dict[str, Any]:
    """Cold-start SFT of ``model`` (default: a freshly built tiny model) on the task family.

    Writes ``<out>/model_sft`` (HF folder), ``sft_report.json`` and, if ``evaluate``, the retool-mode
    evaluation of the result on the held-out split: protocol-validity (format) rate and accuracy.
    """
    import torch

    from retool.reward import Verifier
    from retool.tasks.model import build_demo_model

    emit = on_event or (lambda kind, data: None)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, settings.threads))
    train, test = demo_tasks(settings)
    if model is None:
        emit("phase", {"phase": "model", "detail": f"building the tiny model ({settings.size})"})
        model = build_demo_model(out / "model_init", train, size=settings.size, seed=settings.seed)  # type: ignore[arg-type]
    executor = make_executor(settings)
    verifier = Verifier(workers=1, timeout=5.0)
    try:
        client = make_client(model, settings.seed, out / "checkpoints")
        report = cold_start_sft(
            client,
            train,
            executor,
            settings,
            emit,
            on_examples=lambda n: emit(
                "phase", {"phase": "sft", "detail": f"{n} trajectories, {settings.sft_steps} steps"}
            ),
        )
        save_hf(client, out / "model_sft")
        result: dict[str, Any] = {"sft": report.as_dict(), "model": str(out / "model_sft")}
        if evaluate:
            cfg = demo_config(settings, out / "model_sft", out / "rl")
            only = DemoSettings(**{**asdict(settings), "eval_modes": ("retool",)})
            summaries = evaluate_modes(
                client, [t.to_problem() for t in test], only, cfg, out / "eval", "sft", executor, verifier
            )
            s = summaries["retool"]
            result["eval"] = {
                "format_rate": s["format_rate"],
                "average_at_n": s["average_at_n"],
                "pass_at_n": s["pass_at_n"],
                "hard_tool_call_rate": s["hard_tool_call_rate"],
                "easy_accuracy": s["easy_accuracy"],
                "hard_accuracy": s["hard_accuracy"],
            }
        client.close()
    finally:
        executor.close()
        verifier.close()
    (out / "sft_report.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
