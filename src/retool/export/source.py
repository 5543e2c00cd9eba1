"""What ``retool export`` reads: a training run, one of its checkpoints, a recipe demo's folder or a model
folder, resolved to where the trained weights are and what the model card states about them.

Owns how each kind of folder is recognised and where its weights live:

- a training run (``retool train``): ``RUN/checkpoints/step_NNNNNN/`` (``retool.train.checkpoint``: the one
  ``latest`` names, or ``--step N``); the checkpoint's ``backend/`` folder holds a PEFT LoRA adapter
  (``adapter_model.safetensors``) over the model its ``trainer_state.json`` names, or a full fine-tuning's
  ``model.safetensors`` (``retool.backends.local.checkpoint_io``);
- a demo folder (``retool demo``): ``settings.json``, ``model_sft/`` and ``model_rl/`` (HF folders, LoRA
  merged, what the demo evaluated) and ``rl/`` (the RL run, over ``model_sft``); ``--step`` reads ``rl/``'s
  checkpoints; its evaluation table is the first part of ``report.md``;
- a model folder (``config.json``): written as it is, e.g. to convert it to GGUF.

Nothing here loads a model: ``retool.export.weights`` does, from the ``Weights`` found here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from retool.config import Config, ConfigError, load_config
from retool.export.errors import ExportError
from retool.jsonl import JsonObject
from retool.train.checkpoint import CHECKPOINTS, STATE_FILE, CheckpointError, CheckpointManager, TrainerState

logger = logging.getLogger(__name__)

ModelChoice = Literal["sft", "rl"]
# The demo pipeline's layout (retool.pipeline.run, a stage above this one; tests/test_export.py checks
# the names against it).
DEMO_SETTINGS, DEMO_REPORT, DEMO_RL_RUN = "settings.json", "report.md", "rl"
DEMO_MODELS: dict[str, str] = {"sft": "model_sft", "rl": "model_rl"}
RUN_CONFIG = "config.toml"  # retool.train.loop.CONFIG_FILE
BACKEND_FOLDER_META = "trainer_state.json"  # retool.backends.local.checkpoint_io.BACKEND_META_FILE
ADAPTER_FILE, FULL_WEIGHTS_FILE = "adapter_model.safetensors", "model.safetensors"


@dataclass(frozen=True)
class Weights:
    """Trained weights: ``base`` (a local folder or a Hub id; a GGUF file in it when ``gguf_file``), with a
    LoRA ``adapter`` folder (PEFT format) on top, or a full fine-tuning's ``full`` weights in its place, or
    neither (``base`` is the trained model itself, e.g. a demo's merged ``model_rl``)."""

    base: str
    gguf_file: str | None = None
    adapter: Path | None = None
    full: Path | None = None
    lora: JsonObject | None = None


@dataclass(frozen=True)
class ExportSource:
    """What SOURCE holds: the weights ``hf`` and ``gguf`` write, the adapter ``peft`` writes (None, with
    ``no_adapter`` saying why, when there is none) and the facts the model card states."""

    path: Path
    kind: Literal["run", "demo", "model"]
    what: str  # one phrase: "training run runs/x, checkpoint step 20"
    weights: Weights
    adapter: Weights | None
    no_adapter: str = ""
    step: int | None = None
    config: Config | None = None  # the run's config (a demo's: its settings' config)
    demo: JsonObject | None = None  # a demo's settings.json
    evaluation: str = ""  # markdown: the run's evaluation table, "" when it has none


def resolve_source(path: Path, step: int | None = None, model: ModelChoice | None = None) -> ExportSource:
    """The ``ExportSource`` of the folder ``path``; an ``ExportError`` in one line for anything else."""
    if not path.exists():
        raise ExportError(f"{path}: no such folder")
    if not path.is_dir():
        raise ExportError(f"{path} is a file: export takes a training run, demo or model folder")
    if _is_demo(path):
        return _demo_source(path, step, model or _default_model(path, step))
    if model is not None:
        raise ExportError(
            f"--model {model} names a demo's model; {path} is not a demo folder (no {DEMO_SETTINGS})"
        )
    run = _run_root(path)
    if run is not None:
        return _run_source(run, _checkpoint_folder(path, run, step))
    if (path / "config.json").is_file():
        if step is not None:
            raise ExportError(f"--step {step}: {path} is a model folder, not a training run with checkpoints")
        weights = Weights(base=str(path))
        return ExportSource(path, "model", f"model folder {path}", weights, None, _NOT_TRAINED, config=None)
    raise ExportError(
        f"{path} is neither a training run (checkpoints/), a demo folder ({DEMO_SETTINGS}, model_sft/, "
        "model_rl/) nor a model folder (config.json)"
    )


_NOT_TRAINED = "a model folder holds merged weights, no LoRA adapter"


def _is_demo(path: Path) -> bool:
    """A demo folder, or ``retool sft``'s (``model_sft/`` and its report, no settings)."""
    if (path / DEMO_SETTINGS).is_file():
        return any((path / name).exists() for name in (*DEMO_MODELS.values(), DEMO_RL_RUN))
    return (path / DEMO_MODELS["sft"] / "config.json").is_file()


def _default_model(demo: Path, step: int | None) -> ModelChoice:
    """``rl`` where the demo got to RL (or ``--step`` asks for an RL checkpoint), else ``sft``: a demo that
    stopped after its cold start, or ``retool sft``'s folder."""
    if step is not None or (demo / DEMO_MODELS["rl"] / "config.json").is_file():
        return "rl"
    return "rl" if CheckpointManager(demo / DEMO_RL_RUN).complete_checkpoints() else "sft"


def _run_root(path: Path) -> Path | None:
    """The run folder ``path`` is, or lies in (its ``checkpoints`` folder, one checkpoint); None if none."""
    if path.name == CHECKPOINTS:
        return path.parent
    if _is_checkpoint(path):
        return path.parent.parent
    if (path / CHECKPOINTS).is_dir() or (path / RUN_CONFIG).is_file() or (path / "metrics.jsonl").is_file():
        return path
    return None


def _is_checkpoint(folder: Path) -> bool:
    """A trainer checkpoint (its state records a backend state; the backend's own file does not)."""
    try:
        data = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "backend_state" in data


def _checkpoint_folder(path: Path, run: Path, step: int | None) -> Path:
    """The checkpoint to export: ``path`` itself when it is one, else the run's ``--step`` or latest."""
    if _is_checkpoint(path):
        if step is not None:
            raise ExportError(f"--step {step}: {path} is one checkpoint already; name its run folder instead")
        return path
    manager = CheckpointManager(run)
    complete = manager.complete_checkpoints()
    if not complete:
        raise ExportError(
            f"{run} holds no checkpoint (no complete {CHECKPOINTS}/step_*/): the run saved none yet "
            "(checkpoint.every), or this is not a training run folder"
        )
    if step is None:
        latest = manager.latest()
        assert latest is not None  # there are complete checkpoints
        return latest
    wanted = manager.root / CheckpointManager.name_for(step)
    if wanted not in complete:
        have = ", ".join(str(int(p.name.removeprefix("step_"))) for p in complete)
        raise ExportError(f"--step {step}: {run} has no checkpoint of that step (it has steps {have})")
    return wanted


def _run_source(run: Path, checkpoint: Path) -> ExportSource:
    weights, step = checkpoint_weights(checkpoint)
    what = f"training run {run}, checkpoint step {step}"
    adapter, why = (weights, "") if weights.adapter is not None else (None, _FULL_FT)
    return ExportSource(
        run, "run", what, weights, adapter, why, step, _run_config(run), evaluation=run_evaluation(run)
    )


_FULL_FT = "the run trained all weights (full fine-tuning, lora.enabled = false): there is no LoRA adapter"


def checkpoint_weights(checkpoint: Path) -> tuple[Weights, int]:
    """The weights a trainer checkpoint holds and its step (the backend folder's own record)."""
    try:
        state = TrainerState.from_json((checkpoint / STATE_FILE).read_text(encoding="utf-8"), checkpoint)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    if not state.backend_state_is_local:
        raise ExportError(
            f"checkpoint {checkpoint} is held by a remote service ({state.backend_state}): download its "
            "weights with the service's own tools, then export the model folder"
        )
    backend = Path(state.backend_state)
    backend = backend if backend.is_absolute() else checkpoint / backend
    try:
        meta = json.loads((backend / BACKEND_FOLDER_META).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(
            f"checkpoint {checkpoint}: its backend state {backend} is unreadable ({exc})"
        ) from None
    base = str(meta.get("model_path") or "")
    lora = meta.get("lora")
    if (backend / ADAPTER_FILE).is_file() and isinstance(lora, dict):
        return Weights(base, meta.get("gguf_file"), adapter=backend, lora=lora), state.step
    if (backend / FULL_WEIGHTS_FILE).is_file():
        return Weights(base, meta.get("gguf_file"), full=backend / FULL_WEIGHTS_FILE), state.step
    raise ExportError(
        f"checkpoint {checkpoint}: {backend} holds neither {ADAPTER_FILE} nor {FULL_WEIGHTS_FILE}"
    )


def _run_config(run: Path) -> Config | None:
    """The run's ``config.toml`` (what the card says about its data and settings); None if unreadable."""
    if not (run / RUN_CONFIG).is_file():
        return None
    try:
        return load_config(run / RUN_CONFIG)
    except (ConfigError, OSError, ValueError) as exc:
        logger.warning(
            "%s: unreadable (%s); the model card leaves the run's settings out", run / RUN_CONFIG, exc
        )
        return None


def _demo_source(demo: Path, step: int | None, model: ModelChoice) -> ExportSource:
    """A demo's SFT or RL model: the merged folder it evaluated, or with ``--step`` an RL checkpoint."""
    settings = _demo_settings(demo)
    name = "demo" if settings else "SFT run"  # retool sft's folder has no settings.json
    facts = ExportSource(
        demo,
        "demo",
        f"{name} {demo}",
        Weights(""),
        None,
        config=_settings_config(settings),
        demo=settings,
        evaluation=demo_evaluation(demo),
    )
    folder = demo / DEMO_MODELS[model]
    if model == "sft":
        if step is not None:
            raise ExportError(f"--step {step} picks an RL checkpoint; the demo's SFT model has one version")
        if not (folder / "config.json").is_file():
            raise ExportError(f"{demo} has no SFT model yet ({folder.name}/): the demo stopped before it")
        why = "the SFT model is saved merged (model_sft/, no LoRA adapter); export hf or gguf"
        return replace(facts, what=f"{name} {demo}, SFT model", weights=Weights(str(folder)), no_adapter=why)
    rl_run = demo / DEMO_RL_RUN
    has_checkpoints = bool(CheckpointManager(rl_run).complete_checkpoints())
    if step is None and (folder / "config.json").is_file():  # the merged model the demo evaluated
        adapter, at, why = _demo_adapter(demo, rl_run) if has_checkpoints else (None, None, _NO_RL_CHECKPOINT)
        what = f"demo {demo}, RL model" + (f" (step {at})" if at is not None else "")
        return replace(
            facts, what=what, weights=Weights(str(folder)), adapter=adapter, no_adapter=why, step=at
        )
    if not has_checkpoints:
        raise ExportError(
            f"{demo} has no RL model yet ({folder.name}/, {DEMO_RL_RUN}/{CHECKPOINTS}/): --model sft exports "
            "its SFT model"
        )
    weights, at = checkpoint_weights(_checkpoint_folder(rl_run, rl_run, step))
    weights = _rebased(weights, demo)
    adapter = weights if weights.adapter is not None else None
    what = f"demo {demo}, RL checkpoint step {at}"
    return replace(
        facts, what=what, weights=weights, adapter=adapter, no_adapter="" if adapter else _FULL_FT, step=at
    )


_NO_RL_CHECKPOINT = (
    f"the demo's {DEMO_RL_RUN}/{CHECKPOINTS} holds no checkpoint to take the LoRA adapter from"
)


def _demo_adapter(demo: Path, rl_run: Path) -> tuple[Weights | None, int, str]:
    """The adapter of the RL run's last checkpoint (None for full fine-tuning), its step, why none."""
    found, at = checkpoint_weights(_checkpoint_folder(rl_run, rl_run, None))
    if found.adapter is None:
        return None, at, _FULL_FT
    return _rebased(found, demo), at, ""


def _rebased(weights: Weights, demo: Path) -> Weights:
    """An RL checkpoint's weights over the demo's own ``model_sft``, where the recorded path is gone (the
    demo folder was moved since it ran)."""
    sft = demo / DEMO_MODELS["sft"]
    if Path(weights.base).exists() or not (sft / "config.json").is_file():
        return weights
    return Weights(str(sft), None, weights.adapter, weights.full, weights.lora)


def _demo_settings(demo: Path) -> JsonObject:
    """The demo's ``settings.json``; empty for ``retool sft``'s folder, which has none."""
    if not (demo / DEMO_SETTINGS).exists():
        return {}
    try:
        saved = json.loads((demo / DEMO_SETTINGS).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{demo / DEMO_SETTINGS}: unreadable ({exc})") from None
    if not isinstance(saved, dict):
        raise ExportError(f"{demo / DEMO_SETTINGS}: not a demo's settings (a JSON {type(saved).__name__})")
    return saved


def _settings_config(settings: JsonObject) -> Config | None:
    raw = settings.get("config")
    if not isinstance(raw, dict):
        return None
    try:
        return Config.model_validate(raw)
    except ValueError:  # an older version's settings: the card leaves them out
        return None


def demo_evaluation(demo: Path) -> str:
    """The demo's before/after table and its gain line: ``report.md`` up to its time split."""
    report = demo / DEMO_REPORT
    if not report.is_file():
        return ""
    parts = report.read_text(encoding="utf-8").split("\n\n")
    return "\n\n".join(p.strip() for p in parts if not p.lstrip().startswith("| phase |")).strip()


_EVAL_COLUMNS = (("average_at_n", "Average@N"), ("pass_at_n", "Pass@N"), ("format_rate", "Format"))


def run_evaluation(run: Path) -> str:
    """A table of the ``retool eval`` summaries saved inside the run folder (``*.summary.json``, two levels
    deep), one row each; "" when there are none."""
    rows = []
    for path in sorted([*run.glob("*.summary.json"), *run.glob("*/*.summary.json")]):
        try:
            summary = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        metrics = summary.get("metrics") if isinstance(summary, dict) else None
        if not isinstance(metrics, dict):
            continue
        settings = summary.get("settings") or {}
        cells = [
            f"{100 * float(metrics[k]):.1f}%" if isinstance(metrics.get(k), int | float) else "-"
            for k, _ in _EVAL_COLUMNS
        ]
        calls = metrics.get("mean_code_calls")
        cells.append(f"{float(calls):.2f}" if isinstance(calls, int | float) else "-")
        name = str(path.relative_to(run)).removesuffix(".summary.json")
        rows.append(
            f"| {name} | {settings.get('mode', '-')} | {metrics.get('problems', '-')} | "
            + " | ".join(cells)
            + " |"
        )
    if not rows:
        return ""
    header = "| eval | mode | problems | " + " | ".join(t for _, t in _EVAL_COLUMNS) + " | Code calls |"
    return "\n".join([header, "|" + "---|" * 7, *rows])
