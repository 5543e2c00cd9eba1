"""The ``tiny`` recipe, the embedded default (``retool demo``): a tiny Qwen2 model built here, whose
tokenizer is trained on the synthetic task family's text, taught to call the interpreter on CPU in minutes.

Owns the synthetic task (also run by ``retool.recipes.smollm2`` with a real model):

- the problem source: the task family (``data.source = 'synthetic'``, ``retool.env.synthetic``);
- the held-out set: the family's test split (drawn with ``test_hard_fraction`` when set, held out against
  the actual train split), plus a seeded GSM8K test slice when ``gsm8k_problems`` > 0 (its options,
  ``SyntheticOptions``);
- the cold start: code-interleaved trajectories of the train tasks with the sandbox's REAL output
  (``styles.py``) in a mix of styles (its options), in one stage or two (``sft.final_share``
  of the steps on the same problems in the ``final_*`` styles);
- its preset, ``demo-tiny.toml`` (the ``demo-tiny`` preset).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from retool.config import Config, ConfigError
from retool.data.gsm8k import gsm8k_problems
from retool.data.synthetic import Task, generate_tasks
from retool.env import ProblemSource, TaskFamilySource, source_from_config
from retool.pipeline.model import task_texts
from retool.pipeline.recipe import ColdStartContext, HeldOut, Recipe, from_preset, sandbox_observer
from retool.pipeline.settings import DemoSettings, RecipeOptions, demo_data_dir, options_as
from retool.recipes.tiny.styles import SFTMix, build_sft_examples
from retool.train.sft import SFTExample, SFTReport, train_sft_as_configured

TASK = "synthetic"


@dataclass(frozen=True)
class SyntheticOptions(RecipeOptions):
    """The synthetic task's own options (``--set recipe.NAME=VALUE``).

    ``test_hard_fraction``: the hard share of the held-out split (None: the train split's);
    ``gsm8k_problems``: GSM8K test problems added to the held-out set (from ``data_dir``);
    the cold start's styles (``SFTMix``): the shares of hard problems solved with a call
    (``hard_tool``) or with a failing call then a fix (``hard_error_fix``), the rest answered directly, and
    of easy problems solved with a call (``easy_tool``); ``final_*``: the same for the last
    ``sft.final_share`` of the SFT steps. The defaults are the tiny recipe's (``demo-tiny.toml``), so
    settings built without the recipe run as it does.
    """

    test_hard_fraction: float | None = None
    gsm8k_problems: int = 0
    hard_tool: float = 0.8
    hard_error_fix: float = 0.1
    easy_tool: float = 0.3
    final_hard_tool: float = 0.1
    final_hard_error_fix: float = 0.05
    final_easy_tool: float = 0.1


@dataclass(frozen=True)
class SyntheticRecipe(Recipe):
    """The synthetic task family with the model and preset of the recipe that names it."""

    task: str = TASK
    options: RecipeOptions = field(default_factory=SyntheticOptions)
    tiny_model: bool = True

    def source(self, settings: DemoSettings, config: Config) -> ProblemSource:
        return task_source(config)

    def held_out(self, settings: DemoSettings, source: ProblemSource) -> HeldOut:
        return held_out_tasks(settings, task_source_of(source))

    def cold_start(self, ctx: ColdStartContext) -> SFTReport:
        options = options_as(ctx.settings, SyntheticOptions)
        return cold_start_sft(ctx, task_source_of(ctx.source).tasks("train"), options)


def task_source(config: Config) -> TaskFamilySource:
    return task_source_of(source_from_config(config))


def task_source_of(source: ProblemSource) -> TaskFamilySource:
    if not isinstance(source, TaskFamilySource):
        raise ConfigError(
            f"the demo trains on the synthetic tasks (data.source = 'synthetic'), not {source.name!r}"
        )
    return source


def held_out_tasks(settings: DemoSettings, source: TaskFamilySource) -> HeldOut:
    """The train tasks, the held-out test tasks and the evaluation set (test tasks, plus the GSM8K slice
    for real models). With ``test_hard_fraction`` the test split is drawn with that hard share and held
    out against the actual train split (``generate_tasks`` holds a split out against a train stream of the
    same share)."""
    options = options_as(settings, SyntheticOptions)
    train = source.tasks("train")
    if options.test_hard_fraction is None:
        test = source.tasks("test")
    else:
        seen = {t.question for t in train if t.hard}
        count = source.counts["test"]
        pool = generate_tasks(
            2 * count + 16,
            seed=source.seed,
            hard_fraction=options.test_hard_fraction,
            kinds=list(source.kinds) or None,
            split="test",
        )
        test = [t for t in pool if t.question not in seen][:count]
    problems = [t.to_problem() for t in test]
    if options.gsm8k_problems > 0:
        problems += gsm8k_problems(options.gsm8k_problems, demo_data_dir(settings), seed=settings.seed)
    return HeldOut(problems, [t.to_problem() for t in train], task_texts(train))


def cold_start_sft(
    ctx: ColdStartContext,
    train: Sequence[Task],
    options: SyntheticOptions,
    observe: Callable[[str], str] | None = None,
) -> SFTReport:
    """Build the code-interleaved SFT trajectories of ``train`` in ``options``' styles and train on them
    (``[sft]``); ``observe`` turns a call's code into what the model is shown (default: its REAL output in
    the sandbox)."""
    parts, config, emit, on_examples = ctx.parts, ctx.config, ctx.emit, ctx.on_examples
    s = config.sft
    if observe is None:
        assert parts.executor is not None, "SFT observations come from the sandbox"
        observe = sandbox_observer(parts.executor)
    mix = SFTMix(options.hard_tool, options.hard_error_fix, options.easy_tool)
    seed = config.train.seed
    examples = build_sft_examples(train, parts.protocol, observe, mix, seed=seed)
    final: list[SFTExample] = []
    if s.final_share > 0:  # the second stage: the same problems, other styles (other seed)
        final_mix = SFTMix(options.final_hard_tool, options.final_hard_error_fix, options.final_easy_tool)
        final = build_sft_examples(train, parts.protocol, observe, final_mix, seed=seed + 7919)
    if on_examples is not None:
        on_examples(len(examples) + len(final))
    return train_sft_as_configured(
        parts.backend,
        examples,
        config,
        on_step=lambda step, loss: emit(
            "sft_step", {"step": step + 1, "steps": s.steps_for(len(examples) + len(final)), "loss": loss}
        ),
        final_examples=final,
    )


RECIPE = SyntheticRecipe(
    name="tiny",
    description="a tiny Qwen2 built here learns to call the interpreter on synthetic arithmetic (CPU, minutes)",
    **from_preset(
        "demo-tiny", SyntheticOptions
    ),  # the config, and its [pipeline] fields and [recipe] options
)
