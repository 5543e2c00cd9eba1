"""Solutions with calculator annotations (GSM8K's ``48/2 = <<48/2=24>>24``): parsed into steps.

Owns reading one annotated solution into the reasoning text around each annotation, the annotation's
expression as Python code, and its stated result; and why a solution cannot be read (every failure is a
``ParseFailure`` with a reason name, never an exception). The trajectory built from the steps lives in
``retool.train.annotated``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_ANNOTATION = re.compile(r"<<([^<>]*)>>")
# Python arithmetic only: what the sandbox runs must be the annotation's own computation, nothing else.
_SAFE_EXPR = re.compile(r"[0-9.+\-*/() ]+")
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")  # "3", "3.50", ".5" (GSM8K writes all three)


@dataclass(frozen=True)
class Step:
    """One annotation: the reasoning text written before it, the code that computes it, its stated result."""

    text: str  # as written, annotations removed (the whitespace kept: steps can be joined back)
    expression: str  # the annotation's left side as Python
    result: str  # the annotation's right side as written

    @property
    def code(self) -> str:
        return f"print({self.expression})"


@dataclass(frozen=True)
class AnnotatedSolution:
    steps: tuple[Step, ...]
    tail: str  # the reasoning text after the last annotation (before ``####``), as written
    answer: str  # the text after ``####`` as written


@dataclass(frozen=True)
class ParseFailure:
    reason: str  # a short name, counted per reason
    detail: str


def python_expression(expr: str) -> str | None:
    """The annotation's expression as Python arithmetic, or None when it is not plain arithmetic."""
    e = expr.replace("$", "").replace("×", "*").replace("÷", "/").replace("^", "**")
    e = re.sub(r"(?<=\d),(?=\d{3}\b)", "", e)  # thousands separators
    e = re.sub(r"(\d+(?:\.\d+)?)%", r"(\1/100)", e)
    e = re.sub(r"(?<=[\d)])\s*x\s*(?=[\d(])", "*", e)
    if not e.strip() or not _SAFE_EXPR.fullmatch(e.replace("**", "*")):
        return None
    if re.search(r"(?<![\d.])0\d", e):  # "05" is a syntax error in Python 3 (".05" and "5.00" are fine)
        return None
    return e.strip()


def parse_solution(solution: str) -> AnnotatedSolution | ParseFailure:
    """Split ``solution`` at its annotations; the final answer is the text after the last ``####``."""
    body, sep, answer = solution.rpartition("####")
    if not sep or not answer.strip():
        return ParseFailure("no_final_answer", "no '#### <answer>' line")
    if body.count("<<") != body.count(">>"):
        return ParseFailure("unparsable_annotation", "unbalanced << >>")
    steps: list[Step] = []
    last = 0
    for m in _ANNOTATION.finditer(body):
        inner = m.group(1)
        lhs, eq, rhs = inner.rpartition("=")
        if not eq or not lhs.strip() or not rhs.strip():
            return ParseFailure("unparsable_annotation", f"<<{inner}>> is not <<expression=result>>")
        expression = python_expression(lhs)
        if expression is None:
            return ParseFailure("unparsable_annotation", f"<<{inner}>>: not plain arithmetic")
        steps.append(Step(body[last : m.start()], expression, rhs.strip()))
        last = m.end()
    if not steps:
        return ParseFailure("no_annotation", "the solution has no <<expression=result>> annotation")
    return AnnotatedSolution(tuple(steps), body[last:], answer.strip())


def matches_result(output: str, stated: str) -> bool:
    """Whether the program's printed ``output`` is the annotation's ``stated`` result.

    Equal as numbers, to the precision the annotation writes (``10/3=3.33`` matches ``3.3333333333333335``).
    """
    out = output.strip()
    want = stated.replace(",", "").replace("$", "").strip()
    if not _NUMBER.fullmatch(want) or not _NUMBER.fullmatch(out):
        return out == want
    decimals = len(want.split(".")[1]) if "." in want else 0
    tolerance = 0.5 * 10.0**-decimals + 1e-9 if decimals else 1e-9
    return math.isclose(float(out), float(want), abs_tol=tolerance, rel_tol=1e-9)
