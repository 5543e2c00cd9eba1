"""Whether a demo run folder is this run's: the settings a run is recorded with (``settings.json``), and
the two checks that read them back.

- ``--resume OUT`` continues a run only with the settings it was started with, but for where it runs and
  how it reports (``_RESUME_FREE``): ``check_resumable``.
- ``--reuse-sft SOURCE`` takes another run's SFT model (and its SFT evaluation) only when both agree on
  every setting that fixes the tasks and the SFT model (``_SFT_KEYS``, with the recipe's own options but
  its ``RL_ONLY`` ones): ``check_sft_reusable``.

Both refuse in one line naming the settings that differ, as ``--set`` takes them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from retool.evaluate.settings import setting_value, settings_differences
from retool.pipeline.settings import DemoSettings, RecipeOptions, recorded_settings

# Settings that fix the tasks and the SFT model: a run reusing another's SFT must agree on all of them.
OPTIONS_SLOT = "options"
_SFT_KEYS = (
    "seed",
    "size",
    "recipe",
    OPTIONS_SLOT,  # the recipe's options but its RL_ONLY ones (``_sft_keys``)
    "eval_temperature",
    "eval_modes",
    "config.model.name",
    "config.model.system_prompt",
    "config.lora",
    "config.data.seed",
    "config.data.options",
    "config.sft",
    "config.eval.val_n",
    "config.eval.seed",
    "config.backend.micro_batch_tokens",
)
# Of those, the ones that pick the held-out slice and its evaluation (seeded) rather than the SFT model's
# inputs: a run without a slice evaluation may differ in them from the run whose SFT model it reuses.
_SLICE_KEYS = frozenset({"seed", "config.data.seed", "config.eval.seed", "eval_modes"})
# Settings a resumed run may change: where it runs and how it reports, not what it computes.
_RESUME_FREE = frozenset({"out", "resume", "plots", "data_dir"})


def _sft_keys(options: RecipeOptions) -> list[str]:
    """``_SFT_KEYS`` with the recipe's options that fix the tasks or the SFT model in their slot."""
    own = [f"options.{name}" for name in options.names() if name not in options.RL_ONLY]
    return [k for key in _SFT_KEYS for k in (own if key == OPTIONS_SLOT else [key])]


def _shown(names: Sequence[str]) -> str:
    """Setting names as ``--set`` takes them: a recipe's option by its own name, not ``options.NAME``."""
    return ", ".join(name.removeprefix("options.") for name in names)


def check_resumable(out: Path, settings: DemoSettings) -> None:
    """``--resume out``: a demo run is there, started with ``settings`` (but ``_RESUME_FREE``)."""
    saved = out / "settings.json"
    if not saved.is_file():
        raise FileNotFoundError(f"--resume {out}: no demo run there (no settings.json)")
    earlier = recorded_settings(saved)
    mine = json.loads(json.dumps(settings.as_dict(), default=str))
    differ = settings_differences(earlier, mine, ignore=_RESUME_FREE)
    if differ:
        raise ValueError(
            f"--resume {out}: the run was started with other settings ({_shown(differ)}); "
            "resume with the same options"
        )


def check_sft_reusable(source: Path, settings: DemoSettings) -> None:
    """``--reuse-sft source``: a demo run whose tasks and SFT settings are ``settings``' own."""
    try:
        earlier = recorded_settings(source / "settings.json")
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--reuse-sft {source}: not a finished demo run ({exc})") from None
    mine = settings.as_dict()
    # A run that evaluates no held-out slice (eval_modes = ()) copies no evaluation: it may reuse the SFT
    # model of another seed (bench/gsm8k.py: one SFT model, RL of each seed from it).
    keys = [k for k in _sft_keys(settings.options) if settings.eval_modes or k not in _SLICE_KEYS]
    differ = [k for k in keys if setting_value(earlier, k) != setting_value(mine, k)]
    if differ:
        raise ValueError(f"--reuse-sft {source}: its settings differ in {_shown(differ)}")
