"""Where datasets live on this machine: one folder that every command reading a dataset by name looks in.

``retool data fetch NAME`` writes there (``retool.data.fetch``); the named evaluation sets, GSM8K, DAPO
and the benches read from there. The folder is an explicit ``--data-dir`` / ``data.data_dir`` when given,
else ``$RETOOL_DATA_DIR``, else the user's cache: ``$XDG_CACHE_HOME/retool/data`` (``~/.cache/retool/data``
when ``XDG_CACHE_HOME`` is unset). Nothing outside these is ever looked in.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "RETOOL_DATA_DIR"


def cache_data_dir() -> Path:
    """The user cache folder for datasets: ``$XDG_CACHE_HOME/retool/data``, else ``~/.cache/retool/data``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "retool" / "data"


def data_dir(explicit: str | Path | None = None) -> Path:
    """The data folder: ``explicit`` when given, else ``$RETOOL_DATA_DIR``, else ``cache_data_dir()``."""
    if explicit:
        return Path(explicit)
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env) if env else cache_data_dir()
