"""Mathematical equivalence of a predicted answer and a reference, through math-verify.

This module runs math-verify *in the calling process* with math-verify's own ``signal.alarm`` timeouts
switched off (``parsing_timeout=None``, ``timeout_seconds=None``): signals only work on a process's main
thread, and a trainer calls the verifier from event loops and worker threads. Time is bounded one level up,
by :class:`retool.reward.verifier.Verifier`, which runs these functions in worker processes it can kill.
Call :func:`answers_equivalent` directly only for trusted input (tests, offline analysis).

A *typed reference* (:func:`typed_reference`) names a checker of its own instead of math-verify: a
benchmark whose answers math-verify does not read as the benchmark means them (DeepMind Mathematics'
``True`` / ``False``, choice letters, factorised polynomials: :mod:`retool.reward.mathematics`). It travels
as the reference string, so it reaches the verifier's worker processes (and their timeout) unchanged.
"""

from __future__ import annotations

import importlib
import logging
from itertools import product
from typing import Literal

from math_verify import parse, verify

logger = logging.getLogger(__name__)

CheckStatus = Literal["ok", "error"]


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its timeout is disabled; here that is deliberate (see module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.grader", "math_verify.parser"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


# NUL characters: no answer of any dataset holds them (and str.strip keeps them, unlike the control
# separators), so a typed reference cannot be mistaken for an answer.
_TYPED = "\x00\x00"
# kind -> the module whose ``check_reference(pred, payload) -> (equivalent, detail)`` checks it.
TYPED_CHECKERS = {"mathematics": "retool.reward.mathematics"}


def typed_reference(kind: str, *parts: str) -> str:
    """A reference checked by ``kind``'s checker (``TYPED_CHECKERS``) with ``parts`` as its payload."""
    if kind not in TYPED_CHECKERS:
        raise ValueError(f"unknown answer checker {kind!r}; known: {', '.join(TYPED_CHECKERS)}")
    return _TYPED + kind + "\x00" + "\x00".join(parts)


def _check_typed(pred: str, ref: str) -> tuple[bool, CheckStatus, str]:
    kind, _, payload = ref[len(_TYPED) :].partition("\x00")
    if kind not in TYPED_CHECKERS:
        return False, "error", f"unknown answer checker {kind!r}"
    # deferred: a checker's own dependencies load only in the workers that meet its references
    checker = importlib.import_module(TYPED_CHECKERS[kind])
    try:
        equivalent, detail = checker.check_reference(pred, payload)
    except ValueError as exc:  # the checker's UnsupportedForm: named, never a silent wrong answer
        return False, "error", f"{kind}: {exc}"
    return bool(equivalent), "ok", str(detail)


def _wrap(answer: str) -> str:
    # math-verify extracts LaTeX between $...$; the chapter wraps both sides the same way.
    return f"${answer}$"


def check_equivalence(pred: str, ref: str) -> tuple[bool, CheckStatus, str]:
    """``(equivalent, status, detail)``: like math-verify's ``verify(parse(ref), parse(pred))``, but an
    exception inside math-verify is reported as ``status="error"`` (with its type and message in
    ``detail``) instead of being folded silently into "not equivalent".

    Every (gold, target) pair of the two parses is compared, as ``verify`` does; one pair raising does not
    hide a later pair that matches. A typed reference (:func:`typed_reference`) goes to its own checker.
    """
    if ref.startswith(_TYPED):
        return _check_typed(pred, ref)
    try:
        gold = parse(_wrap(ref), parsing_timeout=None, raise_on_error=True)
        target = parse(_wrap(pred), parsing_timeout=None, raise_on_error=True)
    except Exception as exc:  # math-verify/sympy raise many types; all mean "could not check"
        return False, "error", f"parse: {type(exc).__name__}: {str(exc)[:200]}"
    detail = ""
    for g, t in product(gold, target):
        try:
            if verify(g, t, timeout_seconds=None, raise_on_error=True):
                return True, "ok", ""
        except Exception as exc:
            detail = f"verify: {type(exc).__name__}: {str(exc)[:200]}"
    return False, ("error" if detail else "ok"), detail


def answers_equivalent(pred: str, ref: str) -> bool:
    """True if math-verify judges ``pred`` equivalent to the reference ``ref`` (errors count as False).

    In-process and unbounded in time: use a :class:`~retool.reward.verifier.Verifier` for untrusted input.
    """
    equivalent, status, detail = check_equivalence(pred, ref)
    if status == "error":
        logger.debug("math-verify error on pred=%.80r ref=%.80r: %s", pred, ref, detail)
    return equivalent
