"""Experiment trackers (``retool.train.trackers``): SwanLab and W&B in their files-only modes get every
scalar of ``metrics.jsonl``, in the run folder, in the same tracker run across a resume; a tracker that
cannot start is one line before any work, or a warning when not required; ``auto`` picks the mode."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from retool.config import Config, ConfigError, override_config
from retool.train.checkpoint import CheckpointManager, TrainerState
from retool.train.metrics import scalars_of
from retool.train.trackers import TrackerError, resolve_mode
from test_train_loop import FakeClient, fake_config, fake_rollouts, make_trainer
from tracker_files import merged, swanlab_dashboard, swanlab_resume_modes, swanlab_runs, wandb_runs
from train_harness import PhaseSignals

CREDENTIAL_VARS = (
    "SWANLAB_API_KEY",
    "SWANLAB_MODE",
    "SWANLAB_ROOT",
    "SWANLAB_SAVE_DIR",
    "SWANLAB_LOGDIR",
    "WANDB_API_KEY",
    "WANDB_IDENTITY_TOKEN_FILE",
    "WANDB_MODE",
    "WANDB_BASE_URL",
    "NETRC",
)


@pytest.fixture
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No tracker credentials or modes from this machine, a fresh HOME, and an empty working folder
    (returned) that must stay empty: trackers write into the run folder only."""
    for name in CREDENTIAL_VARS:
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def tracker_config(tracker: str, mode: str, steps: int = 2, every: int = 1, *extra: str) -> Config:
    return override_config(
        fake_config(steps=steps, every=every),
        [f"logging.tracker='{tracker}'", f"logging.tracker_mode='{mode}'", *extra],
    )


def jsonl_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl as metric -> step -> value (the scalars a tracker is given)."""
    out: dict[str, dict[int, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        for key, value in scalars_of(record).items():
            out.setdefault(key, {})[record["step"]] = value
    return out


def assert_same_scalars(tracked: dict[str, dict[int, float]], run_dir: Path) -> None:
    expected = jsonl_scalars(run_dir)
    assert len(expected) > 40 and set(tracked) == set(expected)
    for key, series in expected.items():
        assert tracked[key].keys() == series.keys(), key
        for step, value in series.items():
            assert math.isclose(tracked[key][step], value, rel_tol=1e-9, abs_tol=1e-12), (key, step)


def checkpointed_tracker(run_dir: Path) -> dict[str, str]:
    latest = CheckpointManager(run_dir).latest()
    assert latest is not None
    state = TrainerState.from_json((latest / "trainer_state.json").read_text(encoding="utf-8"))
    return state.extra["tracker"]


@pytest.mark.parametrize("mode", ["local", "offline"])
def test_swanlab_files_hold_every_metric_of_the_jsonl(clean_env: Path, tmp_path: Path, mode: str) -> None:
    pytest.importorskip("swanlab")
    if mode == "local":
        pytest.importorskip("swanboard")
    run_dir = tmp_path / "run"
    make_trainer(tracker_config("swanlab", mode), run_dir).run()
    runs = swanlab_runs(run_dir / "swanlog")
    assert len(runs) == 1
    assert_same_scalars(runs[0][1], run_dir)
    assert checkpointed_tracker(run_dir) == {"tracker": "swanlab", "run_id": runs[0][0], "mode": mode}
    if mode == "local":  # what `swanlab watch RUN_DIR/swanlog` shows
        (experiment,) = swanlab_dashboard(run_dir / "swanlog").values()
        assert_same_scalars(experiment, run_dir)
    assert list(clean_env.iterdir()) == []


def test_wandb_offline_files_hold_every_metric_of_the_jsonl(clean_env: Path, tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    make_trainer(tracker_config("wandb", "offline"), run_dir).run()
    runs = wandb_runs(run_dir / "wandb")
    assert len(runs) == 1
    assert_same_scalars(runs[0][1], run_dir)
    assert checkpointed_tracker(run_dir) == {"tracker": "wandb", "run_id": runs[0][0], "mode": "offline"}
    assert list(clean_env.iterdir()) == []


@pytest.mark.parametrize(
    ("tracker", "mode", "read"),
    [("swanlab", "offline", "swanlog"), ("wandb", "offline", "wandb")],
)
def test_resume_appends_to_the_same_tracker_run(
    clean_env: Path, tmp_path: Path, tracker: str, mode: str, read: str
) -> None:
    pytest.importorskip(tracker)
    run_dir = tmp_path / "run"
    cfg = tracker_config(tracker, mode, 4, 100)  # checkpoints only where the run stops
    signals = PhaseSignals(cfg, sigint_at=["rollout:2"])  # SIGINT once step 2's first group is rolled out
    first = make_trainer(cfg, run_dir, rollout_fn=signals.rollouts(fake_rollouts)).run()
    assert first.interrupted and first.last_step == 2
    make_trainer(cfg, run_dir, resume=True).run()
    runs = (swanlab_runs if tracker == "swanlab" else wandb_runs)(run_dir / read)
    assert len(runs) == 2 and runs[0][0] == runs[1][0] == checkpointed_tracker(run_dir)["run_id"]
    assert {step for series in runs[1][1].values() for step in series} == {3, 4}
    assert_same_scalars(merged(runs), run_dir)
    if tracker == "swanlab":  # `swanlab sync` appends the second file to the first file's experiment
        assert swanlab_resume_modes(run_dir / read)[1] == "RESUME_MODE_ALLOW"


@pytest.mark.parametrize(("tracker", "mode"), [("swanlab", "cloud"), ("wandb", "online")])
def test_cloud_mode_without_credentials_is_one_line_before_any_work(
    clean_env: Path, tmp_path: Path, tracker: str, mode: str
) -> None:
    pytest.importorskip(tracker)
    client = FakeClient()
    run_dir = tmp_path / "run"
    with pytest.raises(TrackerError) as caught:
        make_trainer(tracker_config(tracker, mode), run_dir, client=client).run()
    message = str(caught.value)
    assert "\n" not in message and "credentials" in message and "logging.tracker_mode" in message
    assert client.refreshes == 0 and not (run_dir / "metrics.jsonl").exists()


def test_tracker_not_required_is_a_warning_and_the_run_goes_on(
    clean_env: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    cfg = tracker_config("wandb", "online", 2, 1, "logging.tracker_required=false")
    with caplog.at_level(logging.WARNING, logger="retool.train.trackers"):
        make_trainer(cfg, run_dir).run()
    assert "logging.tracker_required = false" in caplog.text and "credentials" in caplog.text
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    assert not (run_dir / "wandb").exists()
    latest = CheckpointManager(run_dir).latest()
    assert latest is not None
    state = TrainerState.from_json((latest / "trainer_state.json").read_text(encoding="utf-8"))
    assert "tracker" not in state.extra


@pytest.mark.parametrize("tracker", ["swanlab", "wandb"])
def test_disabled_mode_writes_nothing(clean_env: Path, tmp_path: Path, tracker: str) -> None:
    pytest.importorskip(tracker)
    run_dir = tmp_path / "run"
    make_trainer(tracker_config(tracker, "disabled"), run_dir).run()
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "checkpoints",
        "config.toml",
        "metrics.jsonl",
        "trajectories.jsonl",
    ]


@pytest.mark.slow  # W&B may take some 10 s past logging.tracker_timeout to give up (3-13 s measured)
def test_wandb_online_with_an_unreachable_server_fails_in_one_line(
    clean_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 86)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # the discard port: nothing listens
    client = FakeClient()
    cfg = tracker_config("wandb", "auto", 2, 1, "logging.tracker_timeout=3")
    with pytest.raises(TrackerError) as caught:
        make_trainer(cfg, tmp_path / "run", client=client).run()
    message = str(caught.value)
    assert "\n" not in message and message.startswith("W&B could not start in online mode")
    assert "logging.tracker_mode = 'offline'" in message and client.refreshes == 0


def test_cli_cloud_without_credentials_exits_2_with_one_line(clean_env: Path, tmp_path: Path) -> None:
    pytest.importorskip("swanlab")
    from retool.cli import app

    args = ["train", "-c", "tiny", "--run-dir", str(tmp_path / "run"), "--set", "train.steps=2"]
    args += ["--set", "logging.tracker=swanlab", "--set", "logging.tracker_mode=cloud"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: SwanLab cloud mode needs credentials"), lines


def test_auto_mode_follows_environment_then_credentials(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("swanlab")
    pytest.importorskip("wandb")
    swanboard = pytest.importorskip("swanboard")
    assert swanboard is not None
    assert resolve_mode("swanlab", "auto") == ("local", "no SwanLab credentials")
    assert resolve_mode("wandb", "auto") == ("offline", "no W&B credentials")
    assert resolve_mode("swanlab", "online") == ("cloud", "logging.tracker_mode")
    # Saved logins: SwanLab's ~/.swanlab/.netrc, W&B's ~/.netrc entry for its API host.
    saved = Path.home() / ".swanlab"
    saved.mkdir()
    (saved / ".netrc").write_text(
        "machine https://api.swanlab.cn\n  login user\n  password k" + "0" * 20 + "\n"
    )
    assert resolve_mode("swanlab", "auto") == ("cloud", "credentials found: saved SwanLab login")
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    (Path.home() / ".netrc").write_text(
        "machine wandb.example.org\n  login user\n  password " + "a" * 40 + "\n"
    )
    assert resolve_mode("wandb", "auto") == ("online", "credentials found: netrc")
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert resolve_mode("wandb", "auto") == ("offline", "WANDB_MODE")
    monkeypatch.setenv("SWANLAB_MODE", "nonsense")
    with pytest.raises(TrackerError, match="SWANLAB_MODE"):
        resolve_mode("swanlab", "auto")


def test_a_mode_the_tracker_does_not_have_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'local' is not a mode of wandb"):
        tracker_config("wandb", "local")
    with pytest.raises(ConfigError, match="'offline' is not a mode of tensorboard"):
        tracker_config("tensorboard", "offline")


def test_missing_package_is_one_line_and_auto_swanlab_without_dashboard_is_offline(
    clean_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("swanlab")
    import retool.train.trackers as trackers

    installed = trackers._has_package
    monkeypatch.setattr(
        trackers, "_has_package", lambda name: name not in ("wandb", "swanboard") and installed(name)
    )
    with pytest.raises(
        TrackerError, match=r"^logging.tracker = 'wandb' but the wandb package is not installed"
    ):
        make_trainer(tracker_config("wandb", "auto"), tmp_path / "a").run()
    mode, reason = resolve_mode("swanlab", "auto")
    assert mode == "offline" and "swanlab[dashboard]" in reason
    with pytest.raises(TrackerError, match="SwanLab local mode needs its dashboard package"):
        make_trainer(tracker_config("swanlab", "local"), tmp_path / "b").run()
