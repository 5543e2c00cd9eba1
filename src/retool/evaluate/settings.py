"""What decides an eval's numbers: its settings record, the dataset fingerprint and per-problem seeds.

Every summary records ``build_settings``; a rerun into the same output resumes only when its settings
match (``check_resumable``), so records made under different settings are never mixed. Settings that
choose *which* problems run (``RESUME_IGNORED``) may change between sessions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from retool.config import Config
from retool.data.problem import Problem
from retool.errors import UserError
from retool.evaluate.store import EvalSummary, ResultStore
from retool.jsonl import JsonObject, JsonValue

# Settings that may change between a run and its resumption (they select problems, not how they are solved).
RESUME_IGNORED: frozenset[str] = frozenset({"limit", "problems", "dataset_source"})


class EvalError(UserError, RuntimeError):
    """An eval that cannot start or continue; the message says why (the CLI prints it, exit 2)."""


def problem_seed(seed: int, problem_id: str) -> int:
    """A per-problem sampling seed, stable across runs, batches and machines."""
    digest = hashlib.sha256(f"{seed}:{problem_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def dataset_fingerprint(problems: Sequence[Problem]) -> str:
    h = hashlib.sha256()
    for p in problems:
        h.update(json.dumps([p.id, p.question, str(p.answer)], ensure_ascii=False).encode())
    return h.hexdigest()[:16]


def build_settings(
    config: Config,
    *,
    mode: str,
    val_n: int,
    seed: int,
    tool_format: str,
    model: str | None = None,
    checkpoint: str | None = None,
    dataset: str = "",
    dataset_source: str = "",
    fingerprint: str = "",
    problems: int = 0,
    limit: int | None = None,
) -> JsonObject:
    """Everything that decides an eval's numbers, recorded in its summary and checked on resume."""
    r = config.rollout
    s = config.sandbox
    return {
        "mode": mode,
        "model": model if model is not None else config.model.name,
        "checkpoint": checkpoint,
        "backend": config.backend.kind,
        "dataset": dataset,
        "dataset_source": dataset_source,
        "dataset_fingerprint": fingerprint,
        "problems": problems,
        "limit": limit,
        "val_n": val_n,
        "temperature": config.sampling.temperature,
        "top_p": config.sampling.top_p,
        "top_k": config.sampling.top_k,
        "seed": seed,
        "budgets": {
            "max_code_calls": r.max_code_calls,
            "max_assistant_turns": r.max_assistant_turns,
            "max_tokens_per_turn": r.max_tokens_per_turn,
            "max_observation_tokens": r.max_observation_tokens,
            "max_trajectory_tokens": r.max_trajectory_tokens,
            "max_context": config.model.max_context,
        },
        "verifier": {"timeout": config.reward.verify_timeout, "tail_chars": config.reward.tail_chars},
        "tool_format": tool_format,
        "enable_thinking": config.model.enable_thinking,
        "chat_template": config.model.chat_template,
        "sandbox": {
            "backend": s.backend,
            "isolation": s.isolation,
            "timeout": s.timeout,
            "memory_mb": s.memory_mb,
            "output_cap": s.output_cap,
            "auto_print_last_expr": s.auto_print_last_expr,
        },
    }


def settings_differences(a: JsonValue, b: JsonValue, ignore: frozenset[str] = frozenset()) -> list[str]:
    """Dotted names of settings whose values differ (nested dicts compared key by key)."""
    out: list[str] = []

    def walk(x: JsonValue, y: JsonValue, prefix: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for key in sorted(set(x) | set(y)):
                name = f"{prefix}{key}"
                if name in ignore:
                    continue
                walk(x.get(key), y.get(key), name + ".")
        elif x != y:
            out.append(prefix.rstrip("."))

    walk(a, b, "")
    return out


def setting_value(settings: JsonValue, dotted: str) -> JsonValue:
    """The value of one dotted setting name (as ``settings_differences`` reports it); None when absent."""
    node = settings
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def check_resumable(
    store: ResultStore, settings: JsonObject, ignore: frozenset[str] = RESUME_IGNORED
) -> EvalSummary | None:
    """The existing summary (None for a fresh output); ``EvalError`` if it was made with other settings."""
    previous = store.read_summary()
    if previous is None and store.path.exists() and store.path.stat().st_size > 0:
        raise EvalError(
            f"{store.path} exists but its summary {store.summary_path} does not; "
            "cannot tell which settings made it (remove it or choose another --output)"
        )
    if previous is not None:
        old = previous.get("settings", {})
        diffs = settings_differences(old, settings, ignore)
        if diffs:
            details = ", ".join(
                f"{d}: {setting_value(old, d)!r} -> {setting_value(settings, d)!r}" for d in diffs
            )
            raise EvalError(
                f"{store.path} was written with different settings ({details}); "
                "rerun with the original settings to resume, or choose another --output"
            )
    return previous
