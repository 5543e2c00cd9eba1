"""``retool demo``, ``retool sft`` and ``retool recipes``: the commands that run a recipe by name.

``retool demo --recipe NAME`` runs one recipe (``retool.recipes``) through the pipeline.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Unpack

import typer

from retool.config import ConfigError, flag_overrides, load_config
from retool.errors import UserError
from retool.pipeline.cli import Printer, quiet_library_progress
from retool.pipeline.recipe import Recipe
from retool.pipeline.report import DemoResult, gain_line, markdown_table
from retool.pipeline.settings import DemoFields, DemoSettings, seed_overrides
from retool.pipeline.traces import MODEL_FOLDER, run_trace_sft
from retool.recipes import RECIPES, recipe_named
from retool.recipes.demo import recipe_fields, run_demo, run_sft
from retool.recipes.tiny import RECIPE as TINY_RECIPE
from retool.recipes.tiny import SyntheticOptions

# The flags' defaults, shown in --help, are the tiny recipe's: a flag only overrides the config when given.
_DEMO = load_config("demo-tiny")
_TINY = TINY_RECIPE.options
assert isinstance(_TINY, SyntheticOptions)


def _settings(
    chosen: Recipe,
    config: str,
    overrides: list[str],
    seed: int | None,
    flags: Mapping[str, object],
    **fields: Unpack[DemoFields],
) -> DemoSettings:
    """The demo's settings: ``config`` + ``--set`` + the flags that were given (+ demo-only fields and the
    ``chosen`` recipe's options, whose names ``--set`` may set)."""
    sets = [*overrides, *(seed_overrides(seed) if seed is not None else []), *flag_overrides(flags)]
    try:
        return DemoSettings.load(sets, config=config, **fields)
    except ConfigError as exc:
        raise UserError(f"recipe {chosen.name}: {exc}") from None


_CONFIG_HELP = "Preset or TOML file the settings start from."
_SET_HELP = (
    "Override section.key=value (repeatable): the config, pipeline.NAME=value a demo field (size, "
    "eval_modes, plots, ...), recipe.NAME=value an option of the recipe (its README; a wrong name lists them)."
)


_RECIPE_HELP = "The recipe to run (default: tiny; `retool recipes` lists them)."

_DATA_DIR_HELP = (
    "Folder of the task's data files (default $RETOOL_DATA_DIR, else the user cache: retool data fetch)."
)


def demo_command(
    out: Path | None = typer.Option(
        None, "--out", help="Run folder: every artefact goes here (default: the recipe's, e.g. runs/demo)."
    ),
    recipe: str | None = typer.Option(None, "--recipe", help=_RECIPE_HELP),
    resume: bool = typer.Option(
        False, "--resume", help="Continue the run in --out: skip finished phases, resume RL and evals."
    ),
    gsm8k: int | None = typer.Option(
        None, "--gsm8k", help="GSM8K test problems added to the held-out set (tiny: 0, smollm2: 30)."
    ),
    data_dir: Path | None = typer.Option(None, "--data-dir", help=_DATA_DIR_HELP),
    config: str | None = typer.Option(None, "--config", help=_CONFIG_HELP + " (default: the recipe's)"),
    overrides: list[str] = typer.Option([], "--set", help=_SET_HELP),
    seed: int | None = typer.Option(
        None, help=f"Seed of tasks, model, SFT order, sampling (demo-tiny preset: {_DEMO.train.seed})."
    ),
    rl_steps: int | None = typer.Option(
        None, "--rl-steps", help=f"RL steps (demo-tiny preset: {_DEMO.train.steps})."
    ),
    sft_steps: int | None = typer.Option(
        None, "--sft-steps", help=f"Cold-start SFT steps (demo-tiny preset: {_DEMO.sft.steps})."
    ),
    group_size: int | None = typer.Option(
        None, "--group-size", help=f"(demo-tiny preset: {_DEMO.rollout.group_size})"
    ),
    questions: int | None = typer.Option(
        None,
        "--questions",
        help=f"Questions per RL step (demo-tiny preset: {_DEMO.rollout.questions_per_step}).",
    ),
    val_n: int | None = typer.Option(
        None,
        "--val-n",
        help=f"Samples per held-out problem in evaluation (demo-tiny preset: {_DEMO.eval.val_n}).",
    ),
    test_tasks: int | None = typer.Option(
        None,
        "--test-tasks",
        help=f"Held-out problems (demo-tiny preset: {_DEMO.data.options['test_count']}).",
    ),
    threads: int | None = typer.Option(
        None,
        help=f"torch threads (1 leaves a core to the sandbox) (demo-tiny preset: {_DEMO.backend.cpu_threads}).",
    ),
    dynamic_sampling: bool | None = typer.Option(
        None,
        "--dynamic-sampling/--no-dynamic-sampling",
        help="DAPO: train only on groups whose rewards differ, sampling more questions to refill "
        f"(demo-tiny preset: {'on' if _DEMO.filters.dynamic_sampling else 'off'}).",
    ),
    reuse_sft: Path | None = typer.Option(
        None, "--reuse-sft", help="An earlier demo run: start from its SFT model and SFT evaluation."
    ),
    no_plots: bool = typer.Option(False, "--no-plots"),
) -> None:
    """A recipe's whole pipeline on a local model: (zero-shot eval), SFT, eval, RL, eval; table and plots."""
    quiet_library_progress()
    flags = {
        "train.steps": rl_steps,
        "sft.steps": sft_steps,
        "rollout.group_size": group_size,
        "rollout.questions_per_step": questions,
        "eval.val_n": val_n,
        "data.options.test_count": test_tasks,
        "backend.cpu_threads": threads,
        "filters.dynamic_sampling": dynamic_sampling,
    }
    own: DemoFields = {"reuse_sft": None if reuse_sft is None else str(reuse_sft), "resume": resume}
    chosen = recipe_named(recipe or "tiny")
    own.update(recipe_fields(chosen))
    own.update(_given_demo_fields(out, data_dir, no_plots))
    # --gsm8k N is the synthetic recipes' option gsm8k_problems; a --set of it still wins
    sets = [*([] if gsm8k is None else [f"recipe.gsm8k_problems={gsm8k}"]), *overrides]
    settings = _settings(chosen, config or chosen.preset, sets, seed, flags, **own)
    try:
        result = run_demo(settings, on_event=Printer())
    except (FileExistsError, FileNotFoundError, ValueError) as exc:  # a missing wheel: its install command
        raise UserError(str(exc)) from None
    _print_demo_result(result)


def _given_demo_fields(out: Path | None, data_dir: Path | None, no_plots: bool) -> DemoFields:
    """The demo-only fields whose flags were given (the others keep the preset's or the model's value)."""
    own: DemoFields = {}
    if out is not None:
        own["out"] = str(out)
    if data_dir is not None:
        own["data_dir"] = str(data_dir)
    if no_plots:
        own["plots"] = False
    return own


def _print_demo_result(result: DemoResult) -> None:
    typer.echo(markdown_table(result.table))
    typer.echo("\n" + gain_line(result.gain))
    typer.echo(f"\ntimings (s): {json.dumps(result.timings)}")
    typer.echo(f"run folder: {result.out}  (report.md, report.json, eval/, rl/, analysis/)")
    typer.echo(
        f"trajectory viewer: open {result.out / 'view' / 'index.html'}  (rebuild: retool view {result.out})"
    )


_DATA_HELP = (
    "A JSONL of SFT traces (`retool data coldstart`, or expert iteration's kept.jsonl): train the model "
    "model.name names (or --model) on it instead of the synthetic mix."
)


def sft_command(
    out: Path = typer.Option(Path("runs/sft"), "--out", help="Output folder (model_sft/, sft_report.json)."),
    data: Path | None = typer.Option(None, "--data", help=_DATA_HELP),
    model: str | None = typer.Option(
        None,
        "--model",
        help="HF folder to fine-tune, or 'tiny' to build one (default: tiny; with --data, model.name).",
    ),
    config: str = typer.Option("demo-tiny", "--config", help=_CONFIG_HELP),
    overrides: list[str] = typer.Option([], "--set", help=_SET_HELP),
    steps: int | None = typer.Option(None, help=f"SFT steps (demo-tiny preset: {_DEMO.sft.steps})."),
    batch_size: int | None = typer.Option(
        None, "--batch-size", help=f"(demo-tiny preset: {_DEMO.sft.batch_size})"
    ),
    lr: float | None = typer.Option(
        None, help=f"Peak learning rate (cosine decay) (demo-tiny preset: {_DEMO.sft.lr})."
    ),
    tasks: int | None = typer.Option(
        None, help=f"Synthetic training problems (demo-tiny preset: {_DEMO.data.options['count']})."
    ),
    hard_tool: float | None = typer.Option(
        None,
        "--hard-tool",
        help=f"Share of hard problems solved with a call (demo-tiny preset: {_TINY.hard_tool}).",
    ),
    hard_error_fix: float | None = typer.Option(
        None,
        "--hard-error-fix",
        help=f"Share with a failing call then a fix (demo-tiny preset: {_TINY.hard_error_fix}).",
    ),
    seed: int | None = typer.Option(None, help=f"(demo-tiny preset: {_DEMO.train.seed})"),
    evaluate: bool | None = typer.Option(
        None,
        "--eval/--no-eval",
        help="Report format rate and accuracy after SFT (synthetic mix only; default on).",
    ),
    threads: int | None = typer.Option(
        None, help=f"torch threads (demo-tiny preset: {_DEMO.backend.cpu_threads})."
    ),
) -> None:
    """Cold-start SFT on code-interleaved trajectories: the synthetic task family's, or a trace file's (--data)."""
    flags = {
        "sft.steps": steps,
        "sft.batch_size": batch_size,
        "sft.lr": lr,
        "backend.cpu_threads": threads,
    }
    if data is not None:
        if any(flag is not None for flag in (tasks, hard_tool, hard_error_fix, evaluate)):
            raise UserError(
                "--tasks, --hard-tool, --hard-error-fix and --eval are the synthetic mix's: with --data, "
                f"evaluate the result with `retool eval --model {out / MODEL_FOLDER}`"
            )
        _sft_on_data(data, out, model, config, overrides, seed, flags)
        return
    if model is not None and model != "tiny" and not Path(model).exists():
        raise UserError(f"--model {model}: no such folder")
    flags.update(
        {"data.options.count": tasks, "recipe.hard_tool": hard_tool, "recipe.hard_error_fix": hard_error_fix}
    )
    chosen = _sft_recipe(overrides)
    settings = _settings(chosen, config, overrides, seed, flags, out=str(out), options=chosen.options)
    try:
        # "tiny" here is the demo's own tiny model, built for these tasks into OUT/model_init.
        base = None if model in (None, "tiny") else model
        result = run_sft(settings, base, on_event=Printer(), evaluate=evaluate is not False)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    typer.echo(json.dumps(result, indent=2))


def _sft_on_data(
    data: Path,
    out: Path,
    model: str | None,
    config: str,
    overrides: list[str],
    seed: int | None,
    flags: Mapping[str, object],
) -> None:
    """``retool sft --data``: the config's model (``--model`` sets model.name) on the file's traces."""
    if not data.is_file():
        raise UserError(f"--data {data}: no such file")
    sets = [*overrides, *(seed_overrides(seed) if seed is not None else []), *flag_overrides(flags)]
    sets += [] if model is None else [f"model.name={model}"]
    try:
        settings = load_config(config, sets)
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    try:
        result = run_trace_sft(settings, data, out, on_event=Printer())
    except (ConfigError, ValueError) as exc:
        raise UserError(str(exc)) from None
    typer.echo(json.dumps({k: v for k, v in result.items() if k != "losses"}, indent=2))


def _sft_recipe(overrides: list[str]) -> Recipe:
    """The recipe ``--set pipeline.recipe=NAME`` names (default: ``tiny``): the other ``--set``s may name its
    options, which start from the recipe's (then the ``--config`` file's ``[recipe]`` table's)."""
    recipe_sets = [o for o in overrides if o.partition("=")[0].strip() == "pipeline.recipe"]
    try:
        return recipe_named(DemoSettings().with_overrides(recipe_sets).recipe)
    except (ConfigError, ValueError) as exc:
        raise UserError(str(exc)) from None


def recipes_command() -> None:
    """The recipes ``retool demo --recipe NAME`` runs: name, model, task, preset, what it teaches."""
    rows = [("recipe", "model", "task", "preset", "what it teaches")]
    rows += [(r.name, r.model, r.task, r.preset, r.description) for r in RECIPES.values()]
    for name, model, task, preset, description in rows:
        typer.echo(f"{name:<12} {model:<8} {task:<12} {preset:<25} {description}")
    typer.echo("\nRun one: retool demo --recipe NAME (its README: src/retool/recipes/NAME/README.md)")


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_command)
    app.command("sft")(sft_command)
    app.command("recipes")(recipes_command)
