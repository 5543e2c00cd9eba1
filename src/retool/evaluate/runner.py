"""The eval runner: text-only vs ReTool on a fixed problem set, one resumable JSONL record per problem.

Both modes go through the same rollout engine with the same problems, sampling settings, budgets and
verifier; ``text-only`` only turns the tool off (no tool registered, one assistant turn). Each problem
gets its own seed derived from ``(seed, problem id)`` and is rolled out on its own, so its candidates do
not depend on which other problems ran beside it; that is what lets a resumed eval reproduce an
uninterrupted one.

``run_eval`` takes ready components (sampler, protocol, verifier, executor) and is what tests drive with
fakes; ``evaluate`` builds them from a ``Config`` for any backend and calls ``run_eval``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from retool.config import Config
from retool.data.problem import Problem
from retool.evaluate.metrics import summarize
from retool.evaluate.store import EvalStoreError, ResultStore
from retool.view.records import attach_eval_transcripts

logger = logging.getLogger(__name__)

Mode = Literal["text-only", "retool"]
MODES: tuple[str, ...] = ("text-only", "retool")
NAMED_DATASETS: tuple[str, ...] = ("aime2025", "aime2024", "math500")
# Settings that may change between a run and its resumption (they select problems, not how they are solved).
RESUME_IGNORED: frozenset[str] = frozenset({"limit", "problems", "dataset_source"})
SUMMARY_VERSION = 1
# Stop reasons that mean the infrastructure failed, not the model: such problems are retried, not recorded.
INFRA_STOP_REASONS: frozenset[str] = frozenset({"sampler_error", "executor_error"})


class EvalError(RuntimeError):
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
) -> dict[str, Any]:
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
        # Flat keys (None by default), so summaries written before they were recorded still resume.
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


def settings_differences(
    a: dict[str, Any], b: dict[str, Any], ignore: frozenset[str] = frozenset()
) -> list[str]:
    """Dotted names of settings whose values differ (nested dicts compared key by key)."""
    out: list[str] = []

    def walk(x: Any, y: Any, prefix: str) -> None:
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


def setting_value(settings: dict[str, Any], dotted: str) -> Any:
    """The value of one dotted setting name (as ``settings_differences`` reports it); None when absent."""
    node: Any = settings
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _count(value: Any) -> int:
    if isinstance(value, int):
        return value
    return len(value or ())


def candidate_record(traj: Any, save_transcript: bool = False) -> dict[str, Any]:
    """One trajectory as a JSON-ready candidate (see ``retool.evaluate.metrics`` for the keys)."""
    results = list(getattr(traj, "exec_results", None) or [])
    record: dict[str, Any] = {
        "index": int(traj.group_index),
        "answer": traj.answer,
        "correct": bool(traj.correct),
        "valid_format": bool(traj.valid_format),
        "reward": float(traj.reward),
        "code_calls": _count(traj.code_calls),
        "turns": len(traj.turns),
        "stop_reason": str(traj.stop_reason),
        "exec_latencies": [round(float(r.latency), 6) for r in results],
        "exec_errors": sum(1 for r in results if not r.ok and not r.timed_out),
        "exec_timeouts": sum(1 for r in results if r.timed_out),
        "self_corrected": bool(traj.had_error_then_correct),
        "completion_tokens": int(traj.completion_token_count),
        "total_tokens": len(traj.full_tokens()),
        "sample_seconds": round(float(traj.sample_seconds), 4),
        "exec_seconds": round(float(traj.exec_seconds), 4),
        "final_text_tail": (traj.final_text or "")[-400:],
    }
    if save_transcript:
        record["messages"] = traj.messages
    return record


RolloutFn = Callable[..., Awaitable[list[list[Any]]]]


def _default_rollout_fn() -> RolloutFn:
    from retool.rollout import run_group_rollouts

    return run_group_rollouts


@dataclass
class EvalComponents:
    """What ``run_eval`` needs besides settings: a sampler, a protocol and a verifier (+ executor for retool)."""

    sampler: Any
    protocol: Any
    verifier: Any
    executor: Any = None


async def run_eval(
    problems: Sequence[Problem],
    components: EvalComponents,
    *,
    config: Config,
    mode: str,
    output: str | Path,
    val_n: int,
    seed: int = 0,
    identity: dict[str, Any] | None = None,
    concurrency: int = 4,
    save_transcripts: bool = False,
    rollout_fn: RolloutFn | None = None,
    bootstrap_resamples: int = 2000,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Roll out ``val_n`` candidates per unfinished problem, append records, return the summary.

    ``on_progress(done, total)`` is called once at the start and after each finished problem (progress
    bars).

    ``identity`` carries the run's descriptive settings (model, checkpoint, dataset, dataset_source,
    limit). Finished problems already in ``output`` are skipped; if the existing summary was written with
    different settings, raises ``EvalError`` naming them.
    """
    if mode not in MODES:
        raise EvalError(f"unknown mode {mode!r} (use one of: {', '.join(MODES)})")
    if val_n < 1:
        raise EvalError(f"val_n must be >= 1, got {val_n}")
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise EvalError(f"problem ids are not unique (e.g. {dup[:3]}); resuming needs unique ids")
    use_tools = mode == "retool"
    fmt = getattr(components.protocol, "fmt", None)
    tool_format = getattr(fmt, "name", None) or str(config.model.tool_format)
    ident = dict(identity or {})
    settings = build_settings(
        config,
        mode=mode,
        val_n=val_n,
        seed=seed,
        tool_format=tool_format,
        model=ident.get("model"),
        checkpoint=ident.get("checkpoint"),
        dataset=str(ident.get("dataset", "")),
        dataset_source=str(ident.get("dataset_source", "")),
        fingerprint=str(ident.get("dataset_fingerprint") or dataset_fingerprint(problems)),
        problems=len(problems),
        limit=ident.get("limit"),
    )
    store = ResultStore(output)
    previous = check_resumable(store, settings)
    try:
        done = store.load()
    except EvalStoreError as exc:
        raise EvalError(str(exc)) from None
    todo = [p for p in problems if p.id not in done]
    timing = dict((previous or {}).get("timing", {}))
    timing["sessions"] = int(timing.get("sessions", 0)) + 1
    t0 = time.perf_counter()
    elapsed_before = float(timing.get("elapsed_seconds", 0.0))
    logger.info(
        "eval %s: %d problems, %d already done, %d to run (val_n=%d)",
        mode,
        len(problems),
        len(problems) - len(todo),
        len(todo),
        val_n,
    )

    def current_summary(status: str, failed: list[str]) -> dict[str, Any]:
        selected = [done[p.id] for p in problems if p.id in done]
        timing["elapsed_seconds"] = round(elapsed_before + time.perf_counter() - t0, 3)
        timing["sample_seconds"] = round(
            sum(c.get("sample_seconds", 0.0) for r in selected for c in r["candidates"]), 3
        )
        timing["exec_seconds"] = round(
            sum(c.get("exec_seconds", 0.0) for r in selected for c in r["candidates"]), 3
        )
        return {
            "version": SUMMARY_VERSION,
            "status": status,
            "output": str(store.path),
            "settings": settings,
            "completed": len(selected),
            "total": len(problems),
            "failed_problems": failed,
            "metrics": summarize(selected, bootstrap_resamples=bootstrap_resamples, bootstrap_seed=seed),
            "timing": timing,
        }

    store.write_summary(current_summary("incomplete", []))
    if on_progress is not None:
        on_progress(len(problems) - len(todo), len(problems))
    rollout = rollout_fn or _default_rollout_fn()
    semaphore = asyncio.Semaphore(max(1, concurrency))
    failed: list[str] = []
    index_of = {p.id: i for i, p in enumerate(problems)}

    async def one(problem: Problem) -> None:
        async with semaphore:
            pseed = problem_seed(seed, problem.id)
            groups = await rollout(
                [problem],
                sampler=components.sampler,
                protocol=components.protocol,
                executor=components.executor if use_tools else None,
                verifier=components.verifier,
                rollout=config.rollout,
                sampling=config.sampling,
                group_size=val_n,
                seed=pseed,
                use_tools=use_tools,
            )
        trajs = sorted(groups[0], key=lambda t: t.group_index)
        candidates = [candidate_record(t, save_transcripts) for t in trajs]
        if save_transcripts:  # the viewer's record shape, shared with training (retool.view.records)
            decode = getattr(components.protocol, "decode", None)
            attach_eval_transcripts(candidates, trajs, mode=mode, decode=decode)
        broken = sorted({c["stop_reason"] for c in candidates} & INFRA_STOP_REASONS)
        if broken:
            # A sampler or executor failure says nothing about the model; leave the problem for the next run.
            logger.warning("problem %s: %s; not recorded (rerun to retry it)", problem.id, ", ".join(broken))
            failed.append(problem.id)
            return
        record = {
            "id": problem.id,
            "index": index_of[problem.id],
            "reference": str(problem.answer),
            "data_source": problem.data_source,
            "mode": mode,
            "seed": pseed,
            "n": len(candidates),
            "n_correct": sum(c["correct"] for c in candidates),
            "candidates": candidates,
        }
        store.append(record)
        done[problem.id] = record
        logger.info(
            "[%d/%d] %s: %d/%d correct",
            len(done),
            len(problems),
            problem.id,
            record["n_correct"],
            record["n"],
        )
        store.write_summary(current_summary("incomplete", failed))
        if on_progress is not None:
            on_progress(len(done), len(problems))

    tasks = [asyncio.ensure_future(one(p)) for p in todo]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
        store.write_summary(current_summary("incomplete", failed))
        raise
    status = "complete" if all(p.id in done for p in problems) else "incomplete"
    summary = current_summary(status, sorted(failed, key=index_of.__getitem__))
    store.write_summary(summary)
    return summary


def check_resumable(
    store: ResultStore, settings: dict[str, Any], ignore: frozenset[str] = RESUME_IGNORED
) -> dict[str, Any] | None:
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


# --- building components from a Config ------------------------------------------------------------


def resolve_dataset(
    dataset: str,
    data_dir: str | Path | None = None,
    *,
    question_field: str | None = None,
    answer_field: str | None = None,
    id_field: str | None = None,
) -> tuple[list[Problem], str]:
    """Problems and where they came from. A named set prefers ``<data_dir>/<name>.jsonl`` (``data_dir`` or
    ``$RETOOL_DATA_DIR``) and otherwise goes to the Hub through ``retool.data.load_problems`` (which also
    takes a local JSONL/JSON/parquet path or a Hub id, and raises ``DataError`` for anything else)."""
    from retool.data import load_problems  # another stage; imported late so the CLI stays light

    source: str = dataset
    fields: dict[str, str] = {}
    if dataset in NAMED_DATASETS:
        folder = data_dir or os.environ.get("RETOOL_DATA_DIR")
        if folder:
            for ext in ("jsonl", "parquet"):
                candidate = Path(folder) / f"{dataset}.{ext}"
                if candidate.is_file():
                    source = str(candidate)
                    break
        if source != dataset and dataset == "math500":
            fields = {"question_field": "problem", "id_field": "unique_id"}  # MATH-500's own field names
    if question_field:
        fields["question_field"] = question_field
    if answer_field:
        fields["answer_field"] = answer_field
    if id_field:
        fields["id_field"] = id_field
    problems = load_problems(source, **fields)
    if not problems:
        raise EvalError(f"dataset {dataset!r} ({source}) has no problems")
    return list(problems), source


TRAINER_STATE_FILE = "trainer_state.json"  # written by `retool train` into each checkpoint folder


def resolve_checkpoint(checkpoint: str) -> str:
    """What ``load_state`` needs, from what a user naturally passes.

    A training run folder (uses ``checkpoints/latest``), its ``checkpoints`` folder, or one checkpoint
    folder ``step_NNNNNN`` (holding ``trainer_state.json``) resolve to the backend state saved in it;
    anything else (a backend state folder, a remote URI) is passed through unchanged. The resolved path is
    what the summary records, so a resumed eval cannot silently switch to a newer ``latest``.
    """
    path = Path(checkpoint)
    if not path.is_dir():
        return checkpoint
    for folder in (path / "checkpoints", path):
        latest = folder / "latest"
        if latest.is_file():
            name = latest.read_text(encoding="utf-8").strip()
            if not (folder / name / TRAINER_STATE_FILE).is_file():
                raise EvalError(f"{latest} names {name!r}, which is not a complete checkpoint")
            path = folder / name
            break
    state_file = path / TRAINER_STATE_FILE
    if not state_file.is_file():
        return str(path)
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise EvalError(f"{state_file}: unreadable ({exc})") from None
    backend_state = str(state.get("backend_state") or "")
    if not backend_state:
        raise EvalError(f"{state_file} records no backend state to load")
    if state.get("backend_state_is_local", True) and not Path(backend_state).is_absolute():
        return str(path / backend_state)
    return backend_state


def _resolve_tiny_model(config: Config) -> Config:
    """``model.name = "tiny"`` (the tiny preset) means the model ``retool train`` built into its run folder."""
    if config.model.name != "tiny" or config.backend.kind != "local" or Path("tiny").exists():
        return config
    folder = Path(config.train.run_dir) / "tiny_model"
    if not (folder / "config.json").is_file():
        raise EvalError(
            f"model 'tiny' not found at {folder}; train it first (retool train --config tiny) "
            "or pass --model PATH"
        )
    return config.model_copy(update={"model": config.model.model_copy(update={"name": str(folder)})})


async def _open_backend(config: Config, checkpoint: str | None) -> tuple[Any, Any, Any]:
    """(training client, sampler, tokenizer) for any backend; the checkpoint's weights when given."""
    from retool.backends import make_training_client

    client = make_training_client(config)
    if checkpoint:
        await client.load_state_async(checkpoint)
    sampler = await client.sampling_client_async()
    return client, sampler, client.tokenizer


def _make_protocol(tokenizer: Any, config: Config, use_tools: bool) -> Any:
    from retool.protocol import ChatProtocol

    return ChatProtocol.from_config(tokenizer, config, use_tools=use_tools)


def _make_verifier(config: Config) -> Any:
    from retool.reward import Verifier

    return Verifier.from_config(config.reward)


def _make_executor(config: Config) -> Any:
    from retool.sandbox import make_executor

    return make_executor(config.sandbox)


async def evaluate_async(
    config: Config,
    *,
    mode: str,
    dataset: str,
    output: str | Path,
    val_n: int = 12,
    checkpoint: str | None = None,
    seed: int = 0,
    limit: int | None = None,
    data_dir: str | Path | None = None,
    concurrency: int = 4,
    save_transcripts: bool = False,
    problems: Sequence[Problem] | None = None,
    dataset_fields: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Evaluate ``config.model`` (optionally at ``checkpoint``) on ``dataset``; see ``run_eval``."""
    if mode not in MODES:
        raise EvalError(f"unknown mode {mode!r} (use one of: {', '.join(MODES)})")
    config = _resolve_tiny_model(config)
    if problems is None:
        all_problems, source = resolve_dataset(dataset, data_dir, **(dataset_fields or {}))
    else:
        all_problems, source = list(problems), dataset
    fingerprint = dataset_fingerprint(all_problems)
    if checkpoint:
        checkpoint = resolve_checkpoint(checkpoint)
    selected = all_problems[:limit] if limit is not None else all_problems
    identity = {
        "model": config.model.name,
        "checkpoint": checkpoint,
        "dataset": dataset,
        "dataset_source": source,
        "dataset_fingerprint": fingerprint,
        "limit": limit,
    }
    use_tools = mode == "retool"
    # Refuse a mismatched resume before spending minutes loading a model (the tool format, which needs
    # the tokenizer, is checked again by run_eval).
    early = build_settings(
        config,
        mode=mode,
        val_n=val_n,
        seed=seed,
        tool_format="",
        checkpoint=checkpoint,
        dataset=dataset,
        fingerprint=fingerprint,
        limit=limit,
    )
    check_resumable(ResultStore(output), early, RESUME_IGNORED | {"tool_format"})
    try:
        client, sampler, tokenizer = await _open_backend(config, checkpoint)
    except (ValueError, OSError, ImportError) as exc:
        where = f" at checkpoint {checkpoint}" if checkpoint else ""
        raise EvalError(
            f"cannot load model {config.model.name!r}{where} ({config.backend.kind}): {exc}"
        ) from exc
    verifier = _make_verifier(config)
    executor = _make_executor(config) if use_tools else None
    try:
        components = EvalComponents(
            sampler=sampler,
            protocol=_make_protocol(tokenizer, config, use_tools),
            verifier=verifier,
            executor=executor,
        )
        return await run_eval(
            selected,
            components,
            config=config,
            mode=mode,
            output=output,
            val_n=val_n,
            seed=seed,
            identity=identity,
            concurrency=concurrency,
            save_transcripts=save_transcripts,
        )
    finally:
        if executor is not None:
            executor.close()
        verifier.close()
        close = getattr(client, "close_async", None)
        if close is not None:
            await close()


def evaluate(config: Config, **kwargs: Any) -> dict[str, Any]:
    """Synchronous ``evaluate_async`` (for scripts and the CLI)."""
    return asyncio.run(evaluate_async(config, **kwargs))
