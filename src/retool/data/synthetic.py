"""The synthetic task family: seeded integer-answer problems, easy and hard (the env ``tasks``, the demo's data).

Easy problems (sums and products of one-digit numbers) are within reach of a tiny model answering
directly; hard ones (multi-digit products, digit sums of large powers, prime counts, modular powers,
small linear systems) are not, unless it calls the interpreter. Every problem carries its kind, its
``hard`` flag and a canonical solution snippet (the code the cold-start SFT data calls).

Problems are plain ``retool.data.Problem`` objects; the kind and difficulty travel in ``data_source``
as ``"tasks/<kind>/<easy|hard>"`` so every later stage (rollout, eval, analysis) can group by them.

Questions write their numbers the way the canonical code does (``7**23``, ``52**583 % 668``), so that a
tiny model's code is a copy of a span of the question: copying is what a small transformer learns fast
(induction), and the demo is about *when* to call the tool, not about parsing notation. Each kind's
operands have a fixed number of digits, so a copy is also a fixed offset in the token sequence.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from retool.data.problem import Problem

SOURCE_PREFIX = "tasks"


@dataclass(frozen=True)
class Task:
    """One generated problem with everything the SFT data builder needs."""

    id: str
    kind: str
    hard: bool
    question: str
    answer: int
    code: str  # canonical solution: prints exactly the answer

    @property
    def data_source(self) -> str:
        return f"{SOURCE_PREFIX}/{self.kind}/{'hard' if self.hard else 'easy'}"

    def to_problem(self) -> Problem:
        return Problem(
            id=self.id, question=self.question, answer=str(self.answer), data_source=self.data_source
        )


def parse_source(data_source: str) -> tuple[str, bool] | None:
    """``"tasks/mul_big/hard"`` -> ``("mul_big", True)``; None for anything not from this family."""
    parts = data_source.split("/")
    if len(parts) != 3 or parts[0] != SOURCE_PREFIX or parts[2] not in ("easy", "hard"):
        return None
    return parts[1], parts[2] == "hard"


# -- generators: (rng) -> (question, answer, code) ------------------------------------------------


def _add_small(rng: random.Random) -> tuple[str, int, str]:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"What is {a} + {b}?", a + b, f"print({a} + {b})"


def _mul_small(rng: random.Random) -> tuple[str, int, str]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"What is {a} * {b}?", a * b, f"print({a} * {b})"


def _mul_big(rng: random.Random) -> tuple[str, int, str]:
    a, b = rng.randint(100, 999), rng.randint(10, 99)
    return f"What is {a} * {b}?", a * b, f"print({a} * {b})"


def _digit_sum_pow(rng: random.Random) -> tuple[str, int, str]:
    base, exp = rng.randint(2, 9), rng.randint(20, 60)
    answer = sum(int(d) for d in str(base**exp))
    question = f"What is the sum of the digits of {base}**{exp}?"
    return question, answer, f"print(sum(int(d) for d in str({base}**{exp})))"


def _prime_prefix(limit: int) -> list[int]:
    """``out[n]`` = number of primes below ``n`` (sieve: the answer must not cost what the model's code does)."""
    sieve = bytearray([1]) * limit
    sieve[0:2] = b"\x00\x00"
    for i in range(2, int(limit**0.5) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(range(i * i, limit, i)))
    out, count = [0] * (limit + 1), 0
    for i in range(limit):
        out[i] = count
        count += sieve[i]
    out[limit] = count
    return out


_PRIME_PREFIX = _prime_prefix(1001)


def _count_primes(rng: random.Random) -> tuple[str, int, str]:
    n = rng.randint(100, 999)
    answer = _PRIME_PREFIX[n]
    code = f"print(sum(1 for k in range(2, {n}) if all(k % p for p in range(2, int(k**0.5) + 1))))"
    return f"How many primes are less than {n}?", answer, code


def _mod_pow(rng: random.Random) -> tuple[str, int, str]:
    a, e, m = rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 99)
    return f"What is {a}**{e} % {m}?", pow(a, e, m), f"print({a}**{e} % {m})"


def _linear_system(rng: random.Random) -> tuple[str, int, str]:
    while True:
        x, y = rng.randint(-20, 20), rng.randint(-20, 20)
        a, b, c, d = (rng.randint(1, 9) for _ in range(4))
        if a * d - b * c != 0:
            break
    e, f = a * x + b * y, c * x + d * y
    question = f"If {a}x + {b}y = {e} and {c}x + {d}y = {f}, what is x * y?"
    code = f"D = {a} * {d} - {b} * {c}\nx = ({e} * {d} - {b} * {f}) // D\ny = ({a} * {f} - {e} * {c}) // D\nprint(x * y)"
    return question, x * y, code


Generator = Callable[[random.Random], tuple[str, int, str]]
EASY_KINDS: dict[str, Generator] = {"add_small": _add_small, "mul_small": _mul_small}
HARD_KINDS: dict[str, Generator] = {
    "mul_big": _mul_big,
    "digit_sum_pow": _digit_sum_pow,
    "count_primes": _count_primes,
    "mod_pow": _mod_pow,
    "linear_system": _linear_system,
}
ALL_KINDS: dict[str, Generator] = {**EASY_KINDS, **HARD_KINDS}
# The demo's default: every kind whose code copies one span of the question (linear_system needs six
# numbers rearranged, beyond a few-million-parameter model trained for minutes).
DEMO_KINDS: tuple[str, ...] = (
    "add_small",
    "mul_small",
    "mul_big",
    "digit_sum_pow",
    "count_primes",
    "mod_pow",
)


def generate_tasks(
    n: int,
    *,
    seed: int = 0,
    hard_fraction: float = 0.5,
    kinds: Sequence[str] | None = None,
    split: str = "train",
) -> list[Task]:
    """``n`` seeded tasks; a given (seed, split) always yields the same list.

    ``kinds`` restricts the family (default: all). Easy and hard kinds are mixed by ``hard_fraction``.
    Train and test draw from different RNG streams and test questions are re-drawn when they collide
    with a train question of the same seed, so the split is held out.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 0.0 <= hard_fraction <= 1.0:
        raise ValueError(f"hard_fraction must be in [0, 1], got {hard_fraction}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    selected = list(kinds) if kinds is not None else list(ALL_KINDS)
    unknown = [k for k in selected if k not in ALL_KINDS]
    if unknown:
        raise ValueError(f"unknown task kinds {unknown}; known: {sorted(ALL_KINDS)}")
    easy = [k for k in selected if k in EASY_KINDS]
    hard = [k for k in selected if k in HARD_KINDS]
    # The seed string names the old package on purpose: changing it would draw other problems and change every
    # figure measured on the synthetic set (the demo's table, learning.md, same_results).
    rng = random.Random(f"retool-tasks/{seed}/{split}")
    # The held-out test split excludes train questions; small easy kinds (81 combinations) still repeat
    # by design: a direct answer to "3 + 5" is the skill, not a memorised item.
    exclude = _question_set(seed, tuple(selected), hard_fraction) if split == "test" else set()
    tasks: list[Task] = []
    while len(tasks) < n:
        use_hard = bool(hard) and (not easy or rng.random() < hard_fraction)
        kind = rng.choice(hard if use_hard else easy)
        question, answer, code = ALL_KINDS[kind](rng)
        if kind in HARD_KINDS and question in exclude:
            continue
        tasks.append(
            Task(f"{split}-{seed}-{len(tasks):05d}", kind, kind in HARD_KINDS, question, answer, code)
        )
    return tasks


_TRAIN_QUESTIONS: dict[tuple[int, tuple[str, ...], float], set[str]] = {}
_HELD_OUT_AGAINST = 5000  # test questions never equal one of the first 5000 train questions


def _question_set(seed: int, kinds: tuple[str, ...], hard_fraction: float) -> set[str]:
    key = (seed, kinds, hard_fraction)
    if key not in _TRAIN_QUESTIONS:
        train = generate_tasks(_HELD_OUT_AGAINST, seed=seed, hard_fraction=hard_fraction, kinds=kinds)
        _TRAIN_QUESTIONS[key] = {t.question for t in train}
    return _TRAIN_QUESTIONS[key]


def generate_problems(
    n: int, *, seed: int = 0, hard_fraction: float = 0.5, split: str = "train"
) -> list[Problem]:
    return [t.to_problem() for t in generate_tasks(n, seed=seed, hard_fraction=hard_fraction, split=split)]
