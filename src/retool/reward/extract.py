"""Answer extraction: the last ``\\boxed{...}`` of a text, matched by brace depth (chapter 8.4.4)."""

from __future__ import annotations

BOXED_MARKER = "\\boxed{"


def extract_last_boxed(text: str) -> str | None:
    """Return the contents of the last ``\\boxed{...}`` in ``text``, or ``None``.

    Braces are matched by depth, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}`` (a regex stopping at
    the first ``}`` would give ``\\frac{1``). As in the chapter, only the *last* marker counts: if it is
    never closed the answer is missing (``None``), even when an earlier box is complete, because the model's
    final word is what gets graded. The scan is linear in the text length, so hostile input (thousands of
    markers, deep nesting) costs microseconds.
    """
    index = text.rfind(BOXED_MARKER)
    if index < 0:
        return None
    start = index + len(BOXED_MARKER)
    depth = 1
    for position in range(start, len(text)):
        char = text[position]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start:position]
    return None
