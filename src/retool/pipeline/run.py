"""The demo pipeline, for any recipe: cold start -> evaluate -> RL -> evaluate -> report, resumable by phase.

Steps (every artefact under one run folder):
1. the recipe's tasks (train / held-out test) -> ``tasks/``
2. the initial model: the tiny model (tokenizer trained on the train tasks' text) or a real model's file
   -> ``model_init/``
3. (zero-shot evaluation of the base model), the recipe's cold-start SFT -> ``model_sft/`` (an ordinary HF
   folder)
4. evaluation of the SFT model, text-only and retool modes -> ``eval/sft_*.jsonl``
5. RL with the real sandbox and verifier through ``retool.train.Trainer`` -> ``rl/`` (+ ``model_rl/``)
6. evaluation again -> ``eval/rl_*.jsonl``; before/after table -> ``report.md`` / ``report.json``;
   plots through ``retool.analyze`` -> ``analysis/``.

``run_pipeline`` takes the recipe (``retool.pipeline.recipe.Recipe``: source, held-out set, cold start,
evaluation checker) and its ``DemoSettings``; it names no task. Each phase builds its parts with
``retool.components.build_components``, exactly as ``retool train`` and ``retool eval`` do. The library
never prints: progress goes through ``on_event`` (the CLI renders it) and ``logging``. ``run_recipe_sft``
is the cold start on its own (``retool sft``). Whether ``--resume`` / ``--reuse-sft`` may use a run folder:
``retool.pipeline.identity``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from retool.components import Components, build_components
from retool.config import Config, ConfigError
from retool.data.problem import Problem
from retool.env import ProblemSource
from retool.evaluate.runner import run_eval
from retool.evaluate.store import EvalSummary, summary_path_for
from retool.jsonl import JsonObject
from retool.pipeline.identity import check_resumable, check_sft_reusable
from retool.pipeline.model import build_demo_model
from retool.pipeline.phases import PHASES_FILE, Clock, Phases
from retool.pipeline.real_model import resolve_model_path
from retool.pipeline.recipe import ColdStartContext, HeldOut, Recipe
from retool.pipeline.report import (
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
from retool.pipeline.settings import DemoSettings, Event, with_data_dir
from retool.sandbox import strict_support
from retool.train.loop import Trainer
from retool.train.sft import SFTReport
from retool.view.site import write_view  # the trajectory viewer (`retool view`), into <out>/view/

if TYPE_CHECKING:
    from retool.backends.local.client import LocalTrainingClient

logger = logging.getLogger(__name__)


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


def local_backend(parts: Components) -> LocalTrainingClient:
    from retool.backends.local.client import LocalTrainingClient  # deferred: torch and transformers (~3 s)

    if not isinstance(parts.backend, LocalTrainingClient):
        raise ConfigError("the demo runs on the local backend (backend.kind = 'local')")
    return parts.backend


def _cold_start(recipe: Recipe, ctx: ColdStartContext) -> SFTReport:
    """The recipe's cold-start SFT, its forwards autocast as ``sft.autocast`` says (the SFT phase only)."""
    from retool.backends.local.client import autocast_dtype  # deferred: torch (~2 s)

    client = local_backend(ctx.parts)
    client.train_autocast = autocast_dtype(ctx.config.sft.autocast, client.device)
    try:
        return recipe.cold_start(ctx)
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
    checker: ProblemSource | None = None,
) -> dict[str, FlatSummary]:
    """``retool.evaluate.run_eval`` for each of ``modes`` (default ``settings.eval_modes``): {mode: flat
    summary + difficulty}. The modes run side by side: their requests share the sampler's decode steps,
    which at a small model's size cost little more for more rows (the demo's two modes: 13.3 -> 8 s). An
    eval whose JSONL exists continues where it stopped; ``emit`` receives ``eval_progress`` events;
    ``checker``: the source whose scorer checks the answers (a recipe's ``eval_source``; None: the
    default verifier)."""
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
                parts.for_mode(mode == "retool"),
                problems,
                config,
                mode,
                output,
                label,
                progress(mode),
                checker,
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
    checker: ProblemSource | None = None,
) -> EvalSummary:
    await view.refresh_sampler()
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
        source=checker,
    )


def write_problems(path: Path, problems: Sequence[Problem]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for p in problems:
            fh.write(json.dumps(p.to_dict()) + "\n")


# -- the pipeline ----------------------------------------------------------------------------------


def _start(recipe: Recipe, settings: DemoSettings, out: Path) -> Config:
    """Claim the run folder (or, ``resume``, check it is this run's), record the settings, set torch's
    threads and seed; the config in force."""
    import torch  # deferred: torch (~2 s); the CLI imports this module for every command

    if settings.config.model.name != "tiny":  # a missing model fails before the folder is claimed
        resolve_model_path(settings.config.model.name)
    elif not recipe.tiny_model:  # its tokenizer is built from the train tasks' text
        raise ValueError(f"the {recipe.name} recipe needs a real model ({recipe.model}), not the tiny one")
    if settings.resume:
        check_resumable(out, settings)  # a run is there, started with these settings
    elif (out / "report.json").exists() or (out / "rl").exists() or (out / PHASES_FILE).exists():
        raise FileExistsError(
            f"{out} already holds a demo run; continue it with --resume, or choose another --out"
        )
    else:
        out.mkdir(parents=True, exist_ok=True)
        (out / "settings.json").write_text(json.dumps(settings.as_dict(), indent=2, default=str) + "\n")
    set_torch_threads(settings.config)
    torch.manual_seed(settings.seed)
    return with_data_dir(settings, with_available_isolation(settings.config))


def set_torch_threads(config: Config) -> None:
    """torch's threads for this process's phases: ``backend.cpu_threads``, or torch's default (every core)
    when it is 0."""
    import torch  # deferred: as in _start

    if config.backend.cpu_threads:
        torch.set_num_threads(config.backend.cpu_threads)


def run_pipeline(recipe: Recipe, settings: DemoSettings, on_event: Event | None = None) -> DemoResult:
    """(Zero-shot eval), the cold start, evaluate, RL, evaluate ``recipe``; write everything under
    ``settings.out``.

    RL starts from the saved SFT model with a fresh optimizer, exactly as ``retool train --set
    model.name=OUT/model_sft`` would, so ``reuse_sft`` runs and the full pipeline take the same path.
    With ``resume``, finished phases (``phases.json``) are skipped, RL continues from its last checkpoint
    and an interrupted evaluation from its JSONL.
    """
    emit = on_event or (lambda kind, data: None)
    settings = recipe.own_options(settings)  # settings.json records the recipe's options by name
    out = Path(settings.out)
    config = _start(recipe, settings, out)
    prestart_training(config)  # for SFT (or, resumed after it, RL)
    result = DemoResult(out=out)
    phases = Phases(out)
    clock = Clock(result, emit, phases)
    t_all = time.perf_counter()
    elapsed_before = sum(float(e["seconds"]) for k, e in phases.data.items() if k != "tasks")

    source = recipe.source(settings, config)
    held = recipe.held_out(settings, source)
    if held.train:
        write_problems(out / "tasks" / "train.jsonl", held.train)
    write_problems(out / "tasks" / "test.jsonl", held.problems)
    clock.done("tasks")

    if settings.reuse_sft:
        model_sft, evals = _reuse_sft(settings, out, result)
        clock.done("reuse_sft")
    else:
        model_sft, evals = _sft_phase(recipe, settings, config, out, source, held, clock)
    evals["rl"] = _rl_phase(recipe, settings, config, source, model_sft, held.problems, clock)

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


def _init_model(settings: DemoSettings, out: Path, held: HeldOut, clock: Clock) -> Path:
    """The model SFT starts from: the tiny model built from the held-out set's tokenizer text, or a real
    model's file (a name from ``retool.pipeline.real_model`` or a path); loading it is part of the ``model``
    phase."""
    name = settings.config.model.name
    emit = clock.emit
    if name != "tiny":
        path = resolve_model_path(name)
        emit("phase", {"phase": "model", "detail": f"loading {name}: {path}"})
        return path
    emit("phase", {"phase": "model", "detail": f"building the tiny model ({settings.size})"})
    return build_demo_model(out / "model_init", held.texts, size=settings.size, seed=settings.seed)


def _sft_phase(
    recipe: Recipe,
    settings: DemoSettings,
    config: Config,
    out: Path,
    source: ProblemSource,
    held: HeldOut,
    clock: Clock,
) -> tuple[Path, Evals]:
    """Initial model, zero-shot eval (if asked), cold-start SFT, SFT evaluation; returns the SFT model
    folder and the evaluations. Each part a resumed run finished already is skipped."""
    emit, problems = clock.emit, held.problems
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
        model_init = _init_model(settings, out, held, clock)
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
                    recipe.eval_source(base_problems),
                )
                emit("eval", {"model": "base", "summaries": evals["base"]})
                clock.done("eval_base")
            emit("phase", {"phase": "sft", "detail": _trainable(client)})
            clock.measure(parts)
            report = _cold_start(recipe, ColdStartContext(parts, settings, sft_config, source, emit))
            prestart_training(config)  # for RL, behind saving and evaluating the SFT model
            save_hf(client, model_sft)
            clock.result.sft = report.as_dict()
            (out / "sft_report.json").write_text(json.dumps(clock.result.sft, indent=2) + "\n")
            clock.done("sft")
            evals["sft"] = _eval_phase(recipe, settings, parts, sft_config, problems, clock, "sft")
        return model_sft, evals
    if clock.skip("eval_sft"):
        evals["sft"] = _load_evals(out, "sft", settings.eval_modes)
    else:  # resumed after SFT: the evaluation needs no adapter
        eval_config = _no_lora(phase_config(config, model_sft, out / "rl"))
        with build_components(eval_config) as parts:
            evals["sft"] = _eval_phase(recipe, settings, parts, eval_config, problems, clock, "sft")
    return model_sft, evals


def _eval_phase(
    recipe: Recipe,
    settings: DemoSettings,
    parts: Components,
    config: Config,
    problems: Sequence[Problem],
    clock: Clock,
    label: str,
) -> dict[str, FlatSummary]:
    emit = clock.emit
    detail = f"{len(problems)} held-out problems x {config.eval.val_n}"
    emit("phase", {"phase": f"eval_{label}", "detail": detail})
    clock.measure(parts)
    checker = recipe.eval_source(problems)
    evals = evaluate_modes(
        parts, problems, settings, config, Path(settings.out) / "eval", label, None, emit, checker
    )
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
    check_sft_reusable(source, settings)  # the same tasks and SFT settings
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
    recipe: Recipe,
    settings: DemoSettings,
    config: Config,
    source: ProblemSource,
    model_sft: Path,
    problems: Sequence[Problem],
    clock: Clock,
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
            return _eval_phase(recipe, settings, parts, eval_config, problems, clock, "rl")
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
        return _eval_phase(recipe, settings, parts, rl_config, problems, clock, "rl")


# -- the cold start on its own (`retool sft`) -----------------------------------------------------------------------


def run_recipe_sft(
    recipe: Recipe,
    settings: DemoSettings,
    model: str | Path | None = None,
    on_event: Event | None = None,
    evaluate: bool = True,
) -> JsonObject:
    """The cold-start SFT of ``recipe`` for ``model`` (default: a freshly built tiny model, for a recipe
    the tiny model runs).

    Writes ``<out>/model_sft`` (HF folder), ``sft_report.json`` and, if ``evaluate``, the retool-mode
    evaluation of the result on the held-out split: protocol-validity (format) rate and accuracy.
    """
    emit = on_event or (lambda kind, data: None)
    settings = recipe.own_options(settings)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    set_torch_threads(settings.config)
    config = with_data_dir(settings, with_available_isolation(settings.config))
    source = recipe.source(settings, config)
    held = recipe.held_out(settings, source)
    if model is None and not recipe.tiny_model:
        raise ValueError(f"the {recipe.name} recipe fine-tunes a real model: give one")
    if model is None:
        emit("phase", {"phase": "model", "detail": f"building the tiny model ({settings.size})"})
        model = build_demo_model(out / "model_init", held.texts, size=settings.size, seed=settings.seed)
    sft_config = phase_config(config, model, out / "rl")
    with build_components(sft_config) as parts:

        def announce(n: int) -> None:
            emit("phase", {"phase": "sft", "detail": f"{n} trajectories, {config.sft.steps_for(n)} steps"})

        ctx = ColdStartContext(parts, settings, sft_config, source, emit, on_examples=announce)
        report = _cold_start(recipe, ctx)
        save_hf(local_backend(parts), out / "model_sft")
        result: JsonObject = {"sft": report.as_dict(), "model": str(out / "model_sft")}
        if evaluate:
            only = dataclasses.replace(settings, eval_modes=("retool",))
            test = held.problems
            checker = recipe.eval_source(test)
            summary = evaluate_modes(parts, test, only, sft_config, out / "eval", "sft", checker=checker)[
                "retool"
            ]
            keys: tuple[str, ...] = ("format_rate", "average_at_n", "pass_at_n", "tool_call_rate")
            keys += ("hard_tool_call_rate", "easy_accuracy", "hard_accuracy", "gsm8k_accuracy")
            result["eval"] = {k: summary[k] for k in keys if k in summary}
    (out / "sft_report.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
