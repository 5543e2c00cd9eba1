"""retool.env: the environment seam -- a source of problems and how a finished trajectory is scored.

- ``base``: ``ProblemEnv`` (``problems(split)``, ``epoch(seed, epoch)``, ``score(trajectory, verifier)``),
  ``ProblemListEnv`` (a fixed list), ``EnvError``.
- ``files``: ``FileEnv`` (a JSONL / JSON / parquet file or Hub id), the named evaluation sets, ``DapoEnv``.
- ``synthetic``: ``TaskFamilyEnv`` (the synthetic task family, ``tasks``).
- ``registry``: ``make_env(name_or_path, options)``, ``env_from_config(config)``, ``register_env``.

The trainer and the evaluator take a ``ProblemEnv``; names are resolved here, never inside them.
"""

from retool.env.base import SPLITS, EnvError, ProblemEnv, ProblemListEnv, Split
from retool.env.files import DapoEnv, FileEnv
from retool.env.registry import EnvOptions, env_from_config, make_env, register_env, registered_envs
from retool.env.synthetic import TaskFamilyEnv

__all__ = [
    "SPLITS",
    "DapoEnv",
    "EnvError",
    "EnvOptions",
    "FileEnv",
    "ProblemEnv",
    "ProblemListEnv",
    "Split",
    "TaskFamilyEnv",
    "env_from_config",
    "make_env",
    "register_env",
    "registered_envs",
]
