"""retool.evaluate: text-only vs ReTool evaluation with Average@N, Pass@N, pass@k, maj@N and bootstrap CIs.

- ``runner``: ``evaluate(config, mode=..., output=...)`` runs a resumable eval on any backend;
  ``run_eval`` is the same loop over ready ``Components``.
- ``settings``: what decides an eval's numbers (recorded, checked on resume), per-problem seeds.
- ``store``: the per-problem JSONL and its summary, and the record shapes.
- ``metrics``: the pure metrics; ``cli``: ``retool eval``.
"""

from retool.evaluate.metrics import summarize
from retool.evaluate.runner import MODES, evaluate, evaluate_async, run_eval
from retool.evaluate.settings import EvalError, problem_seed, setting_value, settings_differences
from retool.evaluate.store import EvalStoreError, ResultStore, summary_path_for

__all__ = [
    "MODES",
    "EvalError",
    "EvalStoreError",
    "ResultStore",
    "evaluate",
    "evaluate_async",
    "problem_seed",
    "run_eval",
    "setting_value",
    "settings_differences",
    "summarize",
    "summary_path_for",
]
