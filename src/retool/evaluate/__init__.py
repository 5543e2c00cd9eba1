"""retool.evaluate: text-only vs ReTool evaluation with Average@N, Pass@N, pass@k, maj@N and bootstrap CIs.

``evaluate(config, mode=..., dataset=..., output=...)`` runs a resumable eval on any backend;
``run_eval`` is the same loop over ready components; ``retool.evaluate.metrics`` holds the pure metrics.
"""

from retool.evaluate.metrics import summarize
from retool.evaluate.runner import (
    MODES,
    EvalComponents,
    EvalError,
    evaluate,
    evaluate_async,
    problem_seed,
    run_eval,
    setting_value,
    settings_differences,
)
from retool.evaluate.store import EvalStoreError, ResultStore, summary_path_for

__all__ = [
    "MODES",
    "EvalComponents",
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
