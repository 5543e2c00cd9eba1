"""Neutralising tokenizer control strings in tool output (docs/spec.md §2).

Interpreter output is untrusted text that goes into the prompt. If it contained ``<|im_end|>`` or
``</tool_response>`` verbatim, encoding it would produce the real control token and close the
observation early (or fake a new turn). ``sanitize_tool_content`` breaks every such string by putting a
zero-width space after its first character; the text still reads the same to a human, but no longer
matches the tokenizer's added-token table. The list comes from the tokenizer itself
(``all_special_tokens`` plus every entry of ``added_tokens_decoder``), never from a fixed list.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable

ZWSP = "\u200b"
_MAX_PASSES = 8


def special_token_strings(tokenizer: object) -> list[str]:
    """Every special or added token string of ``tokenizer`` (longest first)."""
    found: set[str] = set()
    for tok in getattr(tokenizer, "all_special_tokens", None) or []:
        if isinstance(tok, str) and tok:
            found.add(tok)
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for added in decoder.values():
        content = getattr(added, "content", added)
        if isinstance(content, str) and content:
            found.add(content)
    return sorted(found, key=lambda s: (-len(s), s))


_PATTERNS: weakref.WeakKeyDictionary[object, dict[tuple[str, ...], re.Pattern[str] | None]] = (
    weakref.WeakKeyDictionary()
)


def _compile(tokenizer: object, extra: tuple[str, ...]) -> re.Pattern[str] | None:
    strings = sorted(set(special_token_strings(tokenizer)) | {s for s in extra if s}, key=lambda s: -len(s))
    return re.compile("|".join(re.escape(s) for s in strings)) if strings else None


def _pattern(tokenizer: object, extra: tuple[str, ...]) -> re.Pattern[str] | None:
    # Cached per tokenizer object (weakly, so a freed tokenizer never lends its table to a new one).
    try:
        per_tok = _PATTERNS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable / hashable: compile every time
        return _compile(tokenizer, extra)
    if extra not in per_tok:
        per_tok[extra] = _compile(tokenizer, extra)
    return per_tok[extra]


def _break(match: re.Match[str]) -> str:
    s = match.group(0)
    if len(s) == 1:  # cannot split one character: spell it as an escape instead
        return f"\\u{ord(s):04x}"
    return s[0] + ZWSP + s[1:]


def sanitize_tool_content(text: str, tokenizer: object, extra: Iterable[str] = ()) -> str:
    """Return ``text`` with every special/added token string of ``tokenizer`` (and ``extra``) broken.

    Idempotent: sanitising sanitised text changes nothing. Repeats until no match is left, because
    breaking one string could in principle complete another one around it.
    """
    pat = _pattern(tokenizer, tuple(extra))
    if pat is None:
        return text
    for _ in range(_MAX_PASSES):
        new = pat.sub(_break, text)
        if new == text:
            return new
        text = new
    raise ValueError("tool output could not be sanitised (special-token strings keep re-forming)")
