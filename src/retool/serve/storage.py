"""Where ``retool serve`` keeps what clients save, and how a client's name or URI becomes a folder.

Everything lives under one root folder (``--root``, default ``runs/serve``)::

    <root>/checkpoints/<run_id>/<kind>/<name>/   a saved state (``retool.backends.local.client`` format)
                                                 + ``serve.json`` (base model name, LoRA settings)

``kind`` is ``state`` (weights + optimizer, for ``load_state``) or ``sampler_weights`` (for samplers).
Clients see URIs ``<scheme>://<run_id>/<kind>/<name>`` (``trio://`` for PyTRIO, ``tinker://`` for Tinker);
both schemes name the same folders, so a path saved through one API loads through the other, and after a
restart, because everything a path needs is on disk.

Client-supplied names and URIs never reach the file system unchecked: every component must match
``SAFE_NAME`` (PyTRIO's own checkpoint-name rule: no ``/``, no leading ``.``, so no ``..``), the resolved
folder must lie inside the root, and no component of it may be a symbolic link.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

SAFE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,126}[A-Za-z0-9_-])?$")
KINDS = ("state", "sampler_weights")
SCHEMES = ("trio", "tinker")
META_FILE = "serve.json"


class StorageError(ValueError):
    """A name or path from a client that cannot be used (bad characters, outside the root, unknown)."""


@dataclass(frozen=True)
class LoraRequest:
    """The LoRA settings a client asked for (both SDKs send these fields)."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    def target_modules(self) -> tuple[str, ...]:
        """The module names the local backend adapts; a client asking for nothing trainable is refused."""
        modules: list[str] = []
        if self.train_attn:
            modules += ["q_proj", "k_proj", "v_proj", "o_proj"]
        if self.train_mlp:
            modules += ["gate_proj", "up_proj", "down_proj"]
        if self.train_unembed:
            modules.append("lm_head")
        if not modules:
            raise StorageError("LoRA must train at least one of attn, mlp, unembed")
        return tuple(modules)


@dataclass(frozen=True)
class CheckpointMeta:
    run_id: str
    kind: str
    name: str
    base_model: str
    lora: LoraRequest


def check_name(name: str, what: str = "name") -> str:
    if not isinstance(name, str) or not SAFE_NAME.match(name):
        raise StorageError(
            f"{what} {name!r} is not allowed: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(6)}"


class Storage:
    """The checkpoint folders under ``root`` (see the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        (self.root / "checkpoints").mkdir(parents=True, exist_ok=True)

    def folder(self, run_id: str, kind: str, name: str) -> Path:
        if kind not in KINDS:
            raise StorageError(f"checkpoint kind {kind!r} unknown; use {KINDS}")
        base = self.root / "checkpoints"
        folder = base / check_name(run_id, "run id") / kind / check_name(name, "checkpoint name")
        resolved = folder.resolve()
        if not resolved.is_relative_to(base):
            raise StorageError(f"checkpoint path {folder} leaves the server root")
        probe = folder
        while probe != base:  # a link planted inside the root could point anywhere
            if probe.is_symlink():
                raise StorageError(f"checkpoint path {folder} goes through a symbolic link")
            probe = probe.parent
        return folder

    def uri(self, scheme: str, run_id: str, kind: str, name: str) -> str:
        # Tinker's own paths say ``weights`` for a training state (``tinker://<run>/weights/<name>``).
        shown = "weights" if scheme == "tinker" and kind == "state" else kind
        return f"{scheme}://{run_id}/{shown}/{name}"

    def parse_uri(self, uri: str) -> tuple[str, str, str]:
        """``(run_id, kind, name)`` of a checkpoint URI of either scheme; the folder must exist."""
        if not isinstance(uri, str) or "://" not in uri:
            raise StorageError(f"checkpoint path {uri!r} is not a trio:// or tinker:// URI")
        scheme, rest = uri.split("://", 1)
        parts = rest.split("/")
        if scheme not in SCHEMES or len(parts) != 3:
            raise StorageError(f"checkpoint path {uri!r} is not <trio|tinker>://<run>/<kind>/<name>")
        kind = "sampler_weights" if parts[1] in ("sampler_weights", "weights_for_sampler") else parts[1]
        kind = "state" if kind == "weights" else kind
        folder = self.folder(parts[0], kind, parts[2])
        if not (folder / META_FILE).is_file():
            raise KeyError(f"no checkpoint {uri}")
        return parts[0], kind, parts[2]

    def write_meta(self, meta: CheckpointMeta) -> None:
        folder = self.folder(meta.run_id, meta.kind, meta.name)
        (folder / META_FILE).write_text(json.dumps(asdict(meta), indent=2) + "\n")

    def read_meta(self, uri: str) -> tuple[CheckpointMeta, Path]:
        run_id, kind, name = self.parse_uri(uri)
        folder = self.folder(run_id, kind, name)
        data = json.loads((folder / META_FILE).read_text())
        lora = LoraRequest(**data.pop("lora"))
        return CheckpointMeta(lora=lora, **data), folder

    def list(self, run_id: str | None = None) -> list[CheckpointMeta]:
        found: list[CheckpointMeta] = []
        for meta_file in sorted((self.root / "checkpoints").glob(f"{run_id or '*'}/*/*/{META_FILE}")):
            data = json.loads(meta_file.read_text())
            found.append(CheckpointMeta(lora=LoraRequest(**data.pop("lora")), **data))
        return found
