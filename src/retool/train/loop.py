"""The ReTool RL loop: refresh the sampler, roll out groups, train one step, log, checkpoint, repeat.

``Trainer`` owns the run folder::

    RUN_DIR/config.toml       the exact config (a resumed run reads it back)
    RUN_DIR/metrics.jsonl     one JSON object per finished step, with "step"
    RUN_DIR/trajectories.jsonl  sampled trajectories of each step (``retool.view.records``)
    RUN_DIR/tensorboard/      tracker events (when the tracker is TensorBoard)
    RUN_DIR/checkpoints/      see ``retool.train.checkpoint``

Exactness of resume: a step's problems come from a ``ProblemStream`` whose position is checkpointed;
sampling seeds derive from ``(train.seed, step)``; weights, optimizer and RNG come back from the
checkpoint; ``metrics.jsonl`` is cut back to the checkpoint's step. So a run killed at any moment and
resumed trains on the same problems in the same order as an uninterrupted one, losing only the steps
after its last checkpoint (which it redoes).

SIGINT / SIGTERM: the first one finishes the step in flight, saves a checkpoint and exits cleanly; a
second one aborts at once (resume then starts from the previous checkpoint).

Test hooks (environment variables, read once per run):
``RETOOL_TEST_KILL_AT=PHASE:STEP[,PHASE:STEP]`` sends SIGKILL to this process at a precise point;
``RETOOL_TEST_SIGINT_AT`` sends SIGINT instead. Phases: ``step`` (start of a step), ``rollout`` (the
first trajectory of the step finished), ``optim`` (after the backward passes, before the optimizer
step), ``checkpoint`` (checkpoint written, not yet renamed into place), ``metrics`` (after the step's
metrics line). ``RETOOL_TEST_REWARD=parity`` replaces each trajectory's reward by +1 / -1 from the
parity of its sampled tokens' sum, so an untrained tiny model gets non-degenerate groups.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retool.backends import adam_params_from_config
from retool.backends.guarded import guard_training_client
from retool.config import Config, ConfigError, dump_config, load_config
from retool.train.checkpoint import CheckpointManager, TrainerState, repair_metrics, restore_rng
from retool.train.collect import collect_groups, round_seed
from retool.train.datasource import DataPosition, DataSource, ProblemStream, make_source
from retool.train.metrics import (
    MetricsLog,
    Tracker,
    fault_counters,
    make_tracker,
    raise_if_step_lost,
    rollout_metrics,
    scalars_of,
)
from retool.train.progress import Progress
from retool.train.step import build_step_data, train_step
from retool.view.records import TRAJECTORIES_FILE, TrajectoryLog

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"

RewardFn = Callable[[Any], float]
RolloutFn = Callable[..., Awaitable[list[list[Any]]]]


class RunDirError(RuntimeError):
    """The run folder cannot be used as asked (exists without --resume, or holds no run to resume)."""


# --- test hooks ---------------------------------------------------------------------------------


def _parse_points(raw: str | None) -> set[tuple[str, int]]:
    points: set[tuple[str, int]] = set()
    for item in (raw or "").split(","):
        phase, sep, step = item.strip().partition(":")
        if sep and step.strip().isdigit():
            points.add((phase.strip(), int(step)))
    return points


class _Hooks:
    def __init__(self) -> None:
        self.kill = _parse_points(os.environ.get("RETOOL_TEST_KILL_AT"))
        self.sigint = _parse_points(os.environ.get("RETOOL_TEST_SIGINT_AT"))

    def __call__(self, phase: str, step: int) -> None:
        if (phase, step) in self.kill:
            logger.warning("test hook: SIGKILL at %s:%d", phase, step)
            os.kill(os.getpid(), signal.SIGKILL)
        if (phase, step) in self.sigint:
            self.sigint.discard((phase, step))
            logger.warning("test hook: SIGINT at %s:%d", phase, step)
            os.kill(os.getpid(), signal.SIGINT)


def parity_reward(traj: Any) -> float:
    """A fake reward that depends only on the sampled tokens (test hook ``RETOOL_TEST_REWARD=parity``)."""
    total = sum(sum(turn.completion_tokens) for turn in traj.turns)
    return 1.0 if total % 2 == 0 else -1.0


_TEST_REWARDS: dict[str, RewardFn] = {"parity": parity_reward}


# --- the trainer --------------------------------------------------------------------------------


@dataclass
class TrainSummary:
    run_dir: Path
    start_step: int
    last_step: int
    interrupted: bool
    last_metrics: dict[str, Any] = field(default_factory=dict)


def text_only_count(n_questions: int, share: float) -> int:
    """How many of a round's questions go text-only: ``share`` of them, rounded, at least one when
    ``share > 0`` and the round has two or more questions (a round of one stays in tool mode)."""
    if share <= 0.0 or n_questions < 2:
        return 0
    return min(n_questions - 1, max(1, round(share * n_questions)))


def rollout_seed(base_seed: int, step: int) -> int:
    """The sampling seed of a step: fixed by the run seed and the step, so a redone step samples alike."""
    return (base_seed * 1_000_003 + step * 7919) % (2**31 - 1)


class Trainer:
    """One training run. Components default to the configured ones; tests inject fakes.

    ``source``: a data source (default: from ``config.data``); ``client``: a TrainingClient (default:
    ``make_training_client(config)``); ``executor``, ``verifier``, ``protocol``: the rollout's
    collaborators; ``rollout_fn``: ``run_group_rollouts``-compatible coroutine; ``reward_fn``: rescore
    each finished trajectory (replaces ``traj.reward``) before advantages are computed; ``on_step``:
    called after every finished step with its metrics (for progress displays such as the demo's).
    """

    def __init__(
        self,
        config: Config,
        run_dir: str | Path,
        resume: bool = False,
        *,
        client: Any = None,
        source: DataSource | None = None,
        executor: Any = None,
        verifier: Any = None,
        protocol: Any = None,
        text_protocol: Any = None,
        rollout_fn: RolloutFn | None = None,
        reward_fn: RewardFn | None = None,
        tracker: Tracker | None = None,
        on_step: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> None:
        self.config = config
        self._on_step = on_step
        self.run_dir = Path(run_dir)
        self.resume = resume
        self._client = client
        self._source = source
        self._executor = executor
        self._verifier = verifier
        self._protocol = protocol
        self._text_protocol = text_protocol  # for rollout.text_only_share > 0
        self._rollout_fn = rollout_fn
        test_reward = os.environ.get("RETOOL_TEST_REWARD", "")
        if reward_fn is None and test_reward:
            if test_reward not in _TEST_REWARDS:
                raise ValueError(f"RETOOL_TEST_REWARD={test_reward!r}: known: {', '.join(_TEST_REWARDS)}")
            reward_fn = _TEST_REWARDS[test_reward]
        self._reward_fn = reward_fn
        self._tracker = tracker
        self._hooks = _Hooks()
        self._stop_requested = False
        self._owns_client = False
        self._owned: list[Any] = []  # components this trainer built, and so closes
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
        from retool.train.checkpoint import write_text_atomic

        write_text_atomic(self.run_dir / CONFIG_FILE, dump_config(self.config))

    def _resolve_tiny_model(self) -> None:
        """``model.name = "tiny"``: the tiny local model, built once into the run folder if not found."""
        cfg = self.config
        if cfg.model.name != "tiny" or cfg.backend.kind != "local" or Path("tiny").exists():
            return
        folder = self.run_dir / "tiny_model"
        if not (folder / "config.json").is_file():
            from retool.tasks.tinymodel import build_tiny_model

            logger.info("building the tiny model into %s", folder)
            build_tiny_model(folder, size="demo", seed=0)
        self.config = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name": str(folder)})})

    def _make_client(self) -> Any:
        from retool.backends import make_training_client

        # The client's own checkpoint folder follows the run folder actually in use (``--run-dir`` /
        # ``--resume`` may differ from ``train.run_dir``).
        cfg = self.config
        return make_training_client(
            cfg.model_copy(update={"train": cfg.train.model_copy(update={"run_dir": str(self.run_dir)})})
        )

    def _build_components(self) -> None:
        cfg = self.config
        if self._source is None:  # first: a bad data path fails before any process starts
            self._source = make_source(cfg)
        if self._client is None:
            self._resolve_tiny_model()
            self._client = self._make_client()
            self._owns_client = True
            cfg = self.config
        self._client = guard_training_client(self._client, cfg)  # timeouts + retries (retry.guard)
        if self._protocol is None:
            from retool.protocol import ChatProtocol

            self._protocol = ChatProtocol.from_config(self._client.tokenizer, cfg)
        if self._text_protocol is None and cfg.rollout.text_only_share > 0:
            from retool.protocol import ChatProtocol

            self._text_protocol = ChatProtocol.from_config(self._client.tokenizer, cfg, use_tools=False)
        if self._executor is None:
            from retool.sandbox import make_executor

            self._executor = make_executor(cfg.sandbox)
            self._owned.append(self._executor)
        if self._verifier is None:
            from retool.reward import Verifier

            self._verifier = Verifier.from_config(cfg.reward)
            self._owned.append(self._verifier)
        if self._rollout_fn is None:
            from retool.rollout import run_group_rollouts

            self._rollout_fn = run_group_rollouts

    async def _restore(self) -> tuple[int, DataPosition]:
        """Load the latest checkpoint (when resuming); return the completed step and data position."""
        seed = self.config.data.seed
        if not self.resume:
            return 0, DataPosition(seed=seed)
        ckpt = self.checkpoints.latest()
        if ckpt is None:
            logger.info("no checkpoint in %s: starting from step 0", self.run_dir)
            repair_metrics(self.metrics.path, TrainerState(step=0, data_position={}))
            return 0, DataPosition(seed=seed)
        state, rng, backend_path = CheckpointManager.load(ckpt)
        await self._client.load_state_async(backend_path)
        restore_rng(rng)
        dropped = repair_metrics(self.metrics.path, state)
        logger.info(
            "resumed from %s (step %d); dropped %d metrics line(s) written after it",
            ckpt,
            state.step,
            dropped,
        )
        return state.step, DataPosition.from_dict(state.data_position)

    async def _check_backend(self) -> None:
        """Once per run, after any checkpoint is loaded (PyTRIO loads state only before training): a
        remote backend measures how its service normalises the loss, or refuses to train. No-op locally."""
        from retool.backends.reduction import check_remote_reduction

        cfg = self.config
        loss_config = {"clip_low": cfg.loss.clip_low, "clip_high": cfg.loss.clip_high}
        await check_remote_reduction(
            self._client, cfg.loss.name, loss_config if cfg.loss.name == "ppo" else None
        )

    async def _save_backend(self, folder: Path, name: str) -> tuple[str, bool]:
        if self.config.backend.kind == "local":
            return await self._client.save_state_async(str(folder / "backend")), True
        # Remote services keep the state themselves and hand back a URI; names must be simple.
        safe = re.sub(r"[^A-Za-z0-9._-]", "-", f"{self.run_dir.name}-{name}").strip(".-") or name
        return await self._client.save_state_async(safe), False

    # -- the loop --------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._stop_requested:
            raise KeyboardInterrupt
        self._stop_requested = True
        logger.warning("signal %d: finishing this step, saving a checkpoint, then stopping", signum)

    async def run_async(self) -> TrainSummary:
        cfg = self.config
        self._prepare_run_dir()
        try:
            self._build_components()
            start_step, position = await self._restore()
            await self._check_backend()
            tracker = self._tracker or make_tracker(
                cfg.logging.tracker,
                self.run_dir,
                cfg.logging.project,
                cfg.model_dump(),
                resume_step=start_step + 1 if self.resume else None,
            )
        except BaseException:
            await self._close_components()
            raise
        assert self._source is not None
        stream = ProblemStream(self._source, seed=position.seed, position=position)
        progress = Progress(cfg.train.steps, start_step, enabled=cfg.logging.progress)
        installed = _install_signals(self._on_signal)
        step = start_step
        last: dict[str, Any] = {}
        try:
            while step < cfg.train.steps and not self._stop_requested:
                step += 1
                last = await self._one_step(step, stream, tracker)
                progress.update(step, last)
                if self._on_step is not None:
                    self._on_step(step, last)
                self._hooks("metrics", step)
        finally:
            progress.close()
            tracker.close()
            _restore_signals(installed)
            await self._close_components()
        return TrainSummary(self.run_dir, start_step, step, self._stop_requested, last)

    async def _one_step(self, step: int, stream: ProblemStream, tracker: Tracker) -> dict[str, Any]:
        cfg = self.config
        t_step = time.perf_counter()
        self._hooks("step", step)

        t0 = time.perf_counter()
        sampler = await self._client.sampling_client_async()  # on-policy: current weights
        t_refresh = time.perf_counter() - t0

        fired = False

        def on_trajectory(_traj: Any) -> None:
            nonlocal fired
            if not fired:
                fired = True
                self._hooks("rollout", step)

        async def rollout(problems: list[Any], seed: int, use_tools: bool) -> list[list[Any]]:
            assert self._rollout_fn is not None
            if not problems:
                return []
            return await self._rollout_fn(
                problems,
                sampler=sampler,
                protocol=self._protocol if use_tools else self._text_protocol,
                executor=self._executor if use_tools else None,
                verifier=self._verifier,
                rollout=cfg.rollout,
                sampling=cfg.sampling,
                group_size=cfg.rollout.group_size,
                seed=seed,
                use_tools=use_tools,
                on_trajectory=on_trajectory,
            )

        async def sample_round(problems: list[Any], round_index: int) -> list[list[Any]]:
            seed = round_seed(rollout_seed(cfg.train.seed, step), round_index)
            n_text = text_only_count(len(problems), cfg.rollout.text_only_share)
            split = len(problems) - n_text  # the last questions of a round go text-only
            tool_groups, text_groups = await asyncio.gather(
                rollout(problems[:split], seed, True), rollout(problems[split:], seed ^ 0x5EED, False)
            )
            groups = [*tool_groups, *text_groups]
            # A round lost entirely to a dead sampler or sandbox stops the run instead of burning steps.
            raise_if_step_lost(groups, step)
            if self._reward_fn is not None:
                for group in groups:
                    for traj in group:
                        traj.reward = float(self._reward_fn(traj))
            return groups

        t0 = time.perf_counter()
        collected = await collect_groups(
            sample_round, stream.next_batch, cfg.rollout.questions_per_step, cfg.filters
        )
        t_rollout = time.perf_counter() - t0

        data = build_step_data(
            collected.groups, drop_void=cfg.filters.void_turn, drop_overlong=cfg.filters.overlong
        )
        # Every sampled group may be shown; the datums mark which of them were trained.
        self.trajectories.write_step(
            step, collected.sampled, data.datums, getattr(self._protocol, "decode", None)
        )
        result = await train_step(
            self._client,
            data.datums,
            loss_fn=cfg.loss.name,
            loss_config={"clip_low": cfg.loss.clip_low, "clip_high": cfg.loss.clip_high}
            if cfg.loss.name == "ppo"
            else None,
            adam=adam_params_from_config(cfg),
            micro_batch_tokens=cfg.backend.micro_batch_tokens,
            before_optim=lambda: self._hooks("optim", step),
        )

        sampled = collected.sampled
        record: dict[str, Any] = {"step": step}
        record.update(rollout_metrics(sampled))
        record.update(result.metrics())
        record.update(collected.metrics())
        n_sampled = len(sampled)
        n_degenerate = n_sampled - collected.informative
        record["task/degenerate_group_rate"] = n_degenerate / n_sampled if n_sampled else 0.0
        record["task/degenerate_groups"] = float(n_degenerate)
        n_trained_trajs = data.n_trajectories or 1
        record["filter/void_rate"] = data.n_void / n_trained_trajs
        record["filter/overlong_rate"] = data.n_overlong / n_trained_trajs
        record["sampling/text_only_groups"] = float(
            sum(1 for g in sampled if g and not getattr(g[0], "use_tools", True))
        )
        record["tokens/trained"] = float(sum(1 for d in data.datums for w in d.weights if w != 0.0))
        record["time/refresh"] = t_refresh
        record["time/rollout"] = t_rollout
        record["time/train"] = result.seconds
        record["time/checkpoint"] = 0.0
        record["data/epoch"] = float(stream.position.epoch)
        record["data/index"] = float(stream.position.index)
        record.update(fault_counters(self._client, self._executor, self._verifier))
        record["problem_ids"] = [p.id for p in collected.problems]
        record["rewards"] = [[float(t.reward) for t in g] for g in sampled]

        every = cfg.checkpoint.every
        if (every > 0 and step % every == 0) or step == cfg.train.steps or self._stop_requested:
            await self._checkpoint(step, stream, record, t_step)
        else:
            record["time/step"] = time.perf_counter() - t_step
        self.metrics.append(record)
        tracker.log(scalars_of(record), step)
        return record

    async def _checkpoint(
        self, step: int, stream: ProblemStream, record: dict[str, Any], t_step: float
    ) -> None:
        t0 = time.perf_counter()
        tmp = self.checkpoints.begin(step)
        try:
            backend_path, is_local = await self._save_backend(tmp, CheckpointManager.name_for(step))
        except Exception as exc:  # a full disk surfaces as OSError, or as torch's / safetensors' own errors
            raise self.checkpoints.write_error(step, "saving the backend state", tmp, exc) from exc
        # The metrics line travels inside the checkpoint, so it carries the checkpoint's own cost.
        record["time/checkpoint"] = time.perf_counter() - t0
        record["time/step"] = time.perf_counter() - t_step
        state = TrainerState(
            step=step,
            data_position=stream.position.to_dict(),
            metrics_line=record,
            metrics_offset=self.metrics.offset(),
        )
        self.checkpoints.commit(tmp, state, backend_path, is_local, lambda: self._hooks("checkpoint", step))
        logger.info("checkpoint %s saved", CheckpointManager.name_for(step))

    async def _close_components(self) -> None:
        """Close what this trainer built (components passed in belong to the caller)."""
        for obj in self._owned:
            close = getattr(obj, "close", None)
            if close is not None:
                try:
                    await asyncio.to_thread(close)
                except Exception:  # closing must not hide the run's own error
                    logger.exception("closing %s failed", type(obj).__name__)
        if self._owns_client and self._client is not None:
            try:
                await self._client.close_async()
            except Exception:
                logger.exception("closing the training client failed")

    def run(self) -> TrainSummary:
        return asyncio.run(self.run_async())


def _install_signals(handler: Callable[[int, Any], None]) -> dict[int, Any]:
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)
    return previous


def _restore_signals(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def run_training(
    config: Config, run_dir: str | Path, resume: bool = False, **components: Any
) -> TrainSummary:
    """Train (or resume) one run; see ``Trainer`` for the injectable components."""
    return Trainer(config, run_dir, resume=resume, **components).run()


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
