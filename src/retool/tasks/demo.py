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
import os
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
    # -- the model (``retool.tasks.real_model`` holds the named real models and their settings) ----------
    model: str = "tiny"  # "tiny": built from the task text; a real model's name ("smollm2") or a path
    lora_rank: int = 0  # 0: full fine-tuning (the tiny model); > 0: LoRA on the attention projections
    lora_alpha: int = 0  # 0: twice the rank
    system_prompt: str = "full"  # "compact": the same rules in fewer tokens (``retool.protocol.prompts``)
    test_hard_fraction: float | None = None  # hard share of the held-out split (None: ``hard_fraction``)
    gsm8k_problems: int = 0  # GSM8K test problems added to the held-out set (never trained on)
    data_dir: str | None = None  # folder of gsm8k_test.jsonl (None: $RETOOL_DATA_DIR, ../shared/data)
    base_eval_problems: int = 0  # zero-shot retool-mode eval of the model before SFT, first N held-out
    max_context: int = 1024
    max_observation_tokens: int = 64
    sample_batch_size: int = 64
    checkpoint_every: int = 0  # RL checkpoint interval in steps (what ``resume`` restarts RL from); 0: none
    # Continue the run already in ``out``: finished phases are skipped, RL resumes from its last
    # checkpoint, evaluations from their JSONL. Settings must match the run's ``settings.json``.
    resume: bool = False

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eval_modes"] = list(self.eval_modes)
        d["kinds"] = list(self.kinds)
        return d


def demo_tasks(settings: DemoSettings) -> tuple[list[Task], list[Task]]:
    """The demo's seeded train split and held-out test split."""

    def split(name: str, n: int, hard: float) -> list[Task]:
        return generate_tasks(n, seed=settings.seed, hard_fraction=hard, kinds=settings.kinds, split=name)

    train = split("train", settings.train_tasks, settings.hard_fraction)
    if settings.test_hard_fraction is None or settings.test_hard_fraction == settings.hard_fraction:
        return train, split("test", settings.test_tasks, settings.hard_fraction)
    # generate_tasks holds the test split out against a train stream of the same hard share; with a
    # different share, hold it out against the actual train split here (hard kinds rarely collide).
    seen = {t.question for t in train if t.hard}
    pool = split("test", 2 * settings.test_tasks + 16, settings.test_hard_fraction)
    test = [t for t in pool if t.question not in seen][: settings.test_tasks]
    if len(test) < settings.test_tasks:
        raise ValueError("could not draw enough held-out test problems; use fewer --test-tasks")
    return train, test


def held_out_problems(settings: DemoSettings, test: Sequence[Task]) -> list[Any]:
    """The evaluation set: the held-out synthetic split, plus the GSM8K slice for real models."""
    problems = [t.to_problem() for t in test]
    if settings.gsm8k_problems > 0:
        from retool.tasks.real_model import gsm8k_problems

        problems += gsm8k_problems(settings.gsm8k_problems, settings.data_dir, seed=settings.seed)
    return problems


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

    protocol = protocol_for(client.tokenizer, True, settings.system_prompt)
    mix = SFTMix(settings.sft_hard_tool, settings.sft_hard_error_fix, settings.sft_easy_tool)
    examples = build_sft_examples(
        train,
        protocol,
        sandbox_observer(executor),
        mix,
        seed=settings.seed,
        max_observation_tokens=settings.max_observation_tokens,
    )
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
    # Per phase: sampled / trained tokens and seconds of the backend, sandbox execution seconds.
    throughput: dict[str, dict[str, float]] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)  # see ``machine_facts``


# -- shared components -----------------------------------------------------------------------------


def demo_config(settings: DemoSettings, model_dir: str | Path, run_dir: str | Path) -> Any:
    """The ``retool.config.Config`` the demo's RL and evaluation run under."""
    from retool.config import Config

    return Config.model_validate(
        {
            "model": {
                "name": str(model_dir),
                "tool_format": "auto",
                "max_context": settings.max_context,
                "system_prompt": settings.system_prompt,
            },
            "backend": {
                "kind": "local",
                "device": "cpu",
                "dtype": "float32",
                "micro_batch_tokens": settings.micro_batch_tokens,
                "sample_batch_size": settings.sample_batch_size,
            },
            "lora": _lora_section(settings),
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
                "max_observation_tokens": settings.max_observation_tokens,
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
            "checkpoint": {"every": settings.checkpoint_every, "keep_last": 1},
            "train": {"steps": settings.rl_steps, "seed": settings.seed, "run_dir": str(run_dir)},
        }
    )


def _lora_section(settings: DemoSettings) -> dict[str, Any]:
    if settings.lora_rank <= 0:
        return {"enabled": False}
    # The attention projections: the same names in Qwen2 and Llama (SmolLM2), so one default serves both.
    return {
        "enabled": True,
        "rank": settings.lora_rank,
        "alpha": settings.lora_alpha or 2 * settings.lora_rank,
        "dropout": 0.0,  # dropout > 0 would make the on-policy ratio differ from 1
    }


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
    model_dir: str | Path,
    seed: int,
    checkpoint_dir: str | Path,
    micro_batch_tokens: int = 1024,
    *,
    lora: dict[str, Any] | None = None,
    max_context: int = 1024,
    sample_batch_size: int = 64,
) -> Any:
    """A local CPU client: full fine-tuning (the tiny model has no use for LoRA), or LoRA (``lora``: a
    ``retool.config.LoraConfig``-shaped dict) for a real model. ``model_dir`` may be a GGUF file."""
    from retool.backends.local import LocalTrainingClient

    return LocalTrainingClient(
        str(model_dir),
        lora=lora if lora and lora.get("enabled", True) else None,
        device="cpu",
        dtype="float32",
        seed=seed,
        micro_batch_tokens=micro_batch_tokens,
        sample_batch_size=sample_batch_size,
        checkpoint_dir=checkpoint_dir,
        max_context=max_context,
    )


def client_for(settings: DemoSettings, model: str | Path, checkpoint_dir: Path, train: bool = True) -> Any:
    """``make_client`` with the demo's settings; ``train=False`` (evaluation only) loads no adapter."""
    return make_client(
        model,
        settings.seed,
        checkpoint_dir,
        settings.micro_batch_tokens,
        lora=_lora_section(settings) if train else None,
        max_context=settings.max_context,
        sample_batch_size=settings.sample_batch_size,
    )


def save_hf(client: Any, folder: Path) -> Path:
    """Write the client's current weights + tokenizer as a plain HF folder (usable as ``--model``).

    A LoRA client is saved merged, from its sampling view (``LocalTrainingClient.sampling_model``), so the
    live adapter keeps training. A model read from a GGUF file is saved dequantised (``backend.dtype``).
    """
    folder.mkdir(parents=True, exist_ok=True)
    model = client.sampling_model() if hasattr(client, "sampling_model") else client.model
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
    modes: Sequence[str] | None = None,
    emit: Event | None = None,
) -> dict[str, dict[str, Any]]:
    """Run ``retool.evaluate.run_eval`` for each mode (default ``settings.eval_modes``); return {mode:
    summary + per-difficulty stats}. An eval whose JSONL exists continues where it stopped. ``emit``
    receives ``eval_progress`` events (one per finished problem)."""
    from retool.evaluate.runner import EvalComponents, run_eval
    from retool.tasks.model import protocol_for

    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for mode in modes or settings.eval_modes:
        use_tools = mode == "retool"
        output = out_dir / f"{label}_{mode}.jsonl"

        async def go(mode: str = mode, use_tools: bool = use_tools, output: Path = output) -> dict[str, Any]:
            sampler = await client.sampling_client_async()
            comps = EvalComponents(
                sampler=sampler,
                protocol=protocol_for(client.tokenizer, use_tools, settings.system_prompt),
                verifier=verifier,
                executor=executor if use_tools else None,
            )

            def progress(done: int, total: int, mode: str = mode) -> None:
                if emit is not None:
                    emit("eval_progress", {"model": label, "mode": mode, "done": done, "total": total})

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
                on_progress=progress,
            )

        summary = asyncio.run(go())
        # run_eval's summary nests the metrics; keep them flat next to the per-difficulty numbers.
        flat = dict(summary.get("metrics", summary))
        flat.update(difficulty_breakdown(output))
        results[mode] = flat
    return results


def difficulty_breakdown(records_path: Path) -> dict[str, Any]:
    """Accuracy / tool-call rate / format rate on easy vs hard synthetic problems and on GSM8K, from an
    eval's JSONL."""
    from retool.tasks.real_model import GSM8K_SOURCE

    buckets: dict[str, list[dict[str, Any]]] = {"easy": [], "hard": [], "gsm8k": []}
    with records_path.open(encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            rec = json.loads(line)
            source = str(rec.get("data_source", ""))
            parsed = parse_source(source)
            if parsed is not None:
                buckets["hard" if parsed[1] else "easy"].extend(rec.get("candidates", []))
            elif source == GSM8K_SOURCE:
                buckets["gsm8k"].extend(rec.get("candidates", []))
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
# Shown when the held-out set has GSM8K problems (real models): accuracy and valid-call rate there, and
# the share of all samples with at least one well-formed call.
GSM8K_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("tool_call_rate", "Valid call", "pct"),
    ("gsm8k_accuracy", "Acc GSM8K", "pct"),
    ("gsm8k_tool_call_rate", "Call GSM8K", "pct"),
)


def _columns(rows: Sequence[dict[str, Any]]) -> tuple[tuple[str, str, str], ...]:
    with_gsm8k = any(row.get("gsm8k_candidates") for row in rows)
    base = TABLE_COLUMNS
    if with_gsm8k and not any(row.get("easy_candidates") for row in rows):
        base = tuple(c for c in TABLE_COLUMNS if not c[0].startswith("easy_"))  # nothing easy held out
    return base + GSM8K_COLUMNS if with_gsm8k else base


def table_rows(evals: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    keys = [key for key, _, _ in TABLE_COLUMNS + GSM8K_COLUMNS] + ["easy_candidates", "gsm8k_candidates"]
    for stage, by_mode in evals.items():
        for mode, summary in by_mode.items():
            row = {"model": stage, "mode": mode, "problems": summary.get("problems")}
            row.update({key: summary.get(key) for key in keys})
            rows.append(row)
    return rows


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    columns = _columns(rows)
    header = ["model", "mode"] + [title for _, title, _ in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [str(row["model"]), str(row["mode"])]
        for key, _, kind in columns:
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
    "model",
    "lora_rank",
    "lora_alpha",
    "system_prompt",
    "test_hard_fraction",
    "gsm8k_problems",
)
# Settings a resumed run may change: where it runs and how it reports, not what it computes.
_RESUME_FREE = ("out", "resume", "plots", "threads", "data_dir")
PHASES_FILE = "phases.json"


class _Phases:
    """The finished phases of a run folder (``phases.json``) with their seconds and throughput: a resumed
    run skips them and still reports the whole time split."""

    def __init__(self, out: Path) -> None:
        self.path = out / PHASES_FILE
        self.data: dict[str, dict[str, Any]] = (
            json.loads(self.path.read_text(encoding="utf-8")) if self.path.is_file() else {}
        )

    def done(self, name: str) -> bool:
        return name in self.data

    def record(self, name: str, entry: dict[str, Any]) -> None:
        from retool.train.checkpoint import write_text_atomic

        self.data[name] = entry
        write_text_atomic(self.path, json.dumps(self.data, indent=2) + "\n")


class _Clock:
    """Phase timings of one demo run, reported through ``emit`` as each phase ends and kept in
    ``phases.json``; ``measure`` adds the backend's sampling / training counters and the sandbox's
    execution time of the phase (``throughput`` in the report)."""

    def __init__(self, result: DemoResult, emit: Event, phases: _Phases | None = None) -> None:
        self.result, self.emit = result, emit
        self.phases = phases
        self.t0 = time.perf_counter()
        self._marks: dict[str, Any] = {}

    def start(self, client: Any = None, executor: Any = None) -> None:
        self.t0 = time.perf_counter()
        self.measure(client, executor)

    def measure(self, client: Any = None, executor: Any = None) -> None:
        """Start counting a client's / executor's work from now (called when a phase gets its client)."""
        self._marks = {"client": client, "executor": executor, "before": _work(client, executor)}

    def done(self, name: str) -> None:
        seconds = round(time.perf_counter() - self.t0, 1)
        self.result.timings[name] = seconds
        entry: dict[str, Any] = {"seconds": seconds}
        if self._marks.get("client") is not None or self._marks.get("executor") is not None:
            after = _work(self._marks["client"], self._marks["executor"])
            entry["work"] = {k: round(after[k] - self._marks["before"].get(k, 0.0), 3) for k in after}
            self.result.throughput[name] = entry["work"]
        if self.phases is not None:
            self.phases.record(name, entry)
        self.emit("phase_done", {"phase": name, "seconds": seconds})
        self.t0 = time.perf_counter()
        self._marks = {}

    def skip(self, name: str) -> bool:
        """True (and the recorded timing restored) when a resumed run finished ``name`` already."""
        if self.phases is None or not self.phases.done(name):
            return False
        entry = self.phases.data[name]
        self.result.timings[name] = float(entry["seconds"])
        if "work" in entry:
            self.result.throughput[name] = dict(entry["work"])
        self.emit("phase_done", {"phase": name, "seconds": entry["seconds"], "resumed": True})
        self.t0 = time.perf_counter()
        return True


def _work(client: Any, executor: Any) -> dict[str, float]:
    """Cumulative work counters: the local backend's ``stats`` and the sandbox's execution seconds."""
    out: dict[str, float] = {}
    stats = getattr(client, "stats", None)
    if stats is not None and hasattr(stats, "as_dict"):
        for key in (
            "sample_seconds",
            "prefill_seconds",
            "sampled_tokens",
            "sampled_sequences",
            "prefill_tokens",
            "train_seconds",
            "trained_tokens",
            "trained_padded_tokens",
        ):
            out[key] = float(getattr(stats, key))
    exec_stats = getattr(executor, "stats", None)
    if exec_stats is not None:
        out["exec_calls"] = float(getattr(exec_stats, "calls", 0))
        out["exec_seconds"] = float(getattr(exec_stats, "total_latency", 0.0))
    return out


def _open_run_folder(settings: DemoSettings, out: Path) -> None:
    """A new run folder, or (``resume``) the same run's folder: refuse anything else."""
    saved = out / "settings.json"
    if settings.resume:
        if not saved.is_file():
            raise FileNotFoundError(f"--resume {out}: no demo run there (no settings.json)")
        earlier = json.loads(saved.read_text(encoding="utf-8"))
        mine = settings.as_dict()
        differ = [k for k in mine if k not in _RESUME_FREE and earlier.get(k) != mine[k]]
        if differ:
            raise ValueError(
                f"--resume {out}: the run was started with other settings ({', '.join(differ)}); "
                "resume with the same options"
            )
        return
    if (out / "report.json").exists() or (out / "rl").exists() or (out / PHASES_FILE).exists():
        raise FileExistsError(
            f"{out} already holds a demo run; continue it with --resume, or choose another --out"
        )
    out.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(settings.as_dict(), indent=2) + "\n")


def run_demo(settings: DemoSettings, on_event: Event | None = None) -> DemoResult:
    """Model, (zero-shot eval), SFT, evaluate, RL, evaluate; write everything under ``settings.out``.

    RL starts from the saved SFT model with a fresh optimizer, exactly as ``retool train --set
    model.name=OUT/model_sft`` would, so ``reuse_sft`` runs and the full pipeline take the same path.
    With ``resume``, finished phases (``phases.json``) are skipped, RL continues from its last checkpoint
    and an interrupted evaluation from its JSONL.
    """
    import torch

    from retool.reward import Verifier

    emit = on_event or (lambda kind, data: None)
    out = Path(settings.out)
    _open_run_folder(settings, out)
    torch.set_num_threads(max(1, settings.threads))
    torch.manual_seed(settings.seed)
    result = DemoResult(out=out)
    phases = _Phases(out)
    clock = _Clock(result, emit, phases)
    t_all = time.perf_counter()
    elapsed_before = sum(float(e["seconds"]) for e in phases.data.values())

    train, test = demo_tasks(settings)
    write_tasks(out / "tasks" / "train.jsonl", train)
    write_tasks(out / "tasks" / "test.jsonl", test)
    problems = held_out_problems(settings, test)
    clock.done("tasks")

    executor = make_executor(settings)
    verifier = Verifier(workers=1, timeout=5.0)
    try:
        if settings.reuse_sft:
            model_sft, evals = _reuse_sft(settings, out, result)
            clock.done("reuse_sft")
        else:
            model_sft, evals = _sft_phase(settings, out, train, problems, executor, verifier, clock)
        evals["rl"] = _rl_phase(settings, out, model_sft, train, problems, executor, verifier, clock)
    finally:
        executor.close()
        verifier.close()

    result.table = table_rows(evals)
    result.gain = demo_gain(out / "eval")
    result.timings["total"] = round(time.perf_counter() - t_all + elapsed_before, 1)
    result.timings["rl_share"] = round(result.timings["rl"] / max(result.timings["total"], 1e-9), 3)
    result.machine = machine_facts()
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


def _load_evals(out: Path, label: str, modes: Sequence[str]) -> dict[str, dict[str, Any]]:
    return {mode: _flat_summary(out / "eval" / f"{label}_{mode}.jsonl") for mode in modes}


def _init_model(settings: DemoSettings, out: Path, train: Sequence[Task], clock: _Clock) -> Path:
    """The model SFT starts from: the tiny model built from the task text, or a real model's file."""
    emit = clock.emit
    if settings.model != "tiny":
        from retool.tasks.real_model import resolve_model_path

        path = resolve_model_path(settings.model)
        # The phase ends once the client has loaded it (GGUF dequantisation is the work): see _sft_phase.
        emit("phase", {"phase": "model", "detail": f"loading {settings.model}: {path}"})
        return path
    folder = out / "model_init"
    if clock.skip("model") and (folder / "config.json").is_file():
        return folder
    from retool.tasks.model import build_demo_model

    emit("phase", {"phase": "model", "detail": f"building the tiny model ({settings.size})"})
    model_init = build_demo_model(folder, train, size=settings.size, seed=settings.seed)  # type: ignore[arg-type]
    clock.done("model")
    return model_init


def _sft_phase(
    settings: DemoSettings,
    out: Path,
    train: Sequence[Task],
    problems: Sequence[Any],
    executor: Any,
    verifier: Any,
    clock: _Clock,
) -> tuple[Path, dict[str, dict[str, dict[str, Any]]]]:
    """Initial model, zero-shot eval (if asked), cold-start SFT, SFT evaluation; returns the SFT model
    folder and the evaluations. Each part a resumed run finished already is skipped."""
    emit = clock.emit
    model_sft = out / "model_sft"
    evals: dict[str, dict[str, dict[str, Any]]] = {}
    n_base = min(settings.base_eval_problems, len(problems))
    # Every k-th held-out problem, so the zero-shot subset mixes the sources (synthetic, GSM8K) as the set does.
    base_problems = list(problems)[:: max(1, len(problems) // n_base)][:n_base] if n_base else []
    client = None
    try:
        if clock.skip("sft") and (model_sft / "config.json").is_file():
            if n_base and clock.skip("eval_base"):
                evals["base"] = _load_evals(out, "base", ["retool"])
            clock.result.sft = json.loads((out / "sft_report.json").read_text())
        else:
            model_init = _init_model(settings, out, train, clock)
            client = client_for(settings, model_init, out / "checkpoints")
            if settings.model != "tiny":
                clock.done("model")
            config = demo_config(settings, model_init, out / "rl")
            if n_base:
                if clock.skip("eval_base"):
                    evals["base"] = _load_evals(out, "base", ["retool"])
                else:
                    emit("phase", {"phase": "eval_base", "detail": f"zero-shot, {n_base} held-out problems"})
                    clock.measure(client, executor)
                    evals["base"] = evaluate_modes(
                        client,
                        base_problems,
                        settings,
                        config,
                        out / "eval",
                        "base",
                        executor,
                        verifier,
                        modes=["retool"],
                        emit=emit,
                    )
                    emit("eval", {"model": "base", "summaries": evals["base"]})
                    clock.done("eval_base")
            emit("phase", {"phase": "sft", "detail": _trainable(client)})
            clock.measure(client, executor)
            report = cold_start_sft(client, train, executor, settings, emit)
            save_hf(client, model_sft)
            clock.result.sft = report.as_dict()
            (out / "sft_report.json").write_text(json.dumps(clock.result.sft, indent=2) + "\n")
            clock.done("sft")

        if clock.skip("eval_sft"):
            evals["sft"] = _load_evals(out, "sft", settings.eval_modes)
        else:
            emit(
                "phase",
                {"phase": "eval_sft", "detail": f"{len(problems)} held-out problems x {settings.val_n}"},
            )
            if client is None:  # resumed after SFT: evaluation needs no adapter
                client = client_for(settings, model_sft, out / "checkpoints", train=False)
            clock.measure(client, executor)
            config = demo_config(settings, model_sft, out / "rl")
            evals["sft"] = evaluate_modes(
                client, problems, settings, config, out / "eval", "sft", executor, verifier, emit=emit
            )
            emit("eval", {"model": "sft", "summaries": evals["sft"]})
            clock.done("eval_sft")
    finally:
        if client is not None:
            client.close()
    return model_sft, evals


def _trainable(client: Any) -> str:
    lora = getattr(client, "lora", None)
    kind = f"LoRA r={lora.rank} on {', '.join(lora.target_modules)}" if lora else "full fine-tuning"
    return f"{client.num_trainable_parameters():,} trainable parameters ({kind})"


def _rl_phase(
    settings: DemoSettings,
    out: Path,
    model_sft: Path,
    train: Sequence[Task],
    problems: Sequence[Any],
    executor: Any,
    verifier: Any,
    clock: _Clock,
) -> dict[str, dict[str, Any]]:
    """RL from the SFT model (resuming from its checkpoints), then its evaluation; returns the latter."""
    emit = clock.emit
    model_rl = out / "model_rl"
    config = demo_config(settings, model_sft, out / "rl")
    client = None
    try:
        if not (clock.skip("rl") and (model_rl / "config.json").is_file()):
            resume = (out / "rl" / "config.toml").is_file()
            emit("phase", {"phase": "rl", "detail": _rl_detail(settings) + (", resumed" if resume else "")})
            client = client_for(settings, model_sft, out / "checkpoints")
            clock.measure(client, executor)
            _reinforce(client, config, settings, train, executor, verifier, emit, resume=resume)
            save_hf(client, model_rl)
            clock.done("rl")
        if clock.skip("eval_rl"):
            return _load_evals(out, "rl", settings.eval_modes)
        emit("phase", {"phase": "eval_rl", "detail": "same problems, settings and verifier"})
        if client is None:
            client = client_for(settings, model_rl, out / "checkpoints", train=False)
        clock.measure(client, executor)
        evals = evaluate_modes(
            client, problems, settings, config, out / "eval", "rl", executor, verifier, emit=emit
        )
        emit("eval", {"model": "rl", "summaries": evals})
        clock.done("eval_rl")
        return evals
    finally:
        if client is not None:
            client.close()


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
    resume: bool = False,
    reward_fn: Callable[[Any], float] | None = None,
) -> None:
    from retool.tasks.model import protocol_for
    from retool.train.datasource import list_source
    from retool.train.loop import Trainer

    trainer = Trainer(
        config,
        Path(config.train.run_dir),
        resume=resume,
        reward_fn=reward_fn,  # None: the verifier's reward (tests pass a fixed one)
        client=client,
        source=list_source([t.to_problem() for t in train]),
        executor=_KeepOpen(executor),
        verifier=_KeepOpen(verifier),
        protocol=protocol_for(client.tokenizer, True, settings.system_prompt),
        text_protocol=protocol_for(client.tokenizer, False, settings.system_prompt),
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
        "throughput": result.throughput,
        "machine": result.machine,
        "sft": result.sft,
        "evals": evals,
    }
    (out / "report.json").write_text(json.dumps(report_json, indent=2, default=str) + "\n")
    parts = [markdown_table(result.table), gain_line(result.gain)]
    if result.throughput:
        parts.append(time_split_markdown(result.timings, result.throughput))
    (out / "report.md").write_text("\n\n".join(parts) + "\n")


def time_split_markdown(timings: dict[str, float], throughput: dict[str, dict[str, float]]) -> str:
    """Per phase: wall seconds, and the backend's sampling / training seconds, tokens and tokens/s, and
    the sandbox's execution seconds (the sandbox runs beside sampling, so the parts may overlap)."""
    lines = [
        "| phase | wall s | sampling s | sampled tok | tok/s | training s | trained tok | tok/s | exec s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    total: dict[str, float] = {}
    for phase, seconds in timings.items():
        if phase in ("total", "rl_share"):
            continue
        w = throughput.get(phase, {})
        for k, v in w.items():
            total[k] = total.get(k, 0.0) + v
        lines.append(_split_row(phase, seconds, w))
    lines.append(_split_row("**total**", timings.get("total", 0.0), total))
    return "\n".join(lines)


def _split_row(name: str, seconds: float, w: dict[str, float]) -> str:
    def rate(tokens: str, secs: str) -> str:
        return f"{w[tokens] / w[secs]:.1f}" if w.get(secs) else "-"

    def num(key: str, fmt: str = "{:.0f}") -> str:
        return fmt.format(w[key]) if w.get(key) else "-"

    return (
        f"| {name} | {seconds:.0f} | {num('sample_seconds')} | {num('sampled_tokens')} | "
        f"{rate('sampled_tokens', 'sample_seconds')} | {num('train_seconds')} | {num('trained_tokens')} | "
        f"{rate('trained_tokens', 'train_seconds')} | {num('exec_seconds', '{:.1f}')} |"
    )


def machine_facts() -> dict[str, Any]:
    """What the run's numbers depend on: CPUs, memory, torch, peak memory of this process and its
    children (sandbox, verifier), and the load average when the report was written."""
    import platform
    import resource

    import torch

    facts: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        # ru_maxrss is in KiB on Linux
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "children_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2),
    }
    try:
        facts["load_average"] = [round(x, 2) for x in os.getloadavg()]
        with open("/proc/meminfo", encoding="ascii") as fh:
            facts["memory_gib"] = round(int(fh.readline().split()[1]) / 2**20, 1)
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            names = [ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")]
        if names:
            facts["cpu"] = names[0]
    except OSError:
        pass
    return facts


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
