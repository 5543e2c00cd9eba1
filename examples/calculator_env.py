"""A new environment with a different tool: a sympy calculator instead of the Python sandbox.

It shows the environment seam (``retool.env``): nothing in the rollout engine, the trainer or the
evaluator changes. The environment keeps the ReTool interaction (parse -> call -> observe -> budgets ->
score, ``retool.env.ReToolEnv``) and swaps the tool: a tool call's code is read as arithmetic, one
statement a line (``name = expression``; the last line, optionally ``print(expression)``, is the value),
and evaluated exactly with sympy. Nothing is executed: the code is parsed with ``ast`` and only numbers,
names bound earlier, arithmetic operators and a few sympy functions are accepted, so an untrusted model
cannot reach Python at all. Anything else is an error the model sees as the observation.

Use it as ``CalculatorSource(inner)`` around any problem source, e.g. in a script::

    from retool.env import make_source
    source = CalculatorSource(make_source("synthetic"))
    Trainer(config, run_dir, source=source).run()   # or evaluate(config, mode="retool", source=source, ...)

``tests/test_examples_calculator.py`` trains it for a few steps.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import time
from collections.abc import Callable

import sympy

from retool.data.problem import Problem
from retool.env import (
    Attempt,
    EnvGroupBuilder,
    EnvSetup,
    ProblemSource,
    Score,
    Split,
    ToolSetup,
    VerifierLike,
)
from retool.sandbox.base import ExecResult

_OPERATORS: dict[type[ast.AST], Callable[..., object]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.Mod: operator.mod,
    ast.FloorDiv: operator.floordiv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_FUNCTIONS: dict[str, Callable[..., object]] = {
    "sqrt": sympy.sqrt,
    "factorial": sympy.factorial,
    "binomial": sympy.binomial,
    "gcd": sympy.gcd,
    "lcm": sympy.lcm,
    "Rational": sympy.Rational,
    "simplify": sympy.simplify,
    "abs": sympy.Abs,
}
_MAX_POWER = 10_000  # exponents past this would let one line run for minutes


class CalculatorError(ValueError):
    """A line the calculator does not accept (the model sees this message)."""


def _value(node: ast.AST, names: dict[str, object]) -> object:
    """The exact sympy value of one accepted expression node."""
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return sympy.Integer(node.value) if isinstance(node.value, int) else sympy.Rational(str(node.value))
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise CalculatorError(f"name {node.id!r} is not defined")
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left, names), _value(node.right, names)
        if isinstance(node.op, ast.Pow) and abs(sympy.sympify(right)) > _MAX_POWER:
            raise CalculatorError(f"exponent too large (at most {_MAX_POWER})")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.operand, names))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        if node.keywords:
            raise CalculatorError("keyword arguments are not accepted")
        return _FUNCTIONS[node.func.id](*(_value(a, names) for a in node.args))
    raise CalculatorError(f"not arithmetic: {ast.unparse(node)!r}")


def calculate(code: str) -> str:
    """Evaluate ``code`` (assignments, then a final expression or ``print(expression)``) exactly."""
    try:
        statements = ast.parse(code).body
    except SyntaxError as exc:
        raise CalculatorError(f"syntax error: {exc.msg}") from None
    if not statements:
        raise CalculatorError("nothing to calculate")
    names: dict[str, object] = {}
    for statement in statements[:-1]:
        if not (isinstance(statement, ast.Assign) and [type(t) for t in statement.targets] == [ast.Name]):
            raise CalculatorError(
                f"only `name = expression` lines may precede the result: {ast.unparse(statement)!r}"
            )
        names[statement.targets[0].id] = _value(statement.value, names)  # type: ignore[attr-defined]
    last = statements[-1]
    if not isinstance(last, ast.Expr):
        raise CalculatorError("the last line must be an expression")
    expr = last.value
    if (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Name)
        and expr.func.id == "print"
        and len(expr.args) == 1
    ):
        expr = expr.args[0]
    return str(sympy.nsimplify(_value(expr, names)))


class SympyCalculator:
    """The tool (``retool.env.Tool``): ``arun(code) -> ExecResult`` and what the model is shown."""

    async def arun(self, code: str) -> ExecResult:
        start = time.perf_counter()
        try:
            value = calculate(code)
        except (CalculatorError, ArithmeticError, TypeError, ValueError) as exc:
            return ExecResult(
                False, "", f"{type(exc).__name__}: {exc}", 1, False, time.perf_counter() - start
            )
        return ExecResult(True, value + "\n", "", 0, False, time.perf_counter() - start)

    def format_tool_content(self, result: ExecResult) -> str:
        return result.stdout if result.ok else f"Error: {result.stderr}"


class CalculatorSource(ProblemSource):
    """``inner``'s problems, order and scoring; every tool call goes to the sympy calculator."""

    def __init__(self, inner: ProblemSource, calculator: SympyCalculator | None = None) -> None:
        self.inner, self.calculator = inner, calculator or SympyCalculator()
        self.name, self.shuffle = f"calculator:{inner.name}", inner.shuffle

    @property
    def source(self) -> str:
        return self.inner.source

    def problems(self, split: Split) -> list[Problem]:
        return self.inner.problems(split)

    def epoch(self, seed: int, epoch: int) -> list[Problem]:
        return self.inner.epoch(seed, epoch)

    def category(self, problem: Problem) -> str:
        return self.inner.category(problem)

    async def score(self, attempt: Attempt, verifier: VerifierLike) -> Score:
        return await self.inner.score(attempt, verifier)

    def group_builder(
        self, problem: Problem, setup: EnvSetup, group_size: int, problem_index: int = 0
    ) -> EnvGroupBuilder:
        # A ReTool setup whose protocol registers a tool gets the calculator (whatever executor the run
        # built); a text-only one (``rollout.text_only_share``, ``retool eval --mode text-only``) stays
        # text-only.
        if isinstance(setup, ToolSetup) and setup.protocol.use_tools:
            setup = dataclasses.replace(setup, tool=self.calculator)
        return super().group_builder(problem, setup, group_size, problem_index)
