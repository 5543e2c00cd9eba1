"""The project's own user-facing errors: something the user can fix, said in one line.

A ``UserError``'s message names what is wrong and how to fix it (a bad config, a missing file, a model
that cannot be loaded, a backend without credentials). The command line prints it as one line and exits
2, with no traceback unless ``--debug`` or ``RETOOL_DEBUG=1`` (``retool.cli``). Each stage's error types
that mean "fix your input" derive from it; a fault of the run itself (a dead worker, a failed write)
does not.
"""

from __future__ import annotations


class UserError(Exception):
    """An error the user can fix; its message says how (see the module docstring)."""


class ModelLoadError(UserError):
    """The model named by the config cannot be loaded: no such path, not in the Hugging Face cache while
    offline, or the Hub unreachable."""
