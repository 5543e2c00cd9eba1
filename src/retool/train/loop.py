"""The ReTool RL loop: one step after another, each one read top to bottom in ``Trainer._one_step``.

``Trainer`` owns the run folder::

    RUN_DIR/config.toml       the exact config (a resumed run reads it back)
    RUN_DIR/metrics.jsonl     one JSON object per finished step, with "step"
    RUN_DIR/trajectories.jsonl  sampled trajectories of each step (``retool.train.records``)
    RUN_DIR/tensorboard/ swanlog/ wandb/  the tracker's files (``retool.train.trackers``)
    RUN_DIR/checkpoints/      see ``retool.train.checkpoint``

It trains on a problem source (``retool.env.ProblemSource``: which problems, how a trajectory is scored) with
components (``retool.components.Components``: backend, protocol, executor, verifier); by default both
are built from the config, through the same functions every other command uses.

One RL step (``_one_step``), the synchronous loop of three modules: sample this step's batch of groups
from the weights the step starts with (``StepBatchBuilder.batch``, ``retool.train.sampling``: rolls the
groups out, filters them, marks the informative ones); build the datums of the marked groups, dropping
what the filters leave out (``build_step_data``, ``retool.train.step``); write the trajectories; train
(``train_step``); log the metrics line and checkpoint when due. Only with ``train.max_steps_off_policy =
k >= 1`` is the batch taken instead from ``AheadBatches`` (``retool.train.ahead``), whose background task
samples the batches of steps t+1..t+k while step t trains, k versions behind.

Exactness of resume: a step's problems come from a ``ProblemStream`` whose position is checkpointed;
sampling seeds derive from ``(train.seed, step)``; weights, optimizer and RNG come back from the
checkpoint, and so do the batches already sampled for later steps (k >= 1); ``metrics.jsonl`` is cut back
to the checkpoint's step. So a run killed at any moment and resumed trains on the same samples in the same
order as an uninterrupted one, losing only the steps after its last checkpoint (which it redoes).

SIGINT / SIGTERM: the first one finishes the step in flight, saves a checkpoint and exits cleanly; a
second one aborts at once (resume then starts from the previous checkpoint).
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TypedDict, Unpack

from retool.backends import adam_params_from_config
from retool.backends.interface.clients import SamplingClient, TrainingClient
from retool.components import Components, build_components
from retool.config import DEFAULT_TIS_CAP, Config, ConfigError, dump_config, load_config
from retool.data.problem import Problem
from retool.env import ProblemSource, retool_outcome, source_from_config
from retool.jsonl import JsonObject, as_number
from retool.rollout import RolloutFn, run_rollout
from retool.train.ahead import AheadBatches, PipelineState, pipeline_metrics, requeue_stale
from retool.train.checkpoint import (
    CheckpointManager,
    TrainerState,
    repair_metrics,
    restore_rng,
    write_text_atomic,
)
from retool.train.datasource import DataPosition, ProblemFeed, ProblemOrder, ProblemStream
from retool.train.metrics import (
    MetricsLog,
    MetricsRecord,
    category_pass_rates,
    fault_counters,
    rollout_metrics,
    scalars_of,
)
from retool.train.progress import Progress
from retool.train.records import TRAJECTORIES_FILE, TrajectoryLog
from retool.train.sampling import Batch, GroupRollouts, StepBatchBuilder
from retool.train.selection import PassRateSelector
from retool.train.step import StepData, TrainStepResult, build_step_data, train_step
from retool.train.trackers import Tracker, checkpoint_entry, open_tracker

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"

StepHook = Callable[[int, MetricsRecord], None]


class RunDirError(RuntimeError):
    """The run folder cannot be used as asked (exists without --resume, or holds no run to resume)."""


@dataclass
class Restored:
    """Where a run starts: the steps completed, the stream's position, the batches a checkpoint held for
    later steps (None: none) and the pass-rate selector's state (None: none stored)."""

    step: int
    position: DataPosition
    queued: PipelineState | None = None
    selection: JsonObject | None = None


@dataclass
class TrainSummary:
    run_dir: Path
    start_step: int
    last_step: int
    interrupted: bool
    last_metrics: MetricsRecord = field(default_factory=dict)


class Trainer:
    """One training run of ``config`` in ``run_dir`` (``resume``: continue it from its latest checkpoint).

    ``source``: the problems and how trajectories are scored (default ``source_from_config(config)``);
    ``components``: backend, protocol, executor, verifier (default ``build_components`` for this run
    folder, closed when the run ends; components passed in belong to the caller and stay open);
    ``rollout_fn``: the rollout function (default ``retool.rollout.run_rollout``); ``tracker``: the
    metrics sink (default from ``[logging]``); ``on_step(step, metrics)``: after every finished step
    (progress displays).
    """

    def __init__(
        self,
        config: Config,
        run_dir: str | Path,
        resume: bool = False,
        *,
        source: ProblemSource | None = None,
        components: Components | None = None,
        rollout_fn: RolloutFn = run_rollout,
        tracker: Tracker | None = None,
        on_step: StepHook | None = None,
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.source = source
        self.components = components
        self._owns_components = False
        self._tis_cap = 0.0  # loss.tis_cap resolved against the backend (``resolve_tis_cap``)
        self._measures_ref_kl = False  # the backend computes the starting policy's logprobs
        self._rollout_fn = rollout_fn
        self._tracker = tracker
        self._open_tracker: Tracker = Tracker()  # the run's tracker once open (its id goes in checkpoints)
        self._on_step = on_step
        self._stop_requested = False
        self._requeued = 0  # groups of restored batches requeued as too stale (``retool.train.ahead``)
        # Set when the run starts (``_sampling``): the step's batch builder, its problem feed and, for
        # train.max_steps_off_policy >= 1 only, the sampler ahead of training.
        self._builder: StepBatchBuilder | None = None
        self._feed: ProblemFeed | None = None
        self._ahead: AheadBatches | None = None
        self.checkpoints = CheckpointManager(self.run_dir, keep_last=config.checkpoint.keep_last)
        self.metrics = MetricsLog(self.run_dir / METRICS_FILE)
        self.trajectories = TrajectoryLog(
            self.run_dir / TRAJECTORIES_FILE, config.logging.trajectory_groups_per_step, config.train.seed
        )

    # -- setup -----------------------------------------------------------------------------------
    def _prepare_run_dir(self) -> None:
        if self.resume:
            if not (self.run_dir / CONFIG_FILE).is_file():
                raise RunDirError(f"{self.run_dir} holds no run to resume (no {CONFIG_FILE})")
        elif (self.run_dir / METRICS_FILE).exists() or (self.run_dir / "checkpoints").exists():
            raise RunDirError(
                f"{self.run_dir} already holds a run; resume it with --resume {self.run_dir} "
                "or choose another --run-dir"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Always (re)write the config actually in force; a resume with --set overrides records them.
        write_text_atomic(self.run_dir / CONFIG_FILE, dump_config(self.config))

    def _run_config(self) -> Config:
        """The config the components are built from: the run folder actually in use (``--run-dir`` /
        ``--resume`` may differ from ``train.run_dir``) holds the backend's own checkpoint folder."""
        cfg = self.config
        return cfg.model_copy(update={"train": cfg.train.model_copy(update={"run_dir": str(self.run_dir)})})

    def _build_components(self) -> Components:
        if self.source is None:
            self.source = source_from_config(self.config)
        self.source.problems("train")  # read the data first: a bad path fails before any process starts
        if self.components is None:
            self.components = build_components(self._run_config())
            self._owns_components = True
        return self.components

    @property
    def _backend(self) -> TrainingClient:
        """The components' backend: behind the retry guard as ``[retry]`` says when ``build_components``
        made it (a caller's components bring their own)."""
        assert self.components is not None, "components are built when the run starts"
        return self.components.backend

    async def _restore(self) -> Restored:
        """Load the latest checkpoint (when resuming); return what the run starts from."""
        seed = self.config.data.seed
        if not self.resume:
            return Restored(0, DataPosition(seed=seed))
        ckpt = self.checkpoints.latest()
        if ckpt is None:
            logger.info("no checkpoint in %s: starting from step 0", self.run_dir)
            repair_metrics(self.metrics.path, TrainerState(step=0, data_position={}))
            return Restored(0, DataPosition(seed=seed))
        state, rng, backend_path = CheckpointManager.load(ckpt)
        queued = CheckpointManager.load_pipeline(ckpt, PipelineState)
        selection = CheckpointManager.load_selection(ckpt)
        await self._backend.load_state_async(backend_path)
        restore_rng(rng)
        dropped = repair_metrics(self.metrics.path, state)
        logger.info(
            "resumed from %s (step %d, %d batch(es) sampled ahead); dropped %d metrics line(s) written after it",
            ckpt,
            state.step,
            len(queued.batches) if queued is not None else 0,
            dropped,
        )
        return Restored(state.step, DataPosition.from_dict(state.data_position), queued, selection)

    async def _check_backend(self) -> None:
        """Once per run, after any checkpoint is loaded (PyTRIO loads state only before training): a
        remote backend measures how its service normalises the loss, or refuses to train. No-op locally."""
        cfg = self.config
        self._tis_cap = resolve_tis_cap(cfg.loss.tis_cap, self._backend)
        self._measures_ref_kl = _reference_kl_available(cfg, self._backend)
        await self._backend.check_reduction_async(cfg.loss.name, _loss_config(cfg, self._tis_cap))

    async def _save_backend(self, folder: Path, name: str) -> tuple[str, bool]:
        if self.config.backend.kind == "local":
            return await self._backend.save_state_async(str(folder / "backend")), True
        # Remote services keep the state themselves and hand back a URI; names must be simple.
        safe = re.sub(r"[^A-Za-z0-9._-]", "-", f"{self.run_dir.name}-{name}").strip(".-") or name
        return await self._backend.save_state_async(safe), False

    # -- the loop --------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stop_requested:
            raise KeyboardInterrupt
        self._stop_requested = True
        logger.warning("signal %d: finishing this step, saving a checkpoint, then stopping", signum)

    async def _start(self) -> tuple[Restored, Tracker]:
        """Open the tracker, build (or take) the components, restore a checkpoint, check the backend."""
        self._prepare_run_dir()
        # The tracker first: one that cannot start stops the run before any work (``retool.train.trackers``).
        tracker = self._tracker or open_tracker(self.config, self.run_dir, self.resume)
        self._open_tracker = tracker
        try:
            self._build_components()
            restored = await self._restore()
            await self._check_backend()
        except BaseException:
            tracker.close()
            await self._close_components()
            raise
        return restored, tracker

    def _problem_order(self, position: DataPosition, selection: JsonObject | None) -> ProblemOrder:
        """The order problems are drawn in (``data.selection``), resumed at ``position`` / ``selection``:
        the source's epochs, or by estimated pass rate (``retool.train.selection``)."""
        cfg, source = self.config, self.source
        assert source is not None
        if cfg.data.selection == "epoch":
            return ProblemStream(source.epoch, seed=position.seed, position=position)
        return PassRateSelector(
            source.problems("train"),
            source.category,
            cfg.data.pass_rate,
            group_size=cfg.rollout.group_size,
            seed=position.seed,
            state=selection,
        )

    def _sampling(self, restored: Restored) -> None:
        """This run's step batch builder and problem feed, resumed where ``restored`` left them; for
        k >= 1 also the ahead-sampler (started), holding the batches the checkpoint kept (stale ones
        requeued)."""
        cfg, parts, source = self.config, self.components, self.source
        assert parts is not None and source is not None
        start_step, queued = restored.step, restored.queued
        k = cfg.train.max_steps_off_policy
        batches = [b for b in queued.batches if b.step <= cfg.train.steps] if queued is not None else []
        if batches and [b.step for b in batches] != list(
            range(start_step + 1, start_step + 1 + len(batches))
        ):
            raise RunDirError(
                f"the checkpoint of step {start_step} holds batches of steps {[b.step for b in batches]}"
            )
        batches, replay, self._requeued = requeue_stale(batches, queued.replay if queued else [], k)
        # The order resumes after the last batch the checkpoint kept, not after the requeued ones.
        resume_at, selection = restored.position, restored.selection
        if batches:
            last = batches[-1]
            resume_at, selection = last.position, last.order.state if last.order is not None else None
        order = self._problem_order(resume_at, selection)
        tools = GroupRollouts.from_parts(source, parts, cfg, rollout_fn=self._rollout_fn)
        text = None  # the text-only share's parts: the tool protocol's text-only twin, no executor
        if cfg.rollout.text_only_share > 0:
            text_parts = parts.for_mode(False)
            text = GroupRollouts.from_parts(source, text_parts, cfg, tools=False, rollout_fn=self._rollout_fn)
        self._builder = StepBatchBuilder(tools, text, cfg.rollout, cfg.filters, seed=cfg.train.seed)
        self._feed = ProblemFeed(order, replay)
        if k >= 1:
            self._ahead = AheadBatches(
                self._builder,
                self._feed,
                max_steps_off_policy=k,
                first_step=start_step + 1,
                last_step=cfg.train.steps,
                restored=batches,
            )
            self._ahead.start()
        else:  # every restored batch is at least one version old, so requeued: none is left to hold
            assert not batches, "a synchronous run holds no batch sampled ahead"

    async def run_async(self) -> TrainSummary:
        cfg = self.config
        restored, tracker = await self._start()
        start_step = restored.step
        progress = Progress(cfg.train.steps, start_step, enabled=cfg.logging.progress)
        installed = _install_signals(self._on_signal)
        step = start_step
        last: MetricsRecord = {}
        try:
            self._sampling(restored)
            while step < cfg.train.steps and not self._stop_requested:
                step += 1
                last = await self._one_step(step, tracker)
                progress.update(step, last)
                if self._on_step is not None:
                    self._on_step(step, last)
        finally:
            if self._ahead is not None:
                await self._ahead.aclose()
            progress.close()
            tracker.close()
            _restore_signals(installed)
            await self._close_components()
        return TrainSummary(self.run_dir, start_step, step, self._stop_requested, last)

    async def _current_policy(self) -> SamplingClient:
        """A sampling client over the current weights: a frozen one when later steps sample while this one
        trains (the local backend's own sampling client is a live view of its weights)."""
        backend = self._backend
        if self.config.train.max_steps_off_policy > 0:
            return await backend.frozen_sampling_client_async()
        return await backend.sampling_client_async()

    async def _one_step(self, step: int, tracker: Tracker) -> MetricsRecord:
        """One RL step, top to bottom: sample this step's groups, build the datums (the filters drop what
        they leave out), train, log; checkpoint when due. Returns the step's metrics line."""
        cfg, parts = self.config, self.components
        assert parts is not None
        t_step = t0 = time.perf_counter()
        # 1. Sample this step's groups with the policy over the current weights (version step - 1); with
        # k >= 1 they were sampled while earlier steps trained, on an older version.
        policy = await self._current_policy()
        times = {"time/refresh": time.perf_counter() - t0}
        t0, queued = time.perf_counter(), 0
        if self._ahead is None:
            assert self._builder is not None and self._feed is not None, "set when the run starts"
            batch = await self._builder.batch(step, self._feed, step - 1, policy)
        else:
            self._ahead.submit(step - 1, policy)
            queued = self._ahead.ready()
            batch = await self._ahead.batch_for(step)
        times["time/wait"] = time.perf_counter() - t0  # the trainer idle, waiting for its batch
        times["time/rollout"] = batch.seconds
        # 2. Filter and build the datums; every sampled group is recorded, the datums mark the trained ones.
        filters = cfg.filters
        collected = batch.collected
        data = build_step_data(
            collected.groups,
            informative=collected.group_informative,
            drop_void=filters.void_turn,
            drop_overlong=filters.overlong,
        )
        self.trajectories.write_step(step, collected.sampled, data, collected.origin, parts.protocol.decode)
        # 3. Train: forward-backward over micro-batches, one optimizer step.
        result = await train_step(
            self._backend,
            data.datums,
            loss_fn=cfg.loss.name,
            loss_config=_loss_config(cfg, self._tis_cap, self._ref_kl_due(step)),
            adam=adam_params_from_config(cfg),
            micro_batch_tokens=cfg.backend.micro_batch_tokens,
        )
        # 4. Log: the metrics line (checkpointed with the step when one is due), the tracker.
        faults = fault_counters(self._backend, parts.executor, parts.verifier)
        assert self.source is not None
        record = _step_record(step, batch, data, result, times, faults, self.source.category)
        record.update(pipeline_metrics(batch, step - 1, queued, self._requeued))
        self._check_sampler(step, record)
        if self._checkpoint_due(step):
            await self._checkpoint(step, record, t_step)
        else:
            record["time/step"] = time.perf_counter() - t_step
        self.metrics.append(record)
        tracker.log(scalars_of(record), step)
        return record

    def _ref_kl_due(self, step: int) -> bool:
        """Measure the KL to the starting policy this step: every ``train.ref_kl_every`` steps, where the
        backend can (the ``loss.ref_kl_coef`` penalty measures it every step anyway)."""
        every = self.config.train.ref_kl_every
        return self._measures_ref_kl and every > 0 and step % every == 0

    def _checkpoint_due(self, step: int) -> bool:
        """Every ``checkpoint.every`` steps, after the last one, and when a signal asked the run to stop."""
        every = self.config.checkpoint.every
        return (every > 0 and step % every == 0) or step == self.config.train.steps or self._stop_requested

    def _check_sampler(self, step: int, record: MetricsRecord) -> None:
        """A step trained on-policy (lag 0) measures how far the sampler's logprobs are from the trainer's
        on the same weights: float rounding, or an engine's numerics (bf16). Far more means the sampler
        did not sample from the weights it was said to (the weight sync failed, or a frozen copy was taken
        at the wrong moment). Reported as ``offpolicy/sampler_check_failed`` with an error in the log."""
        tol = self.config.train.sampler_check_tol
        diff = record.get("offpolicy/logprob_diff_mean")
        failed = (
            tol > 0 and diff is not None and record.get("offpolicy/lag_max") == 0.0 and as_number(diff) > tol
        )
        record["offpolicy/sampler_check_failed"] = float(failed)
        if failed:
            logger.error(
                "step %d: trained on-policy, yet the sampler's logprobs differ from the trainer's by %.4f on "
                "average (train.sampler_check_tol = %g): the sampler is not sampling from the trained weights",
                step,
                diff,
                tol,
            )

    async def _checkpoint(self, step: int, record: MetricsRecord, t_step: float) -> None:
        """Save weights, optimizer, RNG, data position and the batches sampled for later steps (after
        waiting for those the schedule has started: see ``retool.train.ahead``), atomically."""
        t0 = time.perf_counter()
        tmp = self.checkpoints.begin(step)
        try:
            backend_path, is_local = await self._save_backend(tmp, CheckpointManager.name_for(step))
        except Exception as exc:  # a full disk surfaces as OSError, or as torch's / safetensors' own errors
            raise self.checkpoints.write_error(step, "saving the backend state", tmp, exc) from exc
        if self._ahead is None:
            feed = self._feed
            assert feed is not None, "set when the run starts"
            queued = PipelineState(0, [], list(feed.replay))
            position, order = feed.position, feed.snapshot()
        else:
            queued, position, order = await self._ahead.drain(step + self._ahead.k)
        extra = checkpoint_entry(self._open_tracker)  # a resume reopens the tracker run
        if queued.batches or queued.replay:  # a synchronous run's checkpoint stays as it always was
            self.checkpoints.write_pipeline(tmp, step, queued)
            extra["pipeline"] = {"batches": [b.step for b in queued.batches], "replay": len(queued.replay)}
        if order is not None:
            self.checkpoints.write_selection(tmp, step, order.state)
        # The metrics line travels inside the checkpoint, so it carries the checkpoint's own cost.
        record["time/checkpoint"] = time.perf_counter() - t0
        record["time/step"] = time.perf_counter() - t_step
        state = TrainerState(
            step=step,
            data_position=position.to_dict(),
            metrics_line=record,
            metrics_offset=self.metrics.offset(),
            extra=extra,
        )
        self.checkpoints.commit(tmp, state, backend_path, is_local)
        logger.info("checkpoint %s saved", CheckpointManager.name_for(step))

    async def _close_components(self) -> None:
        """Close the components this trainer built (components passed in belong to the caller)."""
        if self._owns_components and self.components is not None:
            await self.components.aclose()

    def run(self) -> TrainSummary:
        return asyncio.run(self.run_async())


def resolve_tis_cap(setting: float | str, backend: TrainingClient) -> float:
    """``loss.tis_cap``: a number as set; ``auto``: ``DEFAULT_TIS_CAP`` when the backend's sampler and
    trainer differ in numerics by design (``TrainingClient.precision_mismatch``), else 0 (off)."""
    if not isinstance(setting, str):
        return float(setting)
    why = backend.precision_mismatch
    if why is None:
        return 0.0
    logger.info("loss.tis_cap = auto: truncated importance sampling on (cap %g): %s", DEFAULT_TIS_CAP, why)
    return DEFAULT_TIS_CAP


def _reference_kl_available(cfg: Config, backend: TrainingClient) -> bool:
    """Whether ``policy/ref_kl`` can be measured on ``backend``; a ``loss.ref_kl_coef`` penalty it cannot
    compute stops the run (the config refuses the usual causes already: a remote backend, no LoRA)."""
    why = backend.reference_kl_unavailable
    if why is not None and cfg.loss.ref_kl_coef > 0:
        raise ConfigError(f"loss.ref_kl_coef = {cfg.loss.ref_kl_coef:g} needs the starting policy: {why}")
    if why is not None and cfg.train.ref_kl_every > 0:
        logger.info("policy/ref_kl (KL to the starting policy) is not measured: %s", why)
    return why is None


def _loss_config(cfg: Config, tis_cap: float = 0.0, measure_ref_kl: bool = False) -> dict[str, float] | None:
    """The loss config the backend gets: the policy loss's (``_policy_loss_config``), with the KL-to-start
    penalty when ``loss.ref_kl_coef`` > 0, else a request to measure that KL when ``measure_ref_kl``."""
    out = _policy_loss_config(cfg, tis_cap)
    if cfg.loss.ref_kl_coef > 0:
        return {**(out or {}), "ref_kl_coef": cfg.loss.ref_kl_coef}
    if measure_ref_kl:
        return {**(out or {}), "measure_ref_kl": 1.0}
    return out


def _policy_loss_config(cfg: Config, tis_cap: float) -> dict[str, float] | None:
    """The policy loss's own config; ``tis_cap`` (resolved) only where > 0 and the loss reads it."""
    loss = cfg.loss
    if loss.name in ("ppo", "importance_sampling") and tis_cap > 0:
        clips = {"clip_low": loss.clip_low, "clip_high": loss.clip_high}
        return {**clips, "tis_cap": tis_cap}
    if loss.name in ("ppo", "cispo", "gspo"):
        return {"clip_low": loss.clip_low, "clip_high": loss.clip_high}
    if loss.name == "dro":
        return {"beta": loss.beta}
    if loss.name == "stable_reinforce":  # the sampler's own logprobs are the recorded stability info
        return {"kl_coeff": loss.kl_coeff, "ratio_cap": loss.ratio_cap}
    return None


def _step_record(
    step: int,
    batch: Batch,
    data: StepData,
    result: TrainStepResult,
    times: dict[str, float],
    faults: dict[str, float],
    category_of: Callable[[Problem], str],
) -> MetricsRecord:
    """The step's metrics line (``time/step`` and ``time/checkpoint`` are filled in by the caller)."""
    collected = batch.collected
    sampled = collected.sampled
    record: MetricsRecord = {"step": step}
    record.update(rollout_metrics(sampled))
    record.update(category_pass_rates(collected.problems, sampled, category_of))
    record.update(result.metrics())
    record.update(collected.metrics())
    record.update(collected.roc_metrics())
    n_sampled = len(sampled)
    n_degenerate = n_sampled - collected.informative
    record["task/degenerate_group_rate"] = n_degenerate / n_sampled if n_sampled else 0.0
    record["task/degenerate_groups"] = float(n_degenerate)
    n_trained_trajs = data.n_trajectories or 1
    record["filter/void_rate"] = data.n_void / n_trained_trajs
    record["filter/overlong_rate"] = data.n_overlong / n_trained_trajs
    record["sampling/text_only_groups"] = float(
        sum(1 for g in sampled if g and not retool_outcome(g[0].outcome).use_tools)
    )
    record["tokens/trained"] = float(sum(1 for d in data.datums for w in d.weights if w != 0.0))
    record.update(times)
    record["time/train"] = result.seconds
    record["time/checkpoint"] = 0.0
    record["data/epoch"] = float(batch.position.epoch)
    record["data/index"] = float(batch.position.index)
    if batch.order is not None:
        record.update(batch.order.metrics)
    record.update(faults)
    record["problem_ids"] = [p.id for p in collected.problems]
    record["rewards"] = [[float(t.reward) for t in g] for g in sampled]
    return record


class TrainerParts(TypedDict, total=False):
    """What ``run_training`` may inject into its ``Trainer`` (the keyword-only parameters)."""

    source: ProblemSource | None
    components: Components | None
    rollout_fn: RolloutFn
    tracker: Tracker | None
    on_step: StepHook | None


SignalHandler = Callable[[int, FrameType | None], None]
# What ``signal.signal`` hands back: a handler, SIG_DFL / SIG_IGN, or None (not installed from Python).
PreviousHandler = Callable[[int, FrameType | None], object] | int | None


def _install_signals(handler: SignalHandler) -> dict[int, PreviousHandler]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous: dict[int, PreviousHandler] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)
    return previous


def _restore_signals(previous: dict[int, PreviousHandler]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def run_training(
    config: Config, run_dir: str | Path, resume: bool = False, **parts: Unpack[TrainerParts]
) -> TrainSummary:
    """Train (or resume) one run; see ``Trainer`` for what ``parts`` may inject."""
    return Trainer(config, run_dir, resume=resume, **parts).run()


def load_run_config(
    config_source: str | None, run_dir: Path | None, resume: bool, overrides: Sequence[str]
) -> Config:
    """The config of a new run (file or preset + overrides) or of a resumed one (its saved config,
    unless a config is named explicitly)."""
    if resume and config_source is None:
        if run_dir is None:
            raise ConfigError("--resume needs a run folder")
        saved = run_dir / CONFIG_FILE
        if not saved.is_file():
            raise ConfigError(f"{run_dir} holds no run to resume (no {CONFIG_FILE})")
        return load_config(saved, list(overrides))
    return load_config(config_source, list(overrides))
