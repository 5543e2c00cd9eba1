"""retool.env: the environments and the problem sources -- how one trajectory interacts, where problems come from.

- ``types``: the interaction seam, ``Env`` (``initial_observation()``, ``step(action) -> StepResult``,
  ``interrupt``, ``outcome``), ``EnvGroupBuilder`` (a problem's group, optional group rewards),
  ``Observation``, ``StepResult``, ``Outcome`` (why it stopped, how it was scored), ``AssistantTurn``,
  ``STOP_REASONS``.
- ``scoring``: ``Attempt``, ``Score``, ``score_final_answer`` (the chapter's reward), ``VerifierLike``,
  ``ScoreRule`` (a source's rule: attempt and verifier to score), ``Scorer`` (an environment's: attempt to score).
- ``source``: ``ProblemSource`` (the dataset role: ``problems(split)``, ``epoch(seed, epoch)``,
  ``score(attempt, verifier)``, ``group_builders(problems, setup, group_size)`` (a batch's groups, the
  shape of tinker-cookbook's ``RLDataset.get_batch``) over ``group_builder``), ``EnvSetup`` (what one
  mode's environments share; it makes their groups), ``ProblemList`` (a fixed list), ``SourceError``.
  It imports no environment kind.
- ``retool``: the ReTool environments: ``ToolSetup`` (protocol, tool or None for text-only, verifier,
  ``Budgets``; an ``EnvSetup``), ``ReToolEnv`` (parse -> execute -> observe -> budgets -> score),
  ``ReToolGroupBuilder``, ``ReToolOutcome`` (the outcome with the tool's calls; ``retool_outcome``), the
  ``Tool`` shape.
- ``files``: ``FileSource`` (a JSONL / JSON / parquet file or Hub id), the named evaluation sets, ``DapoSource``.
- ``gsm8k``: ``Gsm8kSource`` (GSM8K train for training, test for evaluation, the leak check).
- ``synthetic``: ``TaskFamilySource`` (the synthetic task family, source ``synthetic``) and its options.
- ``registry``: ``make_source(name_or_path, options)``, ``source_from_config(config)``, ``register_source``.

The trainer and the evaluator take a ``ProblemSource``; names are resolved here, never inside them.
"""

from retool.env.files import DapoSource, FileSource
from retool.env.registry import (
    SourceOptions,
    make_source,
    register_source,
    registered_sources,
    source_from_config,
)
from retool.env.retool import (
    Budgets,
    ReToolEnv,
    ReToolGroupBuilder,
    ReToolOutcome,
    Tool,
    ToolSetup,
    retool_outcome,
)
from retool.env.scoring import Attempt, Score, Scorer, ScoreRule, VerifierLike, score_final_answer
from retool.env.source import SPLITS, EnvSetup, ProblemList, ProblemSource, SourceError, Split
from retool.env.synthetic import SyntheticSourceOptions, TaskFamilySource
from retool.env.types import (
    STOP_REASONS,
    AssistantTurn,
    Env,
    EnvGroupBuilder,
    Observation,
    Outcome,
    StepResult,
)

__all__ = [
    "SPLITS",
    "STOP_REASONS",
    "AssistantTurn",
    "Attempt",
    "Budgets",
    "DapoSource",
    "Env",
    "EnvGroupBuilder",
    "EnvSetup",
    "FileSource",
    "Observation",
    "Outcome",
    "ProblemList",
    "ProblemSource",
    "ReToolEnv",
    "ReToolGroupBuilder",
    "ReToolOutcome",
    "Score",
    "ScoreRule",
    "Scorer",
    "SourceError",
    "SourceOptions",
    "Split",
    "StepResult",
    "SyntheticSourceOptions",
    "TaskFamilySource",
    "Tool",
    "ToolSetup",
    "VerifierLike",
    "make_source",
    "register_source",
    "registered_sources",
    "retool_outcome",
    "score_final_answer",
    "source_from_config",
]
