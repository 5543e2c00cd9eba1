"""The eval run loop: text-only vs ReTool on a problem source's problems, one resumable record per problem.

Both modes go through the same rollout engine with the same problems, sampling settings, budgets and
verifier; ``text-only`` only turns the tool off (no tool registered, one assistant turn). Each problem
gets its own seed derived from ``(seed, problem id)`` and is rolled out on its own, so its candidates do
not depend on which other problems ran beside it; that is what lets a resumed eval reproduce an
uninterrupted one.

``run_eval`` takes ready ``Components`` (what tests drive with fakes); ``evaluate`` builds them from a
``Config`` with ``retool.components.build_components`` (any backend) and takes its problems from a
problem source (``retool.env``, the test split). Settings and resume checks live in
``retool.evaluate.settings``, the records in ``retool.evaluate.store``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypedDict

from retool.backends import resolve_model_name
from retool.backends.interface.clients import SamplingClient
from retool.components import Components, build_components
from retool.config import Config
from retool.data.problem import Problem
from retool.env import ProblemList, ProblemSource, SourceOptions, make_source
from retool.evaluate.metrics import summarize
from retool.evaluate.settings import (
    RESUME_IGNORED,
    EvalError,
    build_settings,
    check_resumable,
    dataset_fingerprint,
    problem_seed,
)
from retool.evaluate.store import (
    EvalStoreError,
    EvalSummary,
    ResultStore,
    attach_eval_transcripts,
    candidate_record,
    problem_record,
)
from retool.jsonl import JsonObject
from retool.rollout import RolloutFn, Trajectory, run_rollout
from retool.train.sampling import GroupRollouts

logger = logging.getLogger(__name__)

Mode = Literal["text-only", "retool"]
MODES: tuple[str, ...] = ("text-only", "retool")
SUMMARY_VERSION = 1
# Stop reasons that mean the infrastructure failed, not the model: such problems are retried, not recorded.
INFRA_STOP_REASONS: frozenset[str] = frozenset({"sampler_error", "executor_error"})


def _check_request(problems: Sequence[Problem], mode: str, val_n: int) -> None:
    if mode not in MODES:
        raise EvalError(f"unknown mode {mode!r} (use one of: {', '.join(MODES)})")
    if val_n < 1:
        raise EvalError(f"val_n must be >= 1, got {val_n}")
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise EvalError(f"problem ids are not unique (e.g. {dup[:3]}); resuming needs unique ids")


class EvalIdentity(TypedDict, total=False):
    """The run's descriptive settings, recorded in the summary (``run_eval``'s ``identity``)."""

    model: str | None
    checkpoint: str | None
    dataset: str
    dataset_source: str
    dataset_fingerprint: str
    limit: int | None


class _Session:
    """One ``run_eval`` call: the records done so far, the failures, the timing, and the summary."""

    def __init__(
        self,
        problems: Sequence[Problem],
        store: ResultStore,
        settings: JsonObject,
        previous: EvalSummary | None,
        bootstrap: tuple[int, int],
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.problems, self.store, self.settings = list(problems), store, settings
        self.mode = str(settings["mode"])
        self.decode = decode  # the protocol's, for the viewer's token spans (saved transcripts)
        try:
            self.done = store.load()
        except EvalStoreError as exc:
            raise EvalError(str(exc)) from None
        self.failed: list[str] = []
        self.index_of = {p.id: i for i, p in enumerate(self.problems)}
        self.timing = dict((previous or {}).get("timing", {}))
        self.timing["sessions"] = int(self.timing.get("sessions", 0)) + 1
        self.elapsed_before = float(self.timing.get("elapsed_seconds", 0.0))
        self.t0 = time.perf_counter()
        self.bootstrap_resamples, self.bootstrap_seed = bootstrap

    def todo(self) -> list[Problem]:
        return [p for p in self.problems if p.id not in self.done]

    def summary(self, status: str | None = None) -> EvalSummary:
        if status is None:
            status = "complete" if not self.todo() else "incomplete"
        selected = [self.done[p.id] for p in self.problems if p.id in self.done]
        candidates = [c for r in selected for c in r["candidates"]]
        self.timing["elapsed_seconds"] = round(self.elapsed_before + time.perf_counter() - self.t0, 3)
        self.timing["sample_seconds"] = round(sum(c.get("sample_seconds", 0.0) for c in candidates), 3)
        self.timing["exec_seconds"] = round(sum(c.get("exec_seconds", 0.0) for c in candidates), 3)
        metrics = summarize(
            selected, bootstrap_resamples=self.bootstrap_resamples, bootstrap_seed=self.bootstrap_seed
        )
        return {
            "version": SUMMARY_VERSION,
            "status": status,
            "output": str(self.store.path),
            "settings": self.settings,
            "completed": len(selected),
            "total": len(self.problems),
            "failed_problems": sorted(self.failed, key=self.index_of.__getitem__),
            "metrics": metrics,
            "timing": self.timing,
        }

    def record(self, problem: Problem, trajectories: Sequence[Trajectory], seed: int, keep: bool) -> None:
        """Append ``problem``'s record, or leave it for the next run when the infrastructure failed."""
        trajs = sorted(trajectories, key=lambda t: t.group_index)
        candidates = [candidate_record(t, keep) for t in trajs]
        if keep:  # the viewer's record shape, shared with training (retool.rollout.records)
            attach_eval_transcripts(candidates, trajs, mode=self.mode, decode=self.decode)
        broken = sorted({c["stop_reason"] for c in candidates} & INFRA_STOP_REASONS)
        if broken:
            # A sampler or executor failure says nothing about the model; leave the problem for the next run.
            logger.warning("problem %s: %s; not recorded (rerun to retry it)", problem.id, ", ".join(broken))
            self.failed.append(problem.id)
            return
        record = problem_record(problem, self.index_of[problem.id], self.mode, seed, candidates)
        self.store.append(record)
        self.done[problem.id] = record
        logger.info(
            "[%d/%d] %s: %d/%d correct",
            len(self.done),
            len(self.problems),
            problem.id,
            record["n_correct"],
            record["n"],
        )
        self.store.write_summary(self.summary("incomplete"))


@dataclass(frozen=True)
class _Plan:
    """How every problem of one eval is rolled out: the same groups sampler (parts, sampling, budgets)
    and policy for all; each problem its own seed."""

    groups: GroupRollouts
    sampler: SamplingClient
    val_n: int
    seed: int

    async def rollout(self, problem: Problem) -> tuple[list[Trajectory], int]:
        """``val_n`` candidates for ``problem`` alone (so they do not depend on the problems beside it)."""
        pseed = problem_seed(self.seed, problem.id)
        groups = await self.groups.sample([problem], self.sampler, group_size=self.val_n, seed=pseed)
        return groups[0], pseed


async def run_eval(
    problems: Sequence[Problem],
    components: Components,
    *,
    config: Config,
    mode: str,
    output: str | Path,
    val_n: int | None = None,
    seed: int | None = None,
    identity: EvalIdentity | None = None,
    concurrency: int | None = None,
    save_transcripts: bool | None = None,
    rollout_fn: RolloutFn = run_rollout,
    source: ProblemSource | None = None,
    bootstrap_resamples: int = 2000,
    on_progress: Callable[[int, int], None] | None = None,
) -> EvalSummary:
    """Roll out ``val_n`` candidates per unfinished problem, append records, return the summary.

    ``on_progress(done, total)`` is called once at the start and after each finished problem (progress
    bars).

    ``components`` supplies the sampler (already refreshed), protocol (with the tool on in ``retool``
    mode, off in ``text-only``), verifier and, in ``retool`` mode, executor. ``val_n``, ``seed``,
    ``concurrency`` and ``save_transcripts`` default to ``config.eval``. ``identity`` carries the run's
    descriptive settings (model, checkpoint, dataset, dataset_source, limit). Finished problems already
    in ``output`` are skipped; if the existing summary was written with different settings, raises
    ``EvalError`` naming them.
    """
    e = config.eval
    val_n = e.val_n if val_n is None else val_n
    seed = e.seed if seed is None else seed
    _check_request(problems, mode, val_n)
    if components.sampler is None:
        raise EvalError("the components have no sampler yet (await components.refresh_sampler())")
    source = source if source is not None else ProblemList(problems, shuffle=False)
    groups = GroupRollouts.from_parts(
        source, components, config, tools=mode == "retool", rollout_fn=rollout_fn
    )
    plan = _Plan(groups, components.sampler, val_n, seed)
    settings = _settings(problems, components, config, mode, val_n, seed, identity or EvalIdentity())
    store = ResultStore(output)
    with store.claimed():  # the output's only writer until the summary is written
        previous = check_resumable(store, settings)
        decode = getattr(components.protocol, "decode", None)
        session = _Session(problems, store, settings, previous, (bootstrap_resamples, seed), decode)
        todo = session.todo()
        done = len(problems) - len(todo)
        logger.info(
            "eval %s: %d problems, %d done, %d to run (val_n=%d)", mode, len(problems), done, len(todo), val_n
        )
        store.write_summary(session.summary("incomplete"))
        if on_progress is not None:
            on_progress(done, len(problems))
        keep = e.save_transcripts if save_transcripts is None else save_transcripts
        semaphore = asyncio.Semaphore(max(1, e.concurrency if concurrency is None else concurrency))

        async def one(problem: Problem) -> None:
            async with semaphore:
                trajectories, pseed = await plan.rollout(problem)
            session.record(problem, trajectories, pseed, keep)
            if on_progress is not None:
                on_progress(len(session.done), len(problems))

        await _gather_or_save(session, [one(p) for p in todo])
        summary = session.summary()
        store.write_summary(summary)
        return summary


def _settings(
    problems: Sequence[Problem],
    components: Components,
    config: Config,
    mode: str,
    val_n: int,
    seed: int,
    ident: EvalIdentity,
) -> JsonObject:
    fmt = getattr(components.protocol, "fmt", None)
    return build_settings(
        config,
        mode=mode,
        val_n=val_n,
        seed=seed,
        tool_format=getattr(fmt, "name", None) or str(config.model.tool_format),
        model=ident.get("model"),
        checkpoint=ident.get("checkpoint"),
        dataset=str(ident.get("dataset", "")),
        dataset_source=str(ident.get("dataset_source", "")),
        fingerprint=str(ident.get("dataset_fingerprint") or dataset_fingerprint(problems)),
        problems=len(problems),
        limit=ident.get("limit"),
    )


async def _gather_or_save(session: _Session, coros: list[Awaitable[None]]) -> None:
    """Run every problem; on any error (or cancellation) stop the rest and save the summary so far."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
        session.store.write_summary(session.summary("incomplete"))
        raise


# --- from a Config --------------------------------------------------------------------------------


def _resolve_model(config: Config) -> Config:
    """The config with ``model.name`` resolved the way the local backend loads it (``"tiny"`` -> its folder,
    built on first use), so the summary records the model actually evaluated."""
    if config.backend.kind != "local":
        return config
    name = resolve_model_name(config)
    return config.model_copy(update={"model": config.model.model_copy(update={"name": name})})


def _resolve_checkpoint(checkpoint: str | None) -> str | None:
    from retool.train.checkpoint import CheckpointError, backend_state_of  # the layout's one owner

    if not checkpoint:
        return None
    try:
        return backend_state_of(checkpoint)
    except CheckpointError as exc:
        raise EvalError(str(exc)) from None


async def _open(config: Config, checkpoint: str | None, use_tools: bool) -> Components:
    """The components of an eval, with the checkpoint's weights loaded and the sampler refreshed."""
    try:
        parts = build_components(config, tools=use_tools)
    except (ValueError, OSError, ImportError) as exc:
        raise EvalError(f"cannot load model {config.model.name!r} ({config.backend.kind}): {exc}") from exc
    try:
        if checkpoint:
            await parts.backend.load_state_async(checkpoint)
        await parts.refresh_sampler()
    except (ValueError, OSError, ImportError) as exc:
        await parts.aclose()
        raise EvalError(
            f"cannot load model {config.model.name!r} at checkpoint {checkpoint} ({config.backend.kind}): {exc}"
        ) from exc
    except BaseException:
        await parts.aclose()
        raise
    return parts


async def evaluate_async(
    config: Config,
    *,
    mode: str,
    output: str | Path,
    source: ProblemSource | None = None,
    checkpoint: str | None = None,
    dataset_fields: Mapping[str, str] | None = None,
) -> EvalSummary:
    """Evaluate ``config.model`` (optionally at ``checkpoint``) on the test split of ``source`` (default: the
    problem source ``config.eval.dataset`` names, with ``dataset_fields`` as explicit column names).

    Everything else comes from ``config.eval`` (val_n, seed, limit, concurrency, save_transcripts) and
    ``config.sampling``; see ``run_eval``.
    """
    if mode not in MODES:
        raise EvalError(f"unknown mode {mode!r} (use one of: {', '.join(MODES)})")
    e = config.eval
    config = _resolve_model(config)
    if source is None:
        source = make_source(e.dataset, SourceOptions(data=config.data, fields=dict(dataset_fields or {})))
    all_problems = source.problems("test")
    fingerprint = dataset_fingerprint(all_problems)
    checkpoint = _resolve_checkpoint(checkpoint)
    identity: EvalIdentity = {
        "model": config.model.name,
        "checkpoint": checkpoint,
        "dataset": source.name,
        "dataset_source": source.source,
        "dataset_fingerprint": fingerprint,
        "limit": e.limit,
    }
    # Refuse a mismatched resume before spending minutes loading a model (the tool format, which needs
    # the tokenizer, is checked again by run_eval).
    early = build_settings(
        config,
        mode=mode,
        val_n=e.val_n,
        seed=e.seed,
        tool_format="",
        checkpoint=checkpoint,
        dataset=source.name,
        fingerprint=fingerprint,
        limit=e.limit,
    )
    check_resumable(ResultStore(output), early, RESUME_IGNORED | {"tool_format"})
    parts = await _open(config, checkpoint, mode == "retool")
    try:
        selected = all_problems[: e.limit] if e.limit is not None else all_problems
        return await run_eval(
            selected, parts, config=config, mode=mode, output=output, identity=identity, source=source
        )
    finally:
        await parts.aclose()


def evaluate(
    config: Config,
    *,
    mode: str,
    output: str | Path,
    source: ProblemSource | None = None,
    checkpoint: str | None = None,
    dataset_fields: Mapping[str, str] | None = None,
) -> EvalSummary:
    """Synchronous ``evaluate_async`` (for scripts and the CLI)."""
    return asyncio.run(
        evaluate_async(
            config,
            mode=mode,
            output=output,
            source=source,
            checkpoint=checkpoint,
            dataset_fields=dataset_fields,
        )
    )
