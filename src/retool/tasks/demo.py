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
    test_tasks: int = 200
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
    # which groups / trajectories RL learns from (``retool.config.FiltersConfig``)
    dynamic_sampling: bool = True
    oversample: float = 1.0
    max_extra_rounds: int = 2
    void_turn_filter: bool = False
    overlong_filter: bool = False
    text_only_share: float = 0.0  # share of RL questions rolled out text-only (``rollout.text_only_share``)
    sandbox_workers: int = 2
    # Padded area of one micro-batch. Small on CPU: compute grows with the padded area, and short direct
    # answers batched with long tool transcripts would triple it (measured: 1024 -> 2.7x faster than 4096).
    micro_batch_tokens: int = 1024
    plots: bool = True
    # A finished demo run folder: start from its SFT model and SFT evaluation (same seed and tasks) and
    # redo only RL and its evaluation, e.g. to compare RL settings on one SFT model.
    reuse_sft: str | None = None

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
    gain: dict[str, Any] = field(default_factory=dict)  # RL over SFT, retool mode (see ``demo_gain``)


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
                "micro_batch_tokens": settings.micro_batch_tokens,
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
                "text_only_share": settings.text_only_share,
            },
            "sampling": {"temperature": settings.temperature, "top_p": 1.0},
            "filters": {
                "dynamic_sampling": settings.dynamic_sampling,
                "oversample": settings.oversample,
                "max_extra_rounds": settings.max_extra_rounds,
                "void_turn": settings.void_turn_filter,
                "overlong": settings.overlong_filter,
            },
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


def make_client(
    model_dir: str | Path, seed: int, checkpoint_dir: str | Path, micro_batch_tokens: int = 1024
) -> Any:
    """Full fine-tuning local client (the tiny model has no use for LoRA)."""
    from retool.backends.local import LocalTrainingClient

    return LocalTrainingClient(
        str(model_dir),
        lora=None,
        device="cpu",
        dtype="float32",
        seed=seed,
        micro_batch_tokens=micro_batch_tokens,
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


# Settings that fix the tasks and the SFT model: a run reusing another's SFT must agree on all of them.
_SFT_FIELDS = (
    "seed",
    "size",
    "train_tasks",
    "test_tasks",
    "hard_fraction",
    "kinds",
    "sft_steps",
    "sft_batch",
    "sft_lr",
    "sft_hard_tool",
    "sft_hard_error_fix",
    "sft_easy_tool",
    "val_n",
    "eval_modes",
    "micro_batch_tokens",
)


class _Clock:
    """Phase timings of one demo run, reported through ``emit`` as each phase ends."""

    def __init__(self, result: DemoResult, emit: Event) -> None:
        self.result, self.emit = result, emit
        self.t0 = time.perf_counter()

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def done(self, name: str) -> None:
        self.result.timings[name] = round(time.perf_counter() - self.t0, 1)
        self.emit("phase_done", {"phase": name, "seconds": self.result.timings[name]})
        self.t0 = time.perf_counter()


def run_demo(settings: DemoSettings, on_event: Event | None = None) -> DemoResult:
    """Build, SFT, evaluate, RL, evaluate; write everything under ``settings.out``.

    RL starts from the saved SFT model with a fresh optimizer, exactly as ``retool train --set
    model.name=OUT/model_sft`` would, so ``reuse_sft`` runs and the full pipeline take the same path.
    """
    import torch

    from retool.reward import Verifier

    emit = on_event or (lambda kind, data: None)
    out = Path(settings.out)
    if (out / "report.json").exists() or (out / "rl").exists():
        raise FileExistsError(f"{out} already holds a demo run; choose another --out or remove it")
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(settings.as_dict(), indent=2) + "\n")
    torch.set_num_threads(max(1, settings.threads))
    torch.manual_seed(settings.seed)
    result = DemoResult(out=out)
    clock = _Clock(result, emit)
    t_all = time.perf_counter()

    train, test = demo_tasks(settings)
    write_tasks(out / "tasks" / "train.jsonl", train)
    write_tasks(out / "tasks" / "test.jsonl", test)
    clock.done("tasks")
    problems = [t.to_problem() for t in test]

    executor = make_executor(settings)
    verifier = Verifier(workers=1, timeout=5.0)
    try:
        if settings.reuse_sft:
            model_sft, evals = _reuse_sft(settings, out, result)
            clock.done("reuse_sft")
        else:
            model_sft, evals = _sft_phase(settings, out, train, problems, executor, verifier, clock)

        emit("phase", {"phase": "rl", "detail": _rl_detail(settings)})
        config = demo_config(settings, model_sft, out / "rl")
        client = make_client(model_sft, settings.seed, out / "checkpoints", settings.micro_batch_tokens)
        try:
            _reinforce(client, config, settings, train, executor, verifier, emit)
            save_hf(client, out / "model_rl")
            clock.done("rl")

            emit("phase", {"phase": "eval_rl", "detail": "same problems, settings and verifier"})
            evals["rl"] = evaluate_modes(
                client, problems, settings, config, out / "eval", "rl", executor, verifier
            )
            emit("eval", {"model": "rl", "summaries": evals["rl"]})
            clock.done("eval_rl")
        finally:
            client.close()
    finally:
        executor.close()
        verifier.close()

    result.table = table_rows(evals)
    result.gain = demo_gain(out / "eval")
    result.timings["total"] = round(time.perf_counter() - t_all, 1)
    result.timings["rl_share"] = round(result.timings["rl"] / max(result.timings["total"], 1e-9), 3)
    _write_report(out, settings, result, evals)
    if settings.plots:
        result.plots = make_plots(out)
    from retool.view.site import write_view  # the trajectory viewer (`retool view`), into <out>/view/

    write_view([out], out / "view")
    return result


def _rl_detail(settings: DemoSettings) -> str:
    detail = (
        f"{settings.rl_steps} steps x {settings.questions_per_step} questions x {settings.group_size} samples"
    )
    return detail + (", dynamic sampling" if settings.dynamic_sampling else "")


def _sft_phase(
    settings: DemoSettings,
    out: Path,
    train: Sequence[Task],
    problems: Sequence[Any],
    executor: Any,
    verifier: Any,
    clock: _Clock,
) -> tuple[Path, dict[str, dict[str, dict[str, Any]]]]:
    """Tiny model, cold-start SFT, SFT evaluation; returns the SFT model folder and its evaluation."""
    from retool.tasks.model import build_demo_model

    emit = clock.emit
    emit("phase", {"phase": "model", "detail": f"building the tiny model ({settings.size})"})
    model_init = build_demo_model(out / "model_init", train, size=settings.size, seed=settings.seed)  # type: ignore[arg-type]
    clock.done("model")

    client = make_client(model_init, settings.seed, out / "checkpoints", settings.micro_batch_tokens)
    try:
        emit("phase", {"phase": "sft", "detail": f"{client.num_trainable_parameters():,} parameters"})
        report = cold_start_sft(client, train, executor, settings, emit)
        model_sft = save_hf(client, out / "model_sft")
        clock.result.sft = report.as_dict()
        (out / "sft_report.json").write_text(json.dumps(clock.result.sft, indent=2) + "\n")
        clock.done("sft")

        emit(
            "phase", {"phase": "eval_sft", "detail": f"{len(problems)} held-out problems x {settings.val_n}"}
        )
        config = demo_config(settings, model_sft, out / "rl")
        evals = {
            "sft": evaluate_modes(client, problems, settings, config, out / "eval", "sft", executor, verifier)
        }
        emit("eval", {"model": "sft", "summaries": evals["sft"]})
        clock.done("eval_sft")
    finally:
        client.close()
    return model_sft, evals


def _reuse_sft(
    settings: DemoSettings, out: Path, result: DemoResult
) -> tuple[Path, dict[str, dict[str, dict[str, Any]]]]:
    """The SFT model and SFT evaluation of an earlier run with the same tasks and SFT settings."""
    import shutil

    from retool.evaluate.store import summary_path_for

    source = Path(str(settings.reuse_sft))
    try:
        earlier = json.loads((source / "settings.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--reuse-sft {source}: not a finished demo run ({exc})") from None
    mine = settings.as_dict()
    differ = [k for k in _SFT_FIELDS if earlier.get(k) != mine.get(k)]
    if differ:
        raise ValueError(f"--reuse-sft {source}: its settings differ in {', '.join(differ)}")
    if not (source / "model_sft" / "config.json").is_file():
        raise ValueError(f"--reuse-sft {source}: no model_sft/ folder")
    (out / "eval").mkdir(parents=True, exist_ok=True)
    evals: dict[str, dict[str, dict[str, Any]]] = {"sft": {}}
    for mode in settings.eval_modes:
        records = source / "eval" / f"sft_{mode}.jsonl"
        for path in (records, summary_path_for(records)):
            if not path.is_file():
                raise ValueError(f"--reuse-sft {source}: missing {path.relative_to(source)}")
            shutil.copy2(path, out / "eval" / path.name)
        evals["sft"][mode] = _flat_summary(out / "eval" / records.name)
    if (source / "sft_report.json").is_file():
        result.sft = json.loads((source / "sft_report.json").read_text())
    return source / "model_sft", evals


def _flat_summary(records_path: Path) -> dict[str, Any]:
    from retool.evaluate.store import summary_path_for

    summary = json.loads(summary_path_for(records_path).read_text())
    flat = dict(summary.get("metrics", summary))
    flat.update(difficulty_breakdown(records_path))
    return flat


def _reinforce(
    client: Any,
    config: Any,
    settings: DemoSettings,
    train: Sequence[Task],
    executor: Any,
    verifier: Any,
    emit: Event,
) -> None:
    from retool.tasks.model import protocol_for
    from retool.train.datasource import list_source
    from retool.train.loop import Trainer

    trainer = Trainer(
        config,
        Path(config.train.run_dir),
        client=client,
        source=list_source([t.to_problem() for t in train]),
        executor=_KeepOpen(executor),
        verifier=_KeepOpen(verifier),
        protocol=protocol_for(client.tokenizer, True),
        text_protocol=protocol_for(client.tokenizer, False),
        on_step=lambda step, metrics: emit(
            "rl_step", {"step": step, "steps": settings.rl_steps, "metrics": metrics}
        ),
    )
    trainer.run()


def demo_gain(eval_dir: Path, mode: str = "retool") -> dict[str, Any]:
    """RL minus SFT on the same held-out problems: Average@N with its paired 95% bootstrap interval, and
    the accuracy change on easy and hard problems."""
    from retool.evaluate.metrics import paired_gain

    def records(label: str) -> list[dict[str, Any]]:
        path = eval_dir / f"{label}_{mode}.jsonl"
        return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]

    sft, rl = records("sft"), records("rl")
    out: dict[str, Any] = {"mode": mode, "average_at_n": paired_gain(sft, rl, seed=0)}
    for name, hard in (("easy", False), ("hard", True)):

        def subset(rows: list[dict[str, Any]], hard: bool = hard) -> list[dict[str, Any]]:
            return [r for r in rows if (parse_source(str(r.get("data_source", ""))) or ("", None))[1] is hard]

        if subset(sft):
            out[f"{name}_accuracy"] = paired_gain(subset(sft), subset(rl), seed=0)
    return out


def _write_report(
    out: Path, settings: DemoSettings, result: DemoResult, evals: dict[str, dict[str, dict[str, Any]]]
) -> None:
    report_json = {
        "settings": settings.as_dict(),
        "table": result.table,
        "gain": result.gain,
        "timings": result.timings,
        "sft": result.sft,
        "evals": evals,
    }
    (out / "report.json").write_text(json.dumps(report_json, indent=2, default=str) + "\n")
    (out / "report.md").write_text(markdown_table(result.table) + "\n\n" + gain_line(result.gain) + "\n")


def gain_line(gain: dict[str, Any]) -> str:
    """One sentence: the RL gain with its interval (the demo's claim, as the report and CLI state it)."""
    if not gain:
        return ""
    avg = gain["average_at_n"]
    lo, hi = avg["ci95"]
    text = (
        f"RL over SFT ({gain['mode']} mode, {avg['problems']} held-out problems): Average@N "
        f"{100 * avg['gain']:+.1f} points (95% paired bootstrap CI {100 * lo:+.1f} to {100 * hi:+.1f})"
    )
    if "hard_accuracy" in gain:
        text += f"; hard problems {100 * gain['hard_accuracy']['gain']:+.1f} points"
    return text + "."


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
        client = make_client(model, settings.seed, out / "checkpoints", settings.micro_batch_tokens)
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
