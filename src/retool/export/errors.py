"""The export stage's one error type: an input ``retool export`` cannot turn into the formats asked for."""

from __future__ import annotations

from retool.errors import UserError


class ExportError(UserError):
    """The export cannot be made from this input (no checkpoint, an architecture GGUF cannot hold, an output
    folder in the way, a full disk); the message says why and what to do, in one line."""
