"""``retool demo``: the whole pipeline on a tiny local model, on CPU, in minutes; and ``retool sft``.

Steps (every artefact under one run folder):
1. synthetic tasks (train / held-out test, the ``tasks`` environment) -> ``tasks/``
2. tiny model (tokenizer trained on the task text) -> ``model_init/``
3. cold-start SFT on code-interleaved trajectories -> ``model_sft/`` (an ordinary HF folder)
4. evaluation of the SFT model, text-only and retool modes -> ``eval/sft_*.jsonl``
5. RL with the real sandbox and verifier through ``retool.train.Trainer`` -> ``rl/`` (+ ``model_rl/``)
6. evaluation again -> ``eval/rl_*.jsonl``; before/after table -> ``report.md`` / ``report.json``;
   plots through ``retool.analyze`` -> ``analysis/``.

Its settings are a ``Config`` (the ``demo`` preset, plus overrides) and a few demo-only fields
(``DemoSettings``); each phase builds its parts with ``retool.components.build_components``, exactly as
``retool train`` and ``retool eval`` do. The library never prints: progress goes through ``on_event``
(the CLI renders it) and ``logging``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from retool.backends.local.heap import release_free_memory
from retool.backends.local.tinymodel import ModelSize
from retool.components import Components, build_components
from retool.config import Config, ConfigError, apply_overrides, load_config, override_config
from retool.data.gsm8k import gsm8k_problems
from retool.data.mathematics import module_of
from retool.data.problem import Problem
from retool.data.synthetic import Task, generate_tasks
from retool.env import ProblemSource, TaskFamilySource, source_from_config
from retool.env.mathematics import MathematicsList, MathematicsSource
from retool.evaluate.runner import run_eval
from retool.evaluate.settings import setting_value, settings_differences
from retool.evaluate.store import EvalSummary, summary_path_for
from retool.jsonl import JsonObject, JsonValue
from retool.sandbox import Executor, strict_support
from retool.tasks.gsm8k_task import TASK as GSM8K_TASK
from retool.tasks.gsm8k_task import coldstart_examples, gsm8k_source, held_out_problems
from retool.tasks.mathematics_task import TASK as MATHEMATICS_TASK
from retool.tasks.mathematics_task import coldstart_examples as mathematics_coldstart_examples
from retool.tasks.mathematics_task import held_out_problems as mathematics_held_out
from retool.tasks.mathematics_task import mathematics_source
from retool.tasks.model import build_demo_model
from retool.tasks.real_model import DemoFields, real_model, resolve_model_path
from retool.tasks.report import (
    DemoResult,
    Evals,
    FlatSummary,
    demo_gain,
    flat_summary,
    machine_facts,
    make_plots,
    table_rows,
    write_report,
)
from retool.tasks.sft import SFTExample, SFTMix, SFTReport, build_sft_examples, train_sft
from retool.train.checkpoint import write_text_atomic
from retool.train.loop import Trainer
from retool.train.metrics import MetricsRecord
from retool.view.site import write_view  # the trajectory viewer (`retool view`), into <out>/view/

if TYPE_CHECKING:
    from retool.backends.local.client import LocalTrainingClient

logger = logging.getLogger(__name__)


class DemoEvent(TypedDict, total=False):
    """What an ``Event`` carries; which keys depends on its kind (``phase``, ``phase_done``, ``sft_step``,
    ``eval_progress``, ``rl_step``, ``eval``)."""

    phase: str
    detail: str
    seconds: float
    resumed: bool
    step: int
    steps: int
    loss: float
    model: str
    mode: str
    done: int
    total: int
    metrics: MetricsRecord
    summaries: dict[str, FlatSummary]


Event = Callable[[str, DemoEvent], None]
DEMO_PRESET = "demo"
DEMO_TASKS = ("synthetic", GSM8K_TASK, MATHEMATICS_TASK)


def seed_overrides(seed: int) -> list[str]:
    """One seed for everything the demo draws: tasks and their order, model, SFT, sampling, evaluation."""
    return [f"train.seed={seed}", f"data.seed={seed}", f"eval.seed={seed}"]


@dataclass(frozen=True)
class DemoSettings:
    """The demo's settings: a ``Config`` (the ``demo`` preset) plus the knobs only the demo has.

    ``out``: the run folder; ``size``: the tiny model's size (``test`` trains in seconds, for tests);
    ``eval_modes``: the evaluated modes; ``plots``: draw them; ``reuse_sft``: a finished demo run folder
    whose SFT model and SFT evaluation (same tasks and SFT settings) this run starts from, redoing only
    RL and its evaluation, e.g. to compare RL settings on one SFT model.

    Real models (``config.model.name`` a name from ``retool.tasks.real_model`` or a GGUF / HF path; the
    ``demo-smollm2`` preset): ``test_hard_fraction`` (hard share of the held-out split; None: the train
    split's), ``gsm8k_problems`` (GSM8K test problems added to the held-out set, from ``data_dir``),
    ``base_eval_problems`` (zero-shot eval of the model before SFT on every k-th held-out problem, in
    ``base_eval_modes``).
    ``task``: ``synthetic`` (the task family) or ``gsm8k`` (``retool.tasks.gsm8k_task``, real models only:
    cold start from ``coldstart_rows`` annotated GSM8K train solutions, RL on GSM8K's train split (only
    problems solved in at most ``rl_max_solution_steps`` annotated steps, when > 0), the held-out set
    ``gsm8k_problems`` test problems) or ``mathematics`` (``retool.tasks.mathematics_task``, real models only:
    cold start from the model's own verified attempts, ``coldstart_samples`` at ``coldstart_temperature``
    on ``coldstart_rows`` train problems *per module*; RL on the generated train split; held out: the first
    ``mathematics_problems`` questions of every interpolate and extrapolate module). ``eval_temperature``: the evaluations' sampling
    temperature (None: ``[sampling]``'s, as in RL; 0: greedy).
    ``resume``: continue the run in ``out`` (finished phases skipped, RL from its last checkpoint, an
    evaluation from its JSONL); the settings must match its ``settings.json``.
    """

    config: Config = field(default_factory=lambda: load_config(DEMO_PRESET))
    out: str = "runs/demo"
    size: ModelSize = "demo"
    eval_modes: tuple[str, ...] = ("text-only", "retool")
    plots: bool = True
    reuse_sft: str | None = None
    test_hard_fraction: float | None = None
    gsm8k_problems: int = 0
    data_dir: str | None = None
    base_eval_problems: int = 0
    base_eval_modes: tuple[str, ...] = ("retool",)
    task: str = "synthetic"
    coldstart_rows: int = 0
    coldstart_samples: int = 2
    coldstart_temperature: float = 0.7
    mathematics_problems: int = 0
    rl_max_solution_steps: int = 0
    eval_temperature: float | None = None
    resume: bool = False

    @classmethod
    def load(
        cls, overrides: Sequence[str] = (), *, config: str | Path = DEMO_PRESET, **fields: Unpack[DemoFields]
    ) -> DemoSettings:
        """Settings from ``config`` (a preset or TOML file) and ``overrides``: ``section.key=value`` for the
        config, ``field=value`` (no dot) for a demo-only field; ``fields`` set demo-only fields directly."""
        return cls(config=load_config(config), **fields).with_overrides(overrides)

    def with_overrides(self, overrides: Sequence[str]) -> DemoSettings:
        config_sets = [o for o in overrides if "." in o.partition("=")[0]]
        own = {k: v for k, v in (_demo_field(o) for o in overrides if o not in config_sets)}
        return dataclasses.replace(self, config=override_config(self.config, config_sets), **own)

    def with_seed(self, seed: int) -> DemoSettings:
        return self.with_overrides(seed_overrides(seed))

    @property
    def seed(self) -> int:
        return self.config.train.seed

    def as_dict(self) -> JsonObject:
        """What ``settings.json`` / ``report.json`` record: the demo-only fields, the seed, the config."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}
        return {
            **own,
            "eval_modes": list(self.eval_modes),
            "base_eval_modes": list(self.base_eval_modes),
            "seed": self.seed,
            "config": self.config.model_dump(),
        }


def real_model_settings(
    name: str, overrides: Sequence[str] = (), **fields: Unpack[DemoFields]
) -> DemoSettings:
    """``DemoSettings`` of the named real model (``retool.tasks.real_model``): its preset and demo-only
    fields, then ``overrides`` (``section.key=value`` or ``field=value``) and ``fields``."""
    preset, own = real_model(name).task(fields.get("task", "synthetic"))
    merged: DemoFields = {**own, **fields}
    return DemoSettings.load(overrides, config=preset, **merged)


def _demo_field(override: str) -> tuple[str, Any]:  # a field chosen by name: its type is the value's
    name = override.partition("=")[0].strip()
    known = [f.name for f in dataclasses.fields(DemoSettings) if f.name != "config"]
    if name not in known:
        raise ConfigError(
            f"override {override!r}: not section.key=value, nor a demo field ({', '.join(known)})"
        )
    value = apply_overrides({}, [override])[name]
    return name, tuple(value) if isinstance(value, list) else value


# -- shared pieces ---------------------------------------------------------------------------------


def phase_config(config: Config, model: str | Path, run_dir: str | Path) -> Config:
    """``config`` for one phase: the model it starts from, and the folder its backend keeps state in."""
    return config.model_copy(
        update={
            "model": config.model.model_copy(update={"name": str(model)}),
            "train": config.train.model_copy(update={"run_dir": str(run_dir)}),
        }
    )


def with_available_isolation(config: Config) -> Config:
    """Strict sandbox isolation where this machine supports it; otherwise ``none``, said loudly."""
    if config.sandbox.isolation != "strict":
        return config
    strict, reason = strict_support()
    if strict:
        return config
    logger.warning("sandbox: strict isolation unavailable here (%s); using isolation=none", reason)
    return config.model_copy(update={"sandbox": config.sandbox.model_copy(update={"isolation": "none"})})


def demo_source(settings: DemoSettings, config: Config) -> ProblemSource:
    """The problems RL trains on: the synthetic task family, or GSM8K's train split (``task``)."""
    if settings.task == GSM8K_TASK:
        source = gsm8k_source(config, settings.rl_max_solution_steps)
        source.problems("train")  # the leak check, before any model loads
        return source
    if settings.task == MATHEMATICS_TASK:
        maths = mathematics_source(config, settings.data_dir)
        maths.problems("train")  # the leak check, before any model loads
        return maths
    return task_source(config)


def task_source(config: Config) -> TaskFamilySource:
    source = source_from_config(config)
    if not isinstance(source, TaskFamilySource):
        raise ConfigError(
            f"the demo trains on the synthetic tasks (data.train_path = 'tasks'), not {source.name!r}"
        )
    return source


def local_backend(parts: Components) -> LocalTrainingClient:
    from retool.backends.local.client import LocalTrainingClient  # deferred: torch and transformers (~3 s)

    if not isinstance(parts.backend, LocalTrainingClient):
        raise ConfigError("the demo runs on the local backend (backend.kind = 'local')")
    return parts.backend


def sandbox_observer(executor: Executor) -> Callable[[str], str]:
    """SFT observations: the canonical code's REAL output through the sandbox executor.

    Each distinct program runs once: canonical code is deterministic, and the two SFT stages share
    their problems, so most of the second stage's calls would repeat the first's.
    """
    seen: dict[str, str] = {}

    def observe(code: str) -> str:
        if code not in seen:
            seen[code] = executor.format_tool_content(executor.run(code))
        return seen[code]

    return observe


def cold_start_sft(
    parts: Components,
    train: Sequence[Task],
    config: Config,
    emit: Event,
    on_examples: Callable[[int], None] | None = None,
) -> SFTReport:
    """Build the code-interleaved SFT trajectories (real sandbox output) and train on them (``[sft]``)."""
    s = config.sft
    assert parts.executor is not None, "SFT observations come from the sandbox"
    observe = sandbox_observer(parts.executor)
    mix = SFTMix(s.hard_tool, s.hard_error_fix, s.easy_tool)
    seed = config.train.seed
    examples = build_sft_examples(train, parts.protocol, observe, mix, seed=seed)
    final: list[SFTExample] = []
    if s.final_steps:  # the second stage: the same problems, other styles (other seed)
        final_mix = SFTMix(s.final_hard_tool, s.final_hard_error_fix, s.final_easy_tool)
        final = build_sft_examples(train, parts.protocol, observe, final_mix, seed=seed + 7919)
    if on_examples is not None:
        on_examples(len(examples) + len(final))
    return train_sft(
        parts.backend,
        examples,
        final_examples=final,
        final_steps=s.final_steps,
        steps=s.steps,
        batch_size=s.batch_size,
        lr=s.lr,
        optimizer=s.optimizer,
        seed=seed,
        on_step=lambda step, loss: emit("sft_step", {"step": step + 1, "steps": s.steps, "loss": loss}),
    )


def train_on_examples(
    parts: Components, config: Config, examples: Sequence[SFTExample], conversion: JsonObject, emit: Event
) -> SFTReport:
    """Cold-start SFT (``[sft]``) on trajectories a task built, its build report kept as the report's
    ``conversion``."""
    s = config.sft
    report = train_sft(
        parts.backend,
        examples,
        steps=s.steps,
        batch_size=s.batch_size,
        lr=s.lr,
        optimizer=s.optimizer,
        seed=config.train.seed,
        on_step=lambda step, loss: emit("sft_step", {"step": step + 1, "steps": s.steps, "loss": loss}),
    )
    report.conversion = conversion
    return report


def gsm8k_cold_start(parts: Components, settings: DemoSettings, config: Config, emit: Event) -> SFTReport:
    """Cold-start SFT on GSM8K train solutions turned into tool trajectories (``retool.tasks.gsm8k_task``)."""
    out = Path(settings.out)
    examples, conversion = coldstart_examples(parts, config, settings.coldstart_rows, settings.seed, out)
    emit(
        "phase",
        {"phase": "sft", "detail": f"{len(examples)} GSM8K trajectories kept of {conversion['read']} rows"},
    )
    return train_on_examples(parts, config, examples, conversion, emit)


def mathematics_cold_start(
    parts: Components, settings: DemoSettings, config: Config, emit: Event
) -> SFTReport:
    """Cold-start SFT on the model's own verified attempts at DeepMind Mathematics train problems
    (``retool.tasks.mathematics_task``)."""
    emit("phase", {"phase": "sft", "detail": "sampling the model's own attempts under a few-shot prompt"})
    examples, report_data = mathematics_coldstart_examples(
        parts,
        config,
        per_module=settings.coldstart_rows,
        samples=settings.coldstart_samples,
        temperature=settings.coldstart_temperature,
        out=Path(settings.out),
        data_dir=settings.data_dir,
    )
    emit(
        "phase",
        {"phase": "sft", "detail": f"{len(examples)} verified attempts kept of {report_data['sampled']}"},
    )
    return train_on_examples(parts, config, examples, report_data, emit)


def _cold_start(
    settings: DemoSettings,
    parts: Components,
    train: Sequence[Task],
    config: Config,
    emit: Event,
    on_examples: Callable[[int], None] | None = None,
) -> SFTReport:
    """The task's cold-start SFT, its forwards autocast as ``sft.autocast`` says (the SFT phase only)."""
    from retool.backends.local.client import autocast_dtype  # deferred: torch (~2 s)

    client = local_backend(parts)
    client.train_autocast = autocast_dtype(config.sft.autocast, client.device)
    try:
        if settings.task == GSM8K_TASK:
            return gsm8k_cold_start(parts, settings, config, emit)
        if settings.task == MATHEMATICS_TASK:
            return mathematics_cold_start(parts, settings, config, emit)
        return cold_start_sft(parts, train, config, emit, on_examples)
    finally:
        client.train_autocast = None


def save_hf(client: LocalTrainingClient, folder: Path) -> Path:
    """Write the client's current weights + tokenizer as a plain HF folder (usable as ``--model``).

    A LoRA client is saved merged, from its sampling view (``LocalTrainingClient.sampling_model``), so the
    live adapter keeps training (in bf16 compute: the bf16 base plus the adapter, in bf16). Full fine-tuning
    saves the model itself (its fp32 masters in bf16 compute). A model read from a GGUF file is saved
    dequantised.
    """
    folder.mkdir(parents=True, exist_ok=True)
    (client.sampling_model() if client.lora is not None else client.model).save_pretrained(folder)
    client.tokenizer.save_pretrained(folder)
    return folder


def evaluate_modes(
    parts: Components,
    problems: Sequence[Problem],
    settings: DemoSettings,
    config: Config,
    out_dir: Path,
    label: str,
    modes: Sequence[str] | None = None,
    emit: Event | None = None,
) -> dict[str, FlatSummary]:
    """``retool.evaluate.run_eval`` for each of ``modes`` (default ``settings.eval_modes``): {mode: flat
    summary + difficulty}. The modes run side by side: their requests share the sampler's decode steps,
    which at a small model's size cost little more for more rows (the demo's two modes: 13.3 -> 8 s). An
    eval whose JSONL exists continues where it stopped; ``emit`` receives ``eval_progress`` events."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = eval_sampling(config, settings)
    chosen = list(modes or settings.eval_modes)
    outputs = [out_dir / f"{label}_{mode}.jsonl" for mode in chosen]

    def progress(mode: str) -> Callable[[int, int], None]:
        def report(done: int, total: int) -> None:
            if emit is not None:
                emit("eval_progress", {"model": label, "mode": mode, "done": done, "total": total})

        return report

    async def every_mode() -> list[EvalSummary]:
        runs = [
            _evaluate_mode(
                parts.for_mode(mode == "retool"), problems, config, mode, output, label, progress(mode)
            )
            for mode, output in zip(chosen, outputs, strict=True)
        ]
        return list(await asyncio.gather(*runs))

    summaries = asyncio.run(every_mode())
    return {
        mode: flat_summary(summary, output)
        for mode, summary, output in zip(chosen, summaries, outputs, strict=True)
    }


def eval_sampling(config: Config, settings: DemoSettings) -> Config:
    """``config`` with the evaluations' temperature (``settings.eval_temperature``, when set)."""
    if settings.eval_temperature is None:
        return config
    sampling = config.sampling.model_copy(update={"temperature": settings.eval_temperature})
    return config.model_copy(update={"sampling": sampling})


async def _evaluate_mode(
    view: Components,
    problems: Sequence[Problem],
    config: Config,
    mode: str,
    output: Path,
    label: str,
    progress: Callable[[int, int], None] | None = None,
) -> EvalSummary:
    await view.refresh_sampler()
    # DeepMind Mathematics' answers are checked as the benchmark means them, not by math-verify.
    scored = all(module_of(p) for p in problems) and bool(problems)
    return await run_eval(
        list(problems),
        view,
        config=config,
        mode=mode,
        output=output,
        identity={"model": label, "checkpoint": label, "dataset": "held-out"},
        concurrency=len(problems),
        bootstrap_resamples=200,
        save_transcripts=True,  # full trajectories for `retool view`
        on_progress=progress,
        source=MathematicsList(problems, shuffle=False, name="held-out") if scored else None,
    )


def write_problems(path: Path, problems: Sequence[Problem]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for p in problems:
            fh.write(json.dumps(p.to_dict()) + "\n")


def write_tasks(path: Path, tasks: Sequence[Task]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for t in tasks:
            row = {"id": t.id, "question": t.question, "answer": str(t.answer), "data_source": t.data_source}
            fh.write(json.dumps({**row, "kind": t.kind, "hard": t.hard, "code": t.code}) + "\n")


# -- the pipeline ----------------------------------------------------------------------------------


# Settings that fix the tasks and the SFT model: a run reusing another's SFT must agree on all of them.
_SFT_KEYS = (
    "seed",
    "size",
    "task",
    "coldstart_rows",
    "coldstart_samples",
    "coldstart_temperature",
    "mathematics_problems",
    "eval_temperature",
    "eval_modes",
    "test_hard_fraction",
    "gsm8k_problems",
    "config.model.name",
    "config.model.system_prompt",
    "config.lora",
    "config.data.seed",
    "config.data.task_count",
    "config.data.task_test_count",
    "config.data.task_hard_fraction",
    "config.data.task_kinds",
    "config.sft",
    "config.eval.val_n",
    "config.eval.seed",
    "config.backend.micro_batch_tokens",
)
# Of those, the ones that pick the held-out slice and its evaluation (seeded) rather than the SFT model's
# inputs: a run without a slice evaluation may differ in them from the run whose SFT model it reuses.
_SLICE_KEYS = frozenset({"seed", "config.data.seed", "config.eval.seed", "eval_modes"})
# Settings a resumed run may change: where it runs and how it reports, not what it computes.
_RESUME_FREE = frozenset({"out", "resume", "plots", "data_dir"})
PHASES_FILE = "phases.json"


class PhaseEntry(TypedDict, total=False):
    """A finished phase in ``phases.json``: its wall seconds and (when measured) its work counters."""

    seconds: float
    work: dict[str, float]


class _Phases:
    """The finished phases of a run folder (``phases.json``) with their seconds and throughput: a resumed
    run skips them and still reports the whole time split."""

    def __init__(self, out: Path) -> None:
        self.path = out / PHASES_FILE
        self.data: dict[str, PhaseEntry] = (
            json.loads(self.path.read_text(encoding="utf-8")) if self.path.is_file() else {}
        )

    def done(self, name: str) -> bool:
        return name in self.data

    def record(self, name: str, entry: PhaseEntry) -> None:
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
        self._marks: tuple[Components, dict[str, float]] | None = None

    def measure(self, parts: Components | None) -> None:
        """Count the work of ``parts`` (backend, sandbox) from now until the phase ends."""
        before = _work(parts)
        self._marks = (parts, before) if parts is not None else None

    def done(self, name: str) -> None:
        # What a phase freed goes back to the OS before the next one allocates: otherwise the run's peak
        # RSS approaches the sum of its phases' peaks (``retool.backends.heap``).
        release_free_memory()
        seconds = round(time.perf_counter() - self.t0, 1)
        self.result.timings[name] = seconds
        entry: PhaseEntry = {"seconds": seconds}
        if self._marks is not None:
            parts, before = self._marks
            after = _work(parts)
            entry["work"] = {k: round(after[k] - before.get(k, 0.0), 3) for k in after}
            self.result.throughput[name] = entry["work"]
        if self.phases is not None:
            self.phases.record(name, entry)
        self.emit("phase_done", {"phase": name, "seconds": seconds})
        self.t0 = time.perf_counter()
        self._marks = None

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


_WORK_KEYS = (
    "sample_seconds",
    "prefill_seconds",
    "sampled_tokens",
    "sampled_sequences",
    "prefill_tokens",
    "train_seconds",
    "trained_tokens",
    "trained_padded_tokens",
)


def _work(parts: Components | None) -> dict[str, float]:
    """Cumulative work counters: the local backend's ``stats`` and the sandbox's execution seconds."""
    out: dict[str, float] = {}
    if parts is None:
        return out
    stats = getattr(parts.backend, "stats", None)
    if stats is not None:
        out.update({key: float(getattr(stats, key)) for key in _WORK_KEYS})
    exec_stats = getattr(parts.executor, "stats", None)
    if exec_stats is not None:
        out["exec_calls"] = float(exec_stats.calls)
        out["exec_seconds"] = float(exec_stats.total_latency)
    return out


def _start(settings: DemoSettings, out: Path) -> Config:
    """Claim the run folder (or, ``resume``, check it is this run's), record the settings, set torch's
    threads and seed; the config in force."""
    import torch  # deferred: torch (~2 s); the CLI imports this module for every command

    if settings.task not in DEMO_TASKS:
        raise ValueError(f"unknown demo task {settings.task!r}; known: {', '.join(DEMO_TASKS)}")
    if settings.config.model.name != "tiny":  # a missing model fails before the folder is claimed
        resolve_model_path(settings.config.model.name)
    elif settings.task != "synthetic":  # its tokenizer is built from the synthetic tasks' text
        raise ValueError(
            f"the {settings.task} task needs a real model (e.g. --model smollm2), not the tiny one"
        )
    saved = out / "settings.json"
    if settings.resume:
        if not saved.is_file():
            raise FileNotFoundError(f"--resume {out}: no demo run there (no settings.json)")
        earlier = json.loads(saved.read_text(encoding="utf-8"))
        mine = json.loads(json.dumps(settings.as_dict(), default=str))
        differ = settings_differences(earlier, mine, ignore=_RESUME_FREE)
        if differ:
            raise ValueError(
                f"--resume {out}: the run was started with other settings ({', '.join(differ)}); "
                "resume with the same options"
            )
    elif (out / "report.json").exists() or (out / "rl").exists() or (out / PHASES_FILE).exists():
        raise FileExistsError(
            f"{out} already holds a demo run; continue it with --resume, or choose another --out"
        )
    else:
        out.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(settings.as_dict(), indent=2, default=str) + "\n")
    set_torch_threads(settings.config)
    torch.manual_seed(settings.seed)
    return with_data_dir(settings, with_available_isolation(settings.config))


def with_data_dir(settings: DemoSettings, config: Config) -> Config:
    """The demo's ``data_dir`` (``--data-dir``) as the config's ``data.data_dir``, so the GSM8K train split and
    the cold start read the folder the held-out slice is read from."""
    if settings.data_dir is None or config.data.data_dir == settings.data_dir:
        return config
    return config.model_copy(update={"data": config.data.model_copy(update={"data_dir": settings.data_dir})})


def demo_data_dir(settings: DemoSettings) -> str | None:
    """Where the demo reads GSM8K: ``data_dir``, else the config's ``data.data_dir``, else (``None``) the
    data folder (``retool.data.paths``)."""
    return settings.data_dir or settings.config.data.data_dir


def set_torch_threads(config: Config) -> None:
    """torch's threads for this process's phases: ``backend.cpu_threads``, or torch's default (every core)
    when it is 0."""
    import torch  # deferred: as in _start

    if config.backend.cpu_threads:
        torch.set_num_threads(config.backend.cpu_threads)


def held_out(settings: DemoSettings, source: ProblemSource) -> tuple[list[Task], list[Task], list[Problem]]:
    """The train tasks, the held-out test tasks and the evaluation set (test tasks, plus the GSM8K slice
    for real models; the GSM8K task: no tasks, and a seeded slice of GSM8K's test split). With
    ``test_hard_fraction`` the test split is drawn with that hard share and held out against the actual
    train split (``generate_tasks`` holds a split out against a train stream of the same share)."""
    if isinstance(source, MathematicsSource):
        return [], [], mathematics_held_out(settings.mathematics_problems, source.data_dir)
    if not isinstance(source, TaskFamilySource):
        return [], [], held_out_problems(settings.gsm8k_problems, demo_data_dir(settings), settings.seed)
    train = source.tasks("train")
    if settings.test_hard_fraction is None:
        test = source.tasks("test")
    else:
        d = settings.config.data
        seen = {t.question for t in train if t.hard}
        pool = generate_tasks(
            2 * d.task_test_count + 16,
            seed=d.seed,
            hard_fraction=settings.test_hard_fraction,
            kinds=list(d.task_kinds) or None,
            split="test",
        )
        test = [t for t in pool if t.question not in seen][: d.task_test_count]
    problems = [t.to_problem() for t in test]
    if settings.gsm8k_problems > 0:
        problems += gsm8k_problems(settings.gsm8k_problems, demo_data_dir(settings), seed=settings.seed)
    return train, test, problems


def run_demo(settings: DemoSettings, on_event: Event | None = None) -> DemoResult:
    """(Zero-shot eval), SFT, evaluate, RL, evaluate; write everything under ``settings.out``.

    RL starts from the saved SFT model with a fresh optimizer, exactly as ``retool train --set
    model.name=OUT/model_sft`` would, so ``reuse_sft`` runs and the full pipeline take the same path.
    With ``resume``, finished phases (``phases.json``) are skipped, RL continues from its last checkpoint
    and an interrupted evaluation from its JSONL.
    """
    emit = on_event or (lambda kind, data: None)
    out = Path(settings.out)
    config = _start(settings, out)
    prestart_training(config)  # for SFT (or, resumed after it, RL)
    result = DemoResult(out=out)
    phases = _Phases(out)
    clock = _Clock(result, emit, phases)
    t_all = time.perf_counter()
    elapsed_before = sum(float(e["seconds"]) for k, e in phases.data.items() if k != "tasks")

    source = demo_source(settings, config)
    train, test, problems = held_out(settings, source)
    if train:
        write_tasks(out / "tasks" / "train.jsonl", train)
        write_tasks(out / "tasks" / "test.jsonl", test)
    else:
        write_problems(out / "tasks" / "test.jsonl", problems)
    clock.done("tasks")

    if settings.reuse_sft:
        model_sft, evals = _reuse_sft(settings, out, result)
        clock.done("reuse_sft")
    else:
        model_sft, evals = _sft_phase(settings, config, out, train, problems, clock)
    evals["rl"] = _rl_phase(settings, config, source, model_sft, problems, clock)

    result.table = table_rows(evals)
    if all("retool" in evals.get(label, {}) for label in ("sft", "rl")):  # eval_modes = (): no slice eval
        result.gain = demo_gain(out / "eval")
    result.timings["total"] = round(time.perf_counter() - t_all + elapsed_before, 1)
    result.timings["rl_share"] = round(result.timings["rl"] / max(result.timings["total"], 1e-9), 3)
    result.machine = machine_facts()
    write_report(out, settings.as_dict(), result, evals)
    if settings.plots:
        result.plots = make_plots(out)
    write_view([out], out / "view")
    return result


def _load_evals(out: Path, label: str, modes: Sequence[str]) -> dict[str, FlatSummary]:
    evals = {}
    for mode in modes:
        records = out / "eval" / f"{label}_{mode}.jsonl"
        evals[mode] = flat_summary(json.loads(summary_path_for(records).read_text()), records)
    return evals


def _init_model(settings: DemoSettings, out: Path, train: Sequence[Task], clock: _Clock) -> Path:
    """The model SFT starts from: the tiny model built from the task text, or a real model's file (a name
    from ``retool.tasks.real_model`` or a path); loading it is part of the ``model`` phase."""
    name = settings.config.model.name
    emit = clock.emit
    if name != "tiny":
        path = resolve_model_path(name)
        emit("phase", {"phase": "model", "detail": f"loading {name}: {path}"})
        return path
    emit("phase", {"phase": "model", "detail": f"building the tiny model ({settings.size})"})
    return build_demo_model(out / "model_init", train, size=settings.size, seed=settings.seed)


def _sft_phase(
    settings: DemoSettings,
    config: Config,
    out: Path,
    train: Sequence[Task],
    problems: Sequence[Problem],
    clock: _Clock,
) -> tuple[Path, Evals]:
    """Initial model, zero-shot eval (if asked), cold-start SFT, SFT evaluation; returns the SFT model
    folder and the evaluations. Each part a resumed run finished already is skipped."""
    emit = clock.emit
    model_sft = out / "model_sft"
    evals: Evals = {}
    n_base = min(settings.base_eval_problems, len(problems))
    # Every k-th held-out problem, so the zero-shot subset mixes the sources (synthetic, GSM8K) as the set does.
    base_problems = list(problems)[:: max(1, len(problems) // n_base)][:n_base] if n_base else []
    if clock.skip("sft") and (model_sft / "config.json").is_file():
        if n_base and clock.skip("eval_base"):
            evals["base"] = _load_evals(out, "base", settings.base_eval_modes)
        clock.result.sft = json.loads((out / "sft_report.json").read_text())
    else:
        model_init = _init_model(settings, out, train, clock)
        sft_config = phase_config(config, model_init, out / "rl")
        with build_components(sft_config) as parts:
            client = local_backend(parts)
            clock.done("model")
            if n_base and clock.skip("eval_base"):
                evals["base"] = _load_evals(out, "base", settings.base_eval_modes)
            elif n_base:
                emit("phase", {"phase": "eval_base", "detail": f"zero-shot, {n_base} held-out problems"})
                clock.measure(parts)
                evals["base"] = evaluate_modes(
                    parts,
                    base_problems,
                    settings,
                    sft_config,
                    out / "eval",
                    "base",
                    settings.base_eval_modes,
                    emit,
                )
                emit("eval", {"model": "base", "summaries": evals["base"]})
                clock.done("eval_base")
            emit("phase", {"phase": "sft", "detail": _trainable(client)})
            clock.measure(parts)
            report = _cold_start(settings, parts, train, sft_config, emit)
            prestart_training(config)  # for RL, behind saving and evaluating the SFT model
            save_hf(client, model_sft)
            clock.result.sft = report.as_dict()
            (out / "sft_report.json").write_text(json.dumps(clock.result.sft, indent=2) + "\n")
            clock.done("sft")
            evals["sft"] = _eval_phase(settings, parts, sft_config, problems, clock, "sft")
        return model_sft, evals
    if clock.skip("eval_sft"):
        evals["sft"] = _load_evals(out, "sft", settings.eval_modes)
    else:  # resumed after SFT: the evaluation needs no adapter
        eval_config = _no_lora(phase_config(config, model_sft, out / "rl"))
        with build_components(eval_config) as parts:
            evals["sft"] = _eval_phase(settings, parts, eval_config, problems, clock, "sft")
    return model_sft, evals


def _eval_phase(
    settings: DemoSettings,
    parts: Components,
    config: Config,
    problems: Sequence[Problem],
    clock: _Clock,
    label: str,
) -> dict[str, FlatSummary]:
    emit = clock.emit
    detail = f"{len(problems)} held-out problems x {config.eval.val_n}"
    emit("phase", {"phase": f"eval_{label}", "detail": detail})
    clock.measure(parts)
    evals = evaluate_modes(parts, problems, settings, config, Path(settings.out) / "eval", label, emit=emit)
    emit("eval", {"model": label, "summaries": evals})
    clock.done(f"eval_{label}")
    return evals


def _no_lora(config: Config) -> Config:
    """An evaluation's config: no adapter, and one process (it trains nothing)."""
    return config.model_copy(
        update={
            "lora": config.lora.model_copy(update={"enabled": False}),
            "backend": config.backend.model_copy(update={"processes": 1}),
        }
    )


def prestart_training(config: Config) -> None:
    """Start the replica processes of the next training phase's client now (``backend.processes`` > 1):
    their start-up (~4 s: an interpreter, torch, transformers) then overlaps the work before that phase
    instead of delaying it."""
    b = config.backend
    if b.kind != "local":
        return
    # deferred: torch (~2 s)
    from retool.backends.local.data_parallel import prestart_replicas, resolve_processes

    prestart_replicas(resolve_processes(b.processes, b.device) - 1)


def _trainable(client: LocalTrainingClient) -> str:
    lora = client.lora
    kind = f"LoRA r={lora.rank} on {', '.join(lora.target_modules)}" if lora else "full fine-tuning"
    return f"{client.num_trainable_parameters():,} trainable parameters ({kind})"


def _reuse_sft(settings: DemoSettings, out: Path, result: DemoResult) -> tuple[Path, Evals]:
    """The SFT model and SFT evaluation of an earlier run with the same tasks and SFT settings."""
    source = Path(str(settings.reuse_sft))
    try:
        earlier = json.loads((source / "settings.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--reuse-sft {source}: not a finished demo run ({exc})") from None
    mine = settings.as_dict()
    # A run written by an older version lacks the settings added since: it ran with their defaults.
    defaults = DemoSettings().as_dict()

    def before(key: str) -> JsonValue:
        value = setting_value(earlier, key)
        return setting_value(defaults, key) if value is None else value

    # A run that evaluates no held-out slice (eval_modes = ()) copies no evaluation: it may reuse the SFT
    # model of another seed (bench/gsm8k.py: one SFT model, RL of each seed from it).
    keys = _SFT_KEYS if settings.eval_modes else tuple(k for k in _SFT_KEYS if k not in _SLICE_KEYS)
    differ = [k for k in keys if before(k) != setting_value(mine, k)]
    if differ:
        raise ValueError(f"--reuse-sft {source}: its settings differ in {', '.join(differ)}")
    if not (source / "model_sft" / "config.json").is_file():
        raise ValueError(f"--reuse-sft {source}: no model_sft/ folder")
    (out / "eval").mkdir(parents=True, exist_ok=True)
    evals: Evals = {"sft": {}}
    for mode in settings.eval_modes:
        records = source / "eval" / f"sft_{mode}.jsonl"
        for path in (records, summary_path_for(records)):
            if not path.is_file():
                raise ValueError(f"--reuse-sft {source}: missing {path.relative_to(source)}")
            shutil.copy2(path, out / "eval" / path.name)
        copied = out / "eval" / records.name
        evals["sft"][mode] = flat_summary(json.loads(summary_path_for(copied).read_text()), copied)
    if (source / "sft_report.json").is_file():
        result.sft = json.loads((source / "sft_report.json").read_text())
    return source / "model_sft", evals


def _rl_detail(config: Config) -> str:
    r = config.rollout
    detail = f"{config.train.steps} steps x {r.questions_per_step} questions x {r.group_size} samples"
    f = config.filters
    detail += ", dynamic sampling" if f.dynamic_sampling else ""
    return detail + (f", Resample-on-Correct from x{f.roc_oversample:g}" if f.roc else "")


def _rl_phase(
    settings: DemoSettings,
    config: Config,
    source: ProblemSource,
    model_sft: Path,
    problems: Sequence[Problem],
    clock: _Clock,
) -> dict[str, FlatSummary]:
    """RL from the SFT model with the real sandbox and verifier (resuming from its checkpoints), then its
    evaluation."""
    emit, out = clock.emit, Path(settings.out)
    model_rl = out / "model_rl"
    rl_config = phase_config(config, model_sft, out / "rl")
    steps = config.train.steps
    if clock.skip("rl") and (model_rl / "config.json").is_file():
        if clock.skip("eval_rl"):
            return _load_evals(out, "rl", settings.eval_modes)
        eval_config = _no_lora(phase_config(config, model_rl, out / "rl"))
        with build_components(eval_config) as parts:
            return _eval_phase(settings, parts, eval_config, problems, clock, "rl")
    resume = (out / "rl" / "config.toml").is_file()
    emit("phase", {"phase": "rl", "detail": _rl_detail(config) + (", resumed" if resume else "")})
    with build_components(rl_config) as parts:
        clock.measure(parts)
        Trainer(
            rl_config,
            out / "rl",
            resume=resume,
            source=source,
            components=parts,
            on_step=lambda step, metrics: emit("rl_step", {"step": step, "steps": steps, "metrics": metrics}),
        ).run()
        save_hf(local_backend(parts), model_rl)
        clock.done("rl")
        return _eval_phase(settings, parts, rl_config, problems, clock, "rl")


# -- `retool sft` on its own -----------------------------------------------------------------------


def run_sft(
    settings: DemoSettings,
    model: str | Path | None = None,
    on_event: Event | None = None,
    evaluate: bool = True,
) -> JsonObject:
    """Cold-start SFT of ``model`` (default: a freshly built tiny model) on the task family, or (the
    ``gsm8k`` task, a real model) on GSM8K's annotated train solutions.

    Writes ``<out>/model_sft`` (HF folder), ``sft_report.json`` and, if ``evaluate``, the retool-mode
    evaluation of the result on the held-out split: protocol-validity (format) rate and accuracy.
    """
    emit = on_event or (lambda kind, data: None)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    set_torch_threads(settings.config)
    config = with_data_dir(settings, with_available_isolation(settings.config))
    source = demo_source(settings, config)
    train = source.tasks("train") if isinstance(source, TaskFamilySource) else []
    if model is None and settings.task != "synthetic":
        raise ValueError(f"the {settings.task} task fine-tunes a real model: give one")
    if model is None:
        emit("phase", {"phase": "model", "detail": f"building the tiny model ({settings.size})"})
        model = build_demo_model(out / "model_init", train, size=settings.size, seed=settings.seed)
    sft_config = phase_config(config, model, out / "rl")
    with build_components(sft_config) as parts:

        def announce(n: int) -> None:
            emit("phase", {"phase": "sft", "detail": f"{n} trajectories, {config.sft.steps} steps"})

        report = _cold_start(settings, parts, train, sft_config, emit, on_examples=announce)
        save_hf(local_backend(parts), out / "model_sft")
        result: JsonObject = {"sft": report.as_dict(), "model": str(out / "model_sft")}
        if evaluate:
            only = dataclasses.replace(settings, eval_modes=("retool",))
            _, _, test = held_out(settings, source) if not train else ([], [], source.problems("test"))
            summary = evaluate_modes(parts, test, only, sft_config, out / "eval", "sft")["retool"]
            keys: tuple[str, ...] = ("format_rate", "average_at_n", "pass_at_n", "tool_call_rate")
            keys += ("hard_tool_call_rate", "easy_accuracy", "hard_accuracy", "gsm8k_accuracy")
            result["eval"] = {k: summary[k] for k in keys if k in summary}
    (out / "sft_report.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
