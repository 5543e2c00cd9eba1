"""retool.env: the environments -- where the problems come from and how one trajectory interacts.

- ``types``: the interaction seam, ``Env`` (``initial_observation()``, ``step(action) -> StepResult``,
  ``interrupt``, ``outcome``), ``EnvGroupBuilder`` (a problem's group, optional group rewards),
  ``Observation``, ``StepResult``, ``Outcome``, ``AssistantTurn``, ``STOP_REASONS``.
- ``retool``: ``ReToolEnv`` (parse -> execute -> observe -> budgets -> score), ``ReToolGroupBuilder``,
  ``ToolSetup`` (protocol, tool or None for text-only, verifier, budgets), the ``Tool`` shape.
- ``scoring``: ``Attempt``, ``Score``, ``score_final_answer`` (the chapter's reward), ``VerifierLike``.
- ``base``: ``ProblemEnv`` (``problems(split)``, ``epoch(seed, epoch)``, ``score(attempt, verifier)``,
  ``group_builder(problem, setup, group_size)``), ``ProblemListEnv`` (a fixed list), ``EnvError``.
- ``files``: ``FileEnv`` (a JSONL / JSON / parquet file or Hub id), the named evaluation sets, ``DapoEnv``.
- ``gsm8k``: ``Gsm8kEnv`` (GSM8K train for training, test for evaluation, the leak check).
- ``synthetic``: ``TaskFamilyEnv`` (the synthetic task family, ``tasks``).
- ``registry``: ``make_env(name_or_path, options)``, ``env_from_config(config)``, ``register_env``.

The trainer and the evaluator take a ``ProblemEnv``; names are resolved here, never inside them.
"""

from retool.env.base import SPLITS, EnvError, ProblemEnv, ProblemListEnv, Split
from retool.env.files import DapoEnv, FileEnv
from retool.env.registry import EnvOptions, env_from_config, make_env, register_env, registered_envs
from retool.env.retool import ReToolEnv, ReToolGroupBuilder, Tool, ToolSetup
from retool.env.scoring import Attempt, Score, Scorer, VerifierLike, score_final_answer
from retool.env.synthetic import TaskFamilyEnv
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
    "DapoEnv",
    "Env",
    "EnvError",
    "EnvGroupBuilder",
    "EnvOptions",
    "FileEnv",
    "Observation",
    "Outcome",
    "ProblemEnv",
    "ProblemListEnv",
    "ReToolEnv",
    "ReToolGroupBuilder",
    "Score",
    "Scorer",
    "Split",
    "StepResult",
    "TaskFamilyEnv",
    "Tool",
    "ToolSetup",
    "VerifierLike",
    "env_from_config",
    "make_env",
    "register_env",
    "registered_envs",
    "score_final_answer",
]
