"""How the adapters talk to an SDK they do not control: importing it (``import_sdk``), waiting for its
futures (``resolve``), refusing what its version cannot take (``check_sdk_kwargs``, ``call_kwargs``,
``build_model``, ``lora_flags``), reading its answers (``to_list``, ``grad_norm_of``,
``normalize_stop_reason``) and finding a tokenizer without it (``local_tokenizer``).

SDK futures are always resolved with ``.result()``: Tinker's futures *of clients* subclass the client
classes (``BackcompatTrainingClientFuture``), so using one as the client works only through deprecated
forwarders; we never stop at the wrapper.
"""

from __future__ import annotations

import importlib
import inspect
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from retool.backends.interface.errors import BackendUnavailableError, SdkOptionError

T = TypeVar("T")


def import_sdk(module: str, extra: str) -> ModuleType:
    # pytrio replaces sys.excepthook when imported; the CLI's own error reporting must survive that.
    hook = sys.excepthook
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"backend '{module}' needs the '{module}' SDK, which is not installed: "
            f"pip install 'retool-rl[{extra}]' (or set backend.kind=local)"
        ) from exc
    finally:
        sys.excepthook = hook


def resolve(obj: object, expect: str | None = None) -> Any:
    """Wait for an SDK future: call ``.result()`` until the object has none, then check it has ``expect``.

    Never stops early because the object already looks like the client: Tinker's future-of-client
    wrappers subclass the client, and every call through them is a deprecated forwarder.
    """
    for _ in range(4):
        result = getattr(obj, "result", None)
        if not callable(result):
            break
        obj = result()
    if expect is not None and not hasattr(obj, expect):
        raise TypeError(f"SDK returned {type(obj).__name__}, expected an object with .{expect}")
    return obj


def check_sdk_kwargs(fn: Callable[..., object], sdk: str, **kwargs: object) -> None:
    """Refuse a keyword ``fn`` does not declare: each one carries a setting, and dropping it would train
    with another one than the config says. ``SdkOptionError`` names them and the SDK version ``sdk``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a C function): the call itself will say
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [f"{k}={v!r}" for k, v in kwargs.items() if k not in params]
    if unknown:
        raise SdkOptionError(
            f"{sdk}: {getattr(fn, '__qualname__', fn)} takes no {', '.join(unknown)}; this SDK version "
            "cannot apply that setting. Upgrade the SDK, or change the config so it is not needed"
        )


def call_kwargs(fn: Callable[..., T], sdk: str, **kwargs: object) -> T:
    """``fn(**kwargs)`` after ``check_sdk_kwargs``: no keyword is ever dropped on the way."""
    check_sdk_kwargs(fn, sdk, **kwargs)
    return fn(**kwargs)


_ALIASES = {"learning_rate": ("lr",), "grad_clip_norm": ("grad_clip",)}


def build_model(cls: Callable[..., T], sdk: str, **kwargs: object) -> T:
    """Construct an SDK pydantic type: known aliases are renamed (``learning_rate`` -> ``lr``) where the
    version has the other name; a field it lacks is an ``SdkOptionError`` naming it and the SDK version
    ``sdk``, unless its value is ``None`` (not set: nothing is lost)."""
    fields = getattr(cls, "model_fields", None)
    if not fields:
        return cls(**kwargs)
    out: dict[str, object] = {}
    missing: list[str] = []
    for key, value in kwargs.items():
        name = key if key in fields else next((a for a in _ALIASES.get(key, ()) if a in fields), None)
        if name is not None:
            out[name] = value
        elif value is not None:
            missing.append(f"{key}={value!r}")
    if missing:
        raise SdkOptionError(
            f"{sdk}: {getattr(cls, '__name__', cls)} has no field for {', '.join(missing)}; this SDK "
            "version cannot apply that setting. Upgrade the SDK, or change the config so it is not needed"
        )
    return cls(**out)


def to_list(value: Any) -> list[float]:
    """A numeric sequence in an SDK answer (a tensor, ``TensorData``, a list; ``None``: empty) as a list."""
    if value is None:
        return []
    for attr in ("tolist", "to_list"):
        fn = getattr(value, attr, None)
        if callable(fn):
            return list(fn())
    data = getattr(value, "data", None)
    if data is not None:
        return list(data)
    return list(value)


def grad_norm_of(response: object) -> float:
    """The gradient norm an ``optim_step`` answer reports (``grad_norm:mean``, SkyRL's
    ``skyrl.ai/grad_norm``, ...), NaN when it reports none."""
    metrics = dict(getattr(response, "metrics", None) or {})
    return next((float(v) for k, v in metrics.items() if "grad_norm" in k), math.nan)


def normalize_stop_reason(reason: object) -> str:
    text = str(getattr(reason, "value", reason) or "").lower()
    return "length" if ("length" in text or "max" in text) else "stop"


# The layer groups the managed services train LoRA on, each as one switch; a group's modules under the
# names models use (separate or fused projections).
_LORA_GROUPS: dict[str, tuple[frozenset[str], ...]] = {
    "train_attn": (frozenset({"q_proj", "k_proj", "v_proj", "o_proj"}), frozenset({"qkv_proj", "o_proj"})),
    "train_mlp": (frozenset({"gate_proj", "up_proj", "down_proj"}), frozenset({"gate_up_proj", "down_proj"})),
    "train_unembed": (frozenset({"lm_head"}),),
}


def lora_flags(target_modules: Sequence[str]) -> dict[str, bool]:
    """The services' switches for ``lora.target_modules``. They train whole groups of layers, so a list
    that names part of a group, or a module in none, cannot be sent as it is: ``SdkOptionError``."""
    names = {m.split(".")[-1] for m in target_modules}
    known = set().union(*(s for sets in _LORA_GROUPS.values() for s in sets))
    flags = {flag: bool(names & set().union(*sets)) for flag, sets in _LORA_GROUPS.items()}
    partial = [
        flag for flag, sets in _LORA_GROUPS.items() if flags[flag] and not any(s <= names for s in sets)
    ]
    if names - known or partial or not any(flags.values()):
        groups = "; ".join(f"{flag}: {' + '.join(sorted(sets[0]))}" for flag, sets in _LORA_GROUPS.items())
        raise SdkOptionError(
            f"lora.target_modules = {sorted(names)} cannot be trained on a managed service, which trains "
            f"whole layer groups ({groups}); name every module of the groups to train"
            + (f" (not a group's: {sorted(names - known)})" if names - known else "")
        )
    return flags


def local_tokenizer(model_name: str) -> Any:
    """The model's tokenizer if it is on this machine (a local folder, or the Hugging Face cache), else
    ``None``. Never downloads: the SDKs would fetch it themselves, and offline runs must not try."""
    from transformers import AutoTokenizer  # deferred: transformers (~3 s) only when a client is built

    if Path(model_name).is_dir():
        return AutoTokenizer.from_pretrained(model_name)
    try:
        return AutoTokenizer.from_pretrained(model_name, local_files_only=True)
    except Exception:  # not cached (OSError), or not a Hub id at all (ValueError, HFValidationError)
        return None
