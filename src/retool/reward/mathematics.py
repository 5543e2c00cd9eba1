"""Answers of DeepMind Mathematics (Saxton et al. 2019) checked as the benchmark means them.

The dataset's answers come in a handful of forms: integers, decimals and fractions; ``True`` / ``False``;
a choice letter or a variable's name (``comparison``); lists (sorted values, roots, prime factors); times of
day; numbers written in another base; and expressions in a variable (polynomials, derivatives, surds,
powers, factorisations). ``check(pred, answer, module)`` accepts an answer *equivalent* to the reference where
the form allows it (``-3/4`` for ``-0.75``; ``y = 16`` for ``16``; roots in any order; a polynomial with its
terms in another order; a decimal off the reference by no more than printing a float64 result adds,
``0.30000000000000004`` for ``0.3``, never by a digit float64 tells apart) and refuses one that only
*evaluates* to it where the question asks for a form (``Factor ...`` wants a product, ``Expand`` / ``Collect``
an expanded sum, ``Simplify`` no more operations than the reference). ``exact_match`` is the paper's own
metric, string equality, reported beside it.

The check runs inside the verifier's worker processes (``retool.reward.verifier``: a hard timeout, a
memory cap), reached through a *typed reference* (``retool.reward.equivalence.typed_reference``): the
problem source sends ``typed_reference("mathematics", module, answer)`` as the reference and the worker
dispatches here. Model text never reaches ``eval``: it is parsed by sympy only after a character and name
allow-list (digits, operators, single-letter variables, ``sqrt``), with every name bound to a symbol.

A module whose answers this cannot check raises ``UnsupportedForm`` (reported as the check's error, never
scored as a silent wrong answer); ``tests/test_reward_mathematics.py`` checks every module's real rows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Literal

import sympy
from sympy.parsing.sympy_parser import (
    auto_number,
    factorial_notation,
    parse_expr,
    rationalize,
)

Form = Literal[
    "bool", "time", "base", "list", "ordered_list", "name", "value", "factor", "expanded", "simplified"
]

KIND = "mathematics"

# Modules whose answers are numbers written in a base other than 10 (digits a-z): compared as strings.
_BASE_MODULES = frozenset({"arithmetic__add_or_sub_in_base", "numbers__base_conversion"})
_ORDERED_PREFIX = "comparison__sort"
_EXPANDED_MODULES = frozenset({"polynomials__expand", "polynomials__collect"})
_SIMPLIFIED_MODULES = frozenset({"arithmetic__simplify_surd", "polynomials__simplify_power"})
_FACTOR_PREFIX = "algebra__polynomial_roots"

_TIME = re.compile(r"^(\d{1,2}):(\d{2})\s*([AaPp])\.?\s*[Mm]\.?$")
_NAME = re.compile(r"^[A-Za-z]$")
_ALLOWED_CHARS = re.compile(r"^[0-9A-Za-z_+\-*/().^= !]*$")
_IDENT = re.compile(r"[A-Za-z_]+")
_FUNCTIONS = {"sqrt": sympy.sqrt}
_MAX_CHARS = 400


class UnsupportedForm(ValueError):
    """An answer form this checker does not know (the module is named in the message)."""


class Unparsable(ValueError):
    """A predicted answer that is not an expression of the allowed kind: scored wrong, not an error."""


def answer_form(answer: str, module: str) -> Form:
    """The form of a reference ``answer`` of ``module``, as the check compares it."""
    a = answer.strip()
    if a in ("True", "False"):
        return "bool"
    if _TIME.match(a):
        return "time"
    if module in _BASE_MODULES:
        return "base"
    if "," in a:
        return "ordered_list" if module.startswith(_ORDERED_PREFIX) else "list"
    if _NAME.match(a) and module.startswith("comparison__"):  # a choice letter or a variable's name
        return "name"
    if module.startswith(_FACTOR_PREFIX) and re.search(r"[A-Za-z]", a):
        return "factor"
    if module in _EXPANDED_MODULES:
        return "expanded"
    if module in _SIMPLIFIED_MODULES:
        return "simplified"
    return "value"


def check(pred: str, answer: str, module: str) -> bool:
    """Whether ``pred`` answers the question of ``module`` whose reference answer is ``answer``."""
    form = answer_form(answer, module)
    p, a = clean(pred), answer.strip()
    try:
        return _CHECKS[form](p, a, module)
    except Unparsable:
        return False


def exact_match(pred: str, answer: str) -> bool:
    """The paper's metric: the predicted string is the reference string (surrounding space ignored)."""
    return pred.strip() == answer.strip()


# -- normalising a prediction --------------------------------------------------------------------------


def clean(pred: str) -> str:
    """The prediction as plain text: LaTeX wrappers of a boxed answer undone, ``x = 3`` read as ``3``."""
    s = pred.strip().strip("$").strip()
    s = s.replace("\u2212", "-").replace("\\!", "").replace("\\,", "").replace("\\ ", " ")
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(left|right)\b", "", s)
    for _ in range(4):  # nested fractions and roots, innermost first
        s = re.sub(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
        s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("^", "**")
    s = s.replace("{", "(").replace("}", ")").replace("\\", "")
    s = s.rstrip(".").strip()
    if s.count("=") == 1:
        left, right = (part.strip() for part in s.split("="))
        if _NAME.match(left) or left == "":
            s = right
    return s


def _parse(text: str, *, positive: bool = False) -> sympy.Expr:
    """``text`` as a sympy expression; ``Unparsable`` for anything but arithmetic of numbers, single-letter
    variables and ``sqrt``."""
    if not text or len(text) > _MAX_CHARS or not _ALLOWED_CHARS.match(text) or "__" in text:
        raise Unparsable(text)
    names = set(_IDENT.findall(text))
    if any(len(n) > 1 and n not in _FUNCTIONS for n in names):
        raise Unparsable(text)
    local: dict[str, object] = {
        n: sympy.Symbol(n, positive=True) if positive else sympy.Symbol(n) for n in names
    }
    local.update(_FUNCTIONS)
    # A global table with the parser's own constructors only: nothing else is callable from the text.
    glob: dict[str, object] = {
        "Integer": sympy.Integer,
        "Float": sympy.Float,
        "Rational": sympy.Rational,
        "Symbol": sympy.Symbol,
        "factorial": sympy.factorial,
        "__builtins__": {},
    }
    try:
        expr = parse_expr(
            text,
            local_dict=local,
            global_dict=glob,
            transformations=(auto_number, factorial_notation, rationalize),
        )
    except Exception as exc:  # sympy's parser raises many types; all mean "not an expression"
        raise Unparsable(text) from exc
    if not isinstance(expr, sympy.Expr):
        raise Unparsable(text)
    return expr


def _equal(p: sympy.Expr, a: sympy.Expr) -> bool:
    diff = sympy.expand(p - a)
    return bool(diff == 0 or sympy.simplify(diff) == 0)


# -- the forms -----------------------------------------------------------------------------------------


def _bool(p: str, a: str, module: str) -> bool:
    words = {"true": True, "yes": True, "false": False, "no": False}
    got = words.get(p.lower())
    return got is not None and got == (a == "True")


def _time(p: str, a: str, module: str) -> bool:
    mp, ma = _TIME.match(p), _TIME.match(a)
    if mp is None or ma is None:
        return False
    return (int(mp[1]), mp[2], mp[3].upper()) == (int(ma[1]), ma[2], ma[3].upper())


def _base(p: str, a: str, module: str) -> bool:
    def norm(s: str) -> str:
        s = s.replace(" ", "").lower()
        sign = "-" if s.startswith("-") else ""
        digits = s.lstrip("+-").lstrip("0") or "0"
        return ("" if digits == "0" else sign) + digits

    return norm(p) == norm(a)


def _name(p: str, a: str, module: str) -> bool:
    return p.strip("() ").lower() == a.lower()


def _scalar(p: str, a: str) -> bool:
    """One list element: a name is a name, anything else a value."""
    p = p.strip().strip("() ") if _NAME.match(p.strip().strip("() ")) else p.strip()
    if _NAME.match(a):
        return p.lower() == a.lower()
    return _equal(_parse(p), _parse(a))


def _items(text: str) -> list[str]:
    return [x.strip() for x in text.strip("[]{}() ").split(",") if x.strip()]


def _list(p: str, a: str, module: str) -> bool:
    got, want = _items(p), _items(a)
    if len(got) != len(want):
        return False
    left = list(got)
    for w in want:  # a multiset match: roots and prime factors in any order
        match = next((g for g in left if _scalar(g, w)), None)
        if match is None:
            return False
        left.remove(match)
    return True


def _ordered_list(p: str, a: str, module: str) -> bool:
    got, want = _items(p), _items(a)
    return len(got) == len(want) and all(_scalar(g, w) for g, w in zip(got, want, strict=True))


_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?(/[+-]?\d+)?$")
# float64's unit roundoff: rounding a real number to the nearest float64 moves it by at most this fraction.
_UNIT_ROUNDOFF = sympy.Rational(1, 2**53)
# How many units of roundoff a printed float may stray from the exact answer (``_float_printed`` says why).
_FLOAT_NOISE_UNITS = 8


def _value(p: str, a: str, module: str) -> bool:
    """A number is answered by a number (an unevaluated expression copied from the question is not an
    answer, however it evaluates); an expression by an equal expression."""
    ae = _parse(a)
    if ae.is_number:
        p = re.sub(r"\(([+-]?[\d.]+)\)", r"\1", p.replace(" ", ""))  # (-4)/(19): LaTeX's \frac undone
        if not _NUMBER.match(p) or not _reduced(p):
            return False
        pe = _parse(p)
        return _equal(pe, ae) or (_is_decimal(p) and _float_printed(pe, ae))
    return _equal(_parse(p), ae)


def _is_decimal(number: str) -> bool:
    """Written as Python prints a float (``0.5``, ``1e+16``), not as an integer or a fraction."""
    return "." in number or "e" in number.lower()


def _float_printed(p: sympy.Expr, a: sympy.Expr) -> bool:
    """Whether the decimal ``p`` is the rational ``a`` as an interpreter prints a float64 computation of it
    (``0.1 + 0.2`` prints ``0.30000000000000004``): ``|p - a| <= 8 * u * |a|`` with ``u = 2**-53``, compared
    exactly on the written digits (``p`` and ``a`` are sympy rationals; no float arithmetic here).

    Why 8 units of roundoff: reading a decimal into a float, each arithmetic operation, and printing the
    result with ``repr`` each move the value by at most ``u`` of it, so a product or quotient of two decimals
    strays by about ``4u`` at most and a short chain of such steps (a unit conversion) by a few more. Why no
    more than 9: two decimals of at most 15 significant digits (the most float64 always tells apart) that
    differ in any digit differ by at least ``1e-15`` of the reference, and ``9u < 1e-15``; so a wrong digit on
    such an answer is refused at every magnitude (``198081599.5`` for ``198081599.4``, ``0.0008053600`` for
    ``0.0008053609``: no absolute tolerance does that). A digit past the 15th is accepted when it is within
    the bound: float64 cannot carry it.

    What this refuses: the noise a subtraction of nearly equal numbers leaves (``-10577 + 10722.06`` prints
    ``145.0599999999995``). It is bounded by the size of the question's numbers, which the checker does not
    see, not by the answer's; and the bound the answer's own digits would give (the prediction, rounded to the
    reference's decimal places, is the reference) also accepts the unrounded value as the answer to
    ``Round x to n decimal places``. Such a float is refused; the model is to round what it prints. An
    irrational reference (no module's answer is one) is answered only by an equal expression.
    """
    if not (p.is_Rational and a.is_Rational):
        return False
    return bool(abs(p - a) <= _FLOAT_NOISE_UNITS * _UNIT_ROUNDOFF * abs(a))


def _factor(p: str, a: str, module: str) -> bool:
    """Equal to the reference and written as a product of as many non-constant factors as it has
    irreducible ones over the rationals (so ``3*(j**2 + ...)`` is not a factorisation of a quadratic)."""
    pe, ae = _parse(p), _parse(a)
    return _equal(pe, ae) and _written_factors(pe) == sum(k for _, k in sympy.factor_list(ae)[1])


def _written_factors(expr: sympy.Expr) -> int:
    count = 0
    for factor in sympy.Mul.make_args(expr):
        base, exp = factor.as_base_exp()
        if base.free_symbols:
            count += int(exp) if exp.is_Integer and exp > 0 else 1
    return count


def _expanded(p: str, a: str, module: str) -> bool:
    pe = _parse(p)
    return _equal(pe, _parse(a)) and sympy.expand(pe) == pe


def _simplified(p: str, a: str, module: str) -> bool:
    positive = module == "polynomials__simplify_power"  # "assuming p is positive"
    pe, ae = _parse(p, positive=positive), _parse(a, positive=positive)
    return _equal(pe, ae) and sympy.count_ops(pe) <= sympy.count_ops(ae)


def _reduced(number: str) -> bool:
    """A fraction in lowest terms with a denominator other than 1 (``-10/2`` restates ``Divide -10 by 2``)."""
    if "/" not in number:
        return True
    num, den = number.split("/")
    if "." in num or "e" in num.lower():
        return False
    n, d = abs(int(num)), abs(int(den))
    return d > 1 and math.gcd(n, d) == 1


_CHECKS: dict[Form, Callable[[str, str, str], bool]] = {
    "bool": _bool,
    "time": _time,
    "base": _base,
    "name": _name,
    "list": _list,
    "ordered_list": _ordered_list,
    "value": _value,
    "factor": _factor,
    "expanded": _expanded,
    "simplified": _simplified,
}


def check_reference(pred: str, payload: str) -> tuple[bool, str]:
    """The typed-reference entry point (``retool.reward.equivalence``): ``payload`` is ``module\\x00answer``.
    Returns ``(equivalent, detail)``; raises ``UnsupportedForm`` for a payload it cannot read."""
    module, sep, answer = payload.partition("\x00")
    if not sep or not module:
        raise UnsupportedForm(f"not a mathematics reference: {payload[:80]!r}")
    return check(pred, answer, module), ""
