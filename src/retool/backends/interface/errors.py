"""The errors a backend reports to the user: an SDK or engine that cannot start, a setting it cannot take.

Raised by the remote adapters (``retool.backends.remote``) and by the optional samplers
(``retool.backends.samplers``: vLLM); both are ``UserError``s (one line, exit 2). ``sdk_label`` names an
SDK and its installed version for those messages.
"""

from __future__ import annotations

import importlib.metadata

from retool.errors import UserError


class BackendUnavailableError(UserError, RuntimeError):
    """The SDK of a managed backend is not installed or not configured (the message says how to fix it)."""


class SdkOptionError(BackendUnavailableError):
    """A setting the installed SDK (or the service behind it) cannot take; the message names it and the
    SDK version."""


def sdk_label(sdk: object) -> str:
    """``"pytrio 0.2.9"``: the SDK's distribution and installed version, for messages."""
    name = getattr(sdk, "__name__", type(sdk).__name__).split(".")[0]
    try:
        return f"{name} {importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{name} (version unknown)"
