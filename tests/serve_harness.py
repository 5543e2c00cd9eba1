"""The serve tests' ``retool serve`` process: ``ServeProcess`` of ``bench/_harness.py``, the one the benches
start too (a real process on 127.0.0.1, a free port, on the CPU with one thread; always stopped)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _harness import REPO, ServeProcess  # bench/ is not a package

__all__ = ["REPO", "ServeProcess"]
