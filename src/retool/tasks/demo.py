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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from retool.backends.tinymodel import ModelSize
from retool.components import Components, build_components
from retool.config import Config, ConfigError, load_config, override_config
from retool.data.problem import Problem
from retool.data.synthetic import Task
from retool.env import ProblemEnv, TaskFamilyEnv, env_from_config
from retool.evaluate.settings import setting_value
from retool.tasks.report import (
    DemoResult,
    Evals,
    demo_gain,
    flat_summary,
    make_plots,
    table_rows,
    write_report,
)

if TYPE_CHECKING:
    from retool.backends.local import LocalTrainingClient
    from retool.sandbox import Executor
    from retool.tasks.sft import SFTReport

logger = logging.getLogger(__name__)

Event = Callable[[str, dict[str, Any]], None]
DEMO_PRESET = "demo"


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
    """

    config: Config = field(default_factory=lambda: load_config(DEMO_PRESET))
    out: str = "runs/demo"
    size: ModelSize = "demo"
    eval_modes: tuple[str, ...] = ("text-only", "retool")
    plots: bool = True
    reuse_sft: str | None = None

    @classmethod
    def load(
        cls, overrides: Sequence[str] = (), *, config: str | Path = DEMO_PRESET, **fields: Any
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

    def as_dict(self) -> dict[str, Any]:
        """What ``settings.json`` / ``report.json`` record: the demo-only fields, the seed, the config."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}
        return {
            **own,
            "eval_modes": list(self.eval_modes),
            "seed": self.seed,
            "config": self.config.model_dump(),
        }


def _demo_field(override: str) -> tuple[str, Any]:
    from retool.config import apply_overrides

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
    from retool.sandbox import strict_support

    if config.sandbox.isolation != "strict":
        return config
    strict, reason = strict_support()
    if strict:
        return config
    logger.warning("sandbox: strict isolation unavailable here (%s); using isolation=none", reason)
    return config.model_copy(update={"sandbox": config.sandbox.model_copy(update={"isolation": "none"})})


def task_env(config: Config) -> TaskFamilyEnv:
    env = env_from_config(config)
    if not isinstance(env, TaskFamilyEnv):
        raise ConfigError(
            f"the demo trains on the synthetic tasks (data.train_path = 'tasks'), not {env.name!r}"
        )
    return env


def local_backend(parts: Components) -> LocalTrainingClient:
    from retool.backends.local import LocalTrainingClient

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
    from retool.tasks.sft import SFTExample, SFTMix, build_sft_examples, train_sft

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
        seed=seed,
        on_step=lambda step, loss: emit("sft_step", {"step": step + 1, "steps": s.steps, "loss": loss}),
    )


def save_hf(client: LocalTrainingClient, folder: Path) -> Path:
    """Write the client's current weights + tokenizer as a plain HF folder (usable as ``--model``)."""
    folder.mkdir(parents=True, exist_ok=True)
    model = client.model
    if hasattr(model, "merge_and_unload"):  # never for full fine-tuning; kept for LoRA clients
        model = model.merge_and_unload()
    model.save_pretrained(folder)
    client.tokenizer.save_pretrained(folder)
    return folder


def evaluate_modes(
    parts: Components,
    problems: Sequence[Problem],
    settings: DemoSettings,
    config: Config,
    out_dir: Path,
    label: str,
) -> dict[str, dict[str, Any]]:
    """``retool.evaluate.run_eval`` for each of ``settings.eval_modes``: {mode: flat summary + difficulty}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for mode in settings.eval_modes:
        output = out_dir / f"{label}_{mode}.jsonl"
        view = parts.for_mode(mode == "retool")
        summary = asyncio.run(_evaluate_mode(view, problems, config, mode, output, label))
        results[mode] = flat_summary(summary, output)
    return results


async def _evaluate_mode(
    view: Components, problems: Sequence[Problem], config: Config, mode: str, output: Path, label: str
) -> dict[str, Any]:
    from retool.evaluate.runner import run_eval

    await view.refresh_sampler()
    return await run_eval(
        list(problems),
        view,
        config=config,
        mode=mode,
        output=output,
        identity={"model": label, "checkpoint": label, "dataset": "tasks-test"},
        concurrency=len(problems),
        bootstrap_resamples=200,
        save_transcripts=True,  # full trajectories for `retool view`
    )


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
    "eval_modes",
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


class _Clock:
    """Phase timings of one demo run, reported through ``emit`` as each phase ends."""

    def __init__(self, result: DemoResult, emit: Event) -> None:
        self.result, self.emit = result, emit
        self.t0 = time.perf_counter()

    def done(self, name: str) -> None:
        self.result.timings[name] = round(time.perf_counter() - self.t0, 1)
        self.emit("phase_done", {"phase": name, "seconds": self.result.timings[name]})
        self.t0 = time.perf_counter()


def _start(settings: DemoSettings, out: Path) -> Config:
    """Claim the run folder, record the settings, set torch's threads and seed; the config in force."""
    import torch

    if (out / "report.json").exists() or (out / "rl").exists():
        raise FileExistsError(f"{out} already holds a demo run; choose another --out or remove it")
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(settings.as_dict(), indent=2) + "\n")
    torch.set_num_threads(max(1, settings.config.backend.cpu_threads))
    torch.manual_seed(settings.seed)
    return with_available_isolation(settings.config)


def run_demo(settings: DemoSettings, on_event: Event | None = None) -> DemoResult:
    """Build, SFT, evaluate, RL, evaluate; write everything under ``settings.out``.

    RL starts from the saved SFT model with a fresh optimizer, exactly as ``retool train --set
    model.name=OUT/model_sft`` would, so ``reuse_sft`` runs and the full pipeline take the same path.
    """
    emit = on_event or (lambda kind, data: None)
    out = Path(settings.out)
    config = _start(settings, out)
    result = DemoResult(out=out)
    clock = _Clock(result, emit)
    t_all = time.perf_counter()

    env = task_env(config)
    train, test = env.tasks("train"), env.tasks("test")
    write_tasks(out / "tasks" / "train.jsonl", train)
    write_tasks(out / "tasks" / "test.jsonl", test)
    clock.done("tasks")
    problems = [t.to_problem() for t in test]

    if settings.reuse_sft:
        model_sft, evals = _reuse_sft(settings, out, result)
        clock.done("reuse_sft")
    else:
        model_sft, evals = _sft_phase(settings, config, out, train, problems, clock)
    evals["rl"] = _rl_phase(settings, config, env, model_sft, problems, clock)

    result.table = table_rows(evals)
    result.gain = demo_gain(out / "eval")
    result.timings["total"] = round(time.perf_counter() - t_all, 1)
    result.timings["rl_share"] = round(result.timings["rl"] / max(result.timings["total"], 1e-9), 3)
    write_report(out, settings.as_dict(), result, evals)
    if settings.plots:
        result.plots = make_plots(out)
    from retool.view.site import write_view  # the trajectory viewer (`retool view`), into <out>/view/

    write_view([out], out / "view")
    return result


def _sft_phase(
    settings: DemoSettings,
    config: Config,
    out: Path,
    train: Sequence[Task],
    problems: Sequence[Problem],
    clock: _Clock,
) -> tuple[Path, Evals]:
    """Tiny model, cold-start SFT, SFT evaluation; returns the SFT model folder and its evaluation."""
    from retool.tasks.model import build_demo_model

    emit = clock.emit
    emit("phase", {"phase": "model", "detail": f"building the tiny model ({settings.size})"})
    model_init = build_demo_model(out / "model_init", train, size=settings.size, seed=settings.seed)
    clock.done("model")

    sft_config = phase_config(config, model_init, out / "rl")
    with build_components(sft_config) as parts:
        client = local_backend(parts)
        emit("phase", {"phase": "sft", "detail": f"{client.num_trainable_parameters():,} parameters"})
        report = cold_start_sft(parts, train, sft_config, emit)
        model_sft = save_hf(client, out / "model_sft")
        clock.result.sft = report.as_dict()
        (out / "sft_report.json").write_text(json.dumps(clock.result.sft, indent=2) + "\n")
        clock.done("sft")

        detail = f"{len(problems)} held-out problems x {config.eval.val_n}"
        emit("phase", {"phase": "eval_sft", "detail": detail})
        evals = {"sft": evaluate_modes(parts, problems, settings, sft_config, out / "eval", "sft")}
        emit("eval", {"model": "sft", "summaries": evals["sft"]})
        clock.done("eval_sft")
    return model_sft, evals


def _reuse_sft(settings: DemoSettings, out: Path, result: DemoResult) -> tuple[Path, Evals]:
    """The SFT model and SFT evaluation of an earlier run with the same tasks and SFT settings."""
    import shutil

    from retool.evaluate.store import summary_path_for

    source = Path(str(settings.reuse_sft))
    try:
        earlier = json.loads((source / "settings.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--reuse-sft {source}: not a finished demo run ({exc})") from None
    mine = settings.as_dict()
    differ = [k for k in _SFT_KEYS if setting_value(earlier, k) != setting_value(mine, k)]
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
    return detail + (", dynamic sampling" if config.filters.dynamic_sampling else "")


def _rl_phase(
    settings: DemoSettings,
    config: Config,
    env: ProblemEnv,
    model_sft: Path,
    problems: Sequence[Problem],
    clock: _Clock,
) -> dict[str, dict[str, Any]]:
    """RL from the SFT model with the real sandbox and verifier, then its evaluation."""
    from retool.train.loop import Trainer

    emit, out = clock.emit, Path(settings.out)
    emit("phase", {"phase": "rl", "detail": _rl_detail(config)})
    rl_config = phase_config(config, model_sft, out / "rl")
    steps = config.train.steps
    with build_components(rl_config) as parts:
        Trainer(
            rl_config,
            out / "rl",
            env=env,
            components=parts,
            on_step=lambda step, metrics: emit("rl_step", {"step": step, "steps": steps, "metrics": metrics}),
        ).run()
        save_hf(local_backend(parts), out / "model_rl")
        clock.done("rl")

        emit("phase", {"phase": "eval_rl", "detail": "same problems, settings and verifier"})
        evals = evaluate_modes(parts, problems, settings, rl_config, out / "eval", "rl")
        emit("eval", {"model": "rl", "summaries": evals})
        clock.done("eval_rl")
    return evals


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

    from retool.tasks.model import build_demo_model

    emit = on_event or (lambda kind, data: None)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, settings.config.backend.cpu_threads))
    config = with_available_isolation(settings.config)
    env = task_env(config)
    train = env.tasks("train")
    if model is None:
        emit("phase", {"phase": "model", "detail": f"building the tiny model ({settings.size})"})
        model = build_demo_model(out / "model_init", train, size=settings.size, seed=settings.seed)
    sft_config = phase_config(config, model, out / "rl")
    with build_components(sft_config) as parts:

        def announce(n: int) -> None:
            emit("phase", {"phase": "sft", "detail": f"{n} trajectories, {config.sft.steps} steps"})

        report = cold_start_sft(parts, train, sft_config, emit, on_examples=announce)
        save_hf(local_backend(parts), out / "model_sft")
        result: dict[str, Any] = {"sft": report.as_dict(), "model": str(out / "model_sft")}
        if evaluate:
            only = dataclasses.replace(settings, eval_modes=("retool",))
            test = env.problems("test")
            summary = evaluate_modes(parts, test, only, sft_config, out / "eval", "sft")["retool"]
            keys = ("format_rate", "average_at_n", "pass_at_n", "hard_tool_call_rate", "easy_accuracy")
            result["eval"] = {k: summary[k] for k in (*keys, "hard_accuracy")}
    (out / "sft_report.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
