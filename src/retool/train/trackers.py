"""Experiment trackers: where each step's scalars go besides ``metrics.jsonl`` (``[logging]``).

``logging.tracker`` names one: ``tensorboard`` (events in ``RUN_DIR/tensorboard``), ``swanlab`` (the
chapter's tracker; files in ``RUN_DIR/swanlog``), ``wandb`` (files in ``RUN_DIR/wandb``) or ``none``.
``metrics.jsonl`` stays the record; a tracker is a view of it.

Modes (``logging.tracker_mode``) are the trackers' own: SwanLab ``cloud | local | offline | disabled``,
W&B ``online | offline | disabled``. ``auto`` (the default) takes the tracker's environment variable
(``SWANLAB_MODE`` / ``WANDB_MODE``) when set, else the cloud when the tracker's credentials are present
(a SwanLab API key or saved login; ``WANDB_API_KEY`` or a saved netrc entry), else the files-only mode:
SwanLab ``local`` (``offline`` when its dashboard package, swanboard, is missing), W&B ``offline``. The run
logs which mode it chose and why. Nothing is written to the current folder.

A tracker that cannot start (its package missing, a cloud mode without credentials, no network) raises
``TrackerError``, one line naming the setting to change, before any work starts; with
``logging.tracker_required = false`` it is a warning instead and the run goes on with ``metrics.jsonl``.

Resume: a tracker's run id goes into every checkpoint (``checkpoint_entry``) and a resumed run opens the
tracker run of its latest checkpoint again (SwanLab / W&B ``resume="allow"``), so a cloud run goes on in
the same tracker run and offline files carry the same id (``swanlab sync`` / ``wandb sync`` of all the
run's folders appends them in order). TensorBoard drops the events written after that checkpoint.
"""

from __future__ import annotations

import importlib.util
import logging
import netrc
import os
from pathlib import Path

from retool.config import TRACKER_MODES, Config, LoggingConfig
from retool.jsonl import JsonObject
from retool.train.checkpoint import STATE_FILE, CheckpointManager, TrainerState

logger = logging.getLogger(__name__)

SWANLAB_DIR = "swanlog"  # RUN_DIR/swanlog/run-<time>-<id>/
WANDB_DIR = "wandb"  # RUN_DIR/wandb/offline-run-<time>-<id>/ (W&B names the folder itself)
CHECKPOINT_KEY = "tracker"  # TrainerState.extra[CHECKPOINT_KEY]: {"tracker", "run_id", "mode"}

_CLOUD = {"swanlab": "cloud", "wandb": "online"}
_MODE_ENV = {"swanlab": "SWANLAB_MODE", "wandb": "WANDB_MODE"}
_MODE_ALIASES = {"swanlab": {"online": "cloud"}, "wandb": {"dryrun": "offline", "run": "online"}}
_TITLE = {"swanlab": "SwanLab", "wandb": "W&B", "tensorboard": "TensorBoard"}


class TrackerError(RuntimeError):
    """The configured tracker cannot start; the message (one line) says which setting to change."""


class Tracker:
    """Scalar sink. ``log`` takes the step's scalars; ``close`` flushes; ``checkpoint_entry`` is what a
    checkpoint stores so that a resume reopens the same tracker run (None: nothing to reopen)."""

    def log(self, scalars: dict[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass

    def checkpoint_entry(self) -> dict[str, str] | None:
        return None


class TensorBoardTracker(Tracker):
    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # deferred: torch is heavy, TensorBoard optional

        # purge_step drops events a killed run wrote after the checkpoint we resume from.
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class SwanLabTracker(Tracker):
    """One SwanLab run; ``run_id`` reopens an earlier one (resume)."""

    def __init__(self, spec: TrackerSpec, run_id: str | None) -> None:
        import swanlab  # deferred: optional package (the swanlab extra)

        self._swanlab = swanlab
        settings = swanlab.Settings(
            interactive=False,  # never prompt for a login: a missing key is our one-line error
            terminal=swanlab.Settings.Terminal(proxy_type="none"),  # leave stdout to the progress display
        )
        self._run = swanlab.init(
            mode="online" if spec.mode == "cloud" else spec.mode,  # SwanLab's own name for its cloud
            log_dir=str(spec.folder),
            project=spec.project,
            name=spec.run_name,
            id=run_id,
            resume="allow" if run_id else None,
            config=spec.config,
            settings=settings,
        )
        self._spec = spec

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._swanlab.log(scalars, step=step)

    def close(self) -> None:
        self._swanlab.finish()

    def checkpoint_entry(self) -> dict[str, str] | None:
        return {"tracker": "swanlab", "run_id": str(self._run.id), "mode": self._spec.mode}


class WandbTracker(Tracker):
    """One W&B run; ``run_id`` reopens an earlier one (resume)."""

    def __init__(self, spec: TrackerSpec, run_id: str | None, timeout: float) -> None:
        import wandb  # deferred: optional package (the wandb extra)

        # stdout stays the progress display's: no console capture, no history summary at the end.
        settings = wandb.Settings(init_timeout=timeout, console="off", quiet=True)
        self._run = wandb.init(
            mode=spec.mode,  # type: ignore[arg-type]
            dir=str(spec.folder.parent),  # W&B adds the "wandb" folder itself
            project=spec.project,
            name=spec.run_name,
            id=run_id,
            resume="allow" if run_id else None,
            config=spec.config,
            settings=settings,
        )
        self._spec = spec

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        import wandb  # deferred: optional package (the wandb extra)

        self._run.finish()
        # finish() returns once W&B's service process has the run's exit; the service writes the run
        # file after that, so it is shut down (when no other run uses it) to have the files complete on
        # disk when close() returns. A later wandb.init starts a new one.
        if wandb.run is None:
            wandb.teardown()

    def checkpoint_entry(self) -> dict[str, str] | None:
        return {"tracker": "wandb", "run_id": str(self._run.id), "mode": self._spec.mode}


class TrackerSpec:
    """What a SwanLab / W&B tracker opens with: its mode (and why), folder, project, run name, config."""

    def __init__(
        self, name: str, mode: str, reason: str, run_dir: Path, project: str, config: dict[str, object]
    ) -> None:
        self.name = name
        self.mode = mode
        self.reason = reason
        self.folder = run_dir / (SWANLAB_DIR if name == "swanlab" else WANDB_DIR)
        self.project = project
        self.run_name = run_dir.resolve().name
        self.config = config


def open_tracker(config: Config, run_dir: Path, resume: bool) -> Tracker:
    """The tracker ``[logging]`` asks for, open; on resume, the tracker run of the latest checkpoint.

    Raises ``TrackerError`` when it cannot start, unless ``logging.tracker_required`` is false (then a
    warning, and a tracker that logs nothing).
    """
    settings = config.logging
    try:
        return _open(
            settings, run_dir, config.model_dump(), latest_state(run_dir) if resume else None, resume
        )
    except TrackerError as exc:
        if settings.tracker_required:
            raise
        logger.warning("%s; going on with metrics.jsonl alone (logging.tracker_required = false)", exc)
        return Tracker()


def _open(
    settings: LoggingConfig,
    run_dir: Path,
    config: dict[str, object],
    state: TrainerState | None,
    resume: bool,
) -> Tracker:
    name = settings.tracker
    if name == "none":
        return Tracker()
    if name == "tensorboard":
        purge_step = (state.step if state is not None else 0) + 1 if resume else None
        return TensorBoardTracker(run_dir / "tensorboard", purge_step=purge_step)
    _require_package(name)
    mode, reason = resolve_mode(name, settings.tracker_mode)
    if mode == "disabled":
        logger.info("%s tracker disabled (%s): metrics go to metrics.jsonl only", _TITLE[name], reason)
        return Tracker()
    _check_mode(name, mode)
    spec = TrackerSpec(name, mode, reason, run_dir, settings.project, config)
    run_id = _checkpointed_run_id(state, name)
    try:
        tracker: Tracker = (
            SwanLabTracker(spec, run_id)
            if name == "swanlab"
            else WandbTracker(spec, run_id, settings.tracker_timeout)
        )
    except Exception as exc:  # whatever the SDK raises (no network, a bad key, a full disk)
        raise _start_error(spec, exc) from exc
    logger.info(_chosen_message(spec, run_id))
    return tracker


def resolve_mode(name: str, asked: str) -> tuple[str, str]:
    """The mode ``name`` runs in for ``logging.tracker_mode = asked``, and why (for the log line)."""
    if asked != "auto":  # the config checked it is one of the tracker's modes
        return _MODE_ALIASES[name].get(asked, asked), "logging.tracker_mode"
    env_name = _MODE_ENV[name]
    from_env = os.environ.get(env_name, "").strip().lower()
    if from_env:
        mode = _MODE_ALIASES[name].get(from_env, from_env)
        if mode not in TRACKER_MODES[name]:
            raise TrackerError(
                f"{env_name}={from_env!r} is not a mode of {name} (one of {', '.join(TRACKER_MODES[name])}); "
                f"unset it or set logging.tracker_mode"
            )
        return mode, env_name
    source = credentials_source(name)
    if source is not None:
        return _CLOUD[name], f"credentials found: {source}"
    if name == "swanlab" and not _has_package("swanboard"):
        return (
            "offline",
            "no SwanLab credentials; local mode needs swanboard (pip install 'swanlab[dashboard]')",
        )
    return ("local" if name == "swanlab" else "offline"), f"no {_TITLE[name]} credentials"


def _check_mode(name: str, mode: str) -> None:
    """Fail before opening what cannot work: a cloud mode without credentials, local without swanboard."""
    if mode == _CLOUD[name] and credentials_source(name) is None:
        login = (
            "SWANLAB_API_KEY or `swanlab login`" if name == "swanlab" else "WANDB_API_KEY or `wandb login`"
        )
        files_mode = "local" if name == "swanlab" else "offline"
        raise TrackerError(
            f"{_TITLE[name]} {mode} mode needs credentials and none were found ({login}); set "
            f"logging.tracker_mode = {files_mode!r} (or 'auto') to keep the files in the run folder"
        )
    if name == "swanlab" and mode == "local" and not _has_package("swanboard"):
        raise TrackerError(
            "SwanLab local mode needs its dashboard package (pip install 'swanlab[dashboard]'); "
            "or set logging.tracker_mode = 'offline'"
        )


def credentials_source(name: str) -> str | None:
    """Where the tracker's credentials come from (an environment variable, a saved login), or None."""
    if name == "swanlab":
        if os.environ.get("SWANLAB_API_KEY"):
            return "SWANLAB_API_KEY"
        import swanlab  # deferred: optional package (the swanlab extra)

        # Settings() reads what swanlab.init would: the environment, ./.env and the saved login (.netrc).
        return "saved SwanLab login" if swanlab.Settings().api_key else None
    for env_name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if os.environ.get(env_name):
            return env_name
    return "netrc" if _wandb_netrc_key() else None


def _wandb_netrc_key() -> str | None:
    """W&B's saved login (``wandb login`` writes a netrc entry for the API host)."""
    import wandb  # deferred: optional package (the wandb extra)

    host = os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url
    hostname = host.split("://", 1)[-1].split("/", 1)[0].split(":", 1)[0]
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc").expanduser()
    if not path.is_file():
        return None
    try:
        entry = netrc.netrc(str(path)).authenticators(hostname)
    except (netrc.NetrcParseError, OSError):
        return None
    return entry[2] if entry and entry[2] else None


def _require_package(name: str) -> None:
    if not _has_package(name):
        raise TrackerError(
            f"logging.tracker = {name!r} but the {name} package is not installed "
            f"(pip install 'retool-rl[{name}]'), or set logging.tracker to tensorboard / none"
        )


def _has_package(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _start_error(spec: TrackerSpec, exc: BaseException) -> TrackerError:
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    fix = (
        "check the network and the credentials, or set logging.tracker_mode = "
        f"{'local' if spec.name == 'swanlab' else 'offline'!r}"
        if spec.mode == _CLOUD[spec.name]
        else "or set logging.tracker to tensorboard / none"
    )
    return TrackerError(
        f"{_TITLE[spec.name]} could not start in {spec.mode} mode ({type(exc).__name__}: {first_line}); {fix}"
    )


def _chosen_message(spec: TrackerSpec, run_id: str | None) -> str:
    title = _TITLE[spec.name]
    resumed = f", resuming tracker run {run_id}" if run_id else ""
    if spec.mode == _CLOUD[spec.name]:
        where = "synced to the cloud"
    elif spec.name == "swanlab" and spec.mode == "local":
        where = f"files in {spec.folder}; view them with: swanlab watch {spec.folder}"
    elif spec.name == "swanlab":
        where = f"files in {spec.folder}; upload them with: swanlab sync {spec.folder}/run-*"
    else:
        where = f"files in {spec.folder}; upload them with: wandb sync {spec.folder}/offline-run-*"
    return f"{title} tracker: {spec.mode} mode ({spec.reason}){resumed}; {where}"


def latest_state(run_dir: Path) -> TrainerState | None:
    """The trainer state of the run's latest checkpoint (None: no checkpoint yet)."""
    latest = CheckpointManager(run_dir).latest()
    if latest is None:
        return None
    return TrainerState.from_json((latest / STATE_FILE).read_text(encoding="utf-8"), latest / STATE_FILE)


def _checkpointed_run_id(state: TrainerState | None, name: str) -> str | None:
    """The run id of ``name`` the checkpoint stored (a checkpoint of another tracker's run: None)."""
    entry = state.extra.get(CHECKPOINT_KEY) if state is not None else None
    if isinstance(entry, dict) and entry.get("tracker") == name and entry.get("run_id"):
        return str(entry["run_id"])
    return None


def checkpoint_entry(tracker: Tracker) -> JsonObject:
    """What to add to a checkpoint's ``TrainerState.extra`` for ``tracker`` (empty: nothing)."""
    entry = tracker.checkpoint_entry()
    return {CHECKPOINT_KEY: dict(entry)} if entry else {}
