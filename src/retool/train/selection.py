"""Sampling where the gradient is: the pass-rate order of training problems (``data.selection = "pass_rate"``).

A group teaches only when its rewards differ. At group size G a problem the policy passes with probability p
gives a mixed group with probability ``1 - (1 - p)^G - p^G``: zero at p = 0 and p = 1, highest at 0.5. When
the successes sit in a few categories (DeepMind Mathematics' modules after SFT), epoch order spends most
draws on problems the policy always fails. ``PassRateSelector`` is a ``ProblemOrder``
(``retool.train.datasource``) that draws where groups are likely to be mixed:

- **Estimates** (``PassRateEstimates``): a pass rate per problem and per category (``ProblemSource.category``),
  updated from every group the trainer samples (every dynamic-sampling round, kept or not; ``observe``).
  Each is a Beta-style posterior mean over *discounted* counts: ``(passes + a * prior) / (attempts + a)``
  with ``a = prior_attempts``, where every new group first fades the older counts by ``exp(-n / window)``
  (n: the group's attempts). Why both: a plain Beta posterior never forgets, so a problem failed early
  would stay retired after the policy learned it; a plain moving average has no notion of how much
  evidence there is, so one all-wrong group would retire a problem at once. With the fade the estimate
  follows roughly the last ``window`` attempts; the prior keeps a problem seen once near its category.
  A problem's prior is its category's estimate, a category's is 0.5 (never seen: the most informative
  rate, so every category is tried early). A problem never sampled is estimated at its category's rate.
  A pass is an attempt the source scored correct (``Outcome.correct``: with the +1 / -1 reward by
  correctness, a group is mixed exactly when its passes are); attempts lost to infrastructure (a dead
  sampler or sandbox) are not evidence and are not counted.
- **The rule**, per problem drawn: with probability ``explore`` the next *retired* problem, otherwise a
  problem *in the band*. In the band: estimate in ``[band_low, band_high]``; retired: below (hopeless) or
  above (solved). An in-band draw picks a category with weight ``1 - (1 - p_c)^G - p_c^G`` (p_c: the
  category's estimate, G: ``rollout.group_size``; the expected share of mixed groups it gives), then that
  category's next in-band problem in a seeded round-robin order (so every in-band problem of a category
  comes up before any comes up twice). A retired draw takes the next retired problem of one seeded
  round-robin over all problems. When one kind has nothing left to give, the draw takes the other; a batch
  never holds a problem twice unless the source has fewer problems than the batch.
- **Rare successes** (``group_size_rare``, off by default): a problem estimated below ``rare_below`` is
  rolled out ``group_size_rare`` times instead of ``rollout.group_size`` (``group_size``; the step sampler
  asks when it samples the round, ``retool.train.sampling.sample_by_size``): at p = 0.05 a group of 8 is
  mixed a third of the time, a group of 16 more than half. Groups of different sizes need nothing else:
  advantages are centred per group; under ``filters.roc`` the larger group is down-sampled to the usual
  size like every other, so it keeps more chances of holding a success.
- **Determinism and resume**: draw call c uses ``random.Random(f"retool-selection/{seed}/draw/{c}")`` and the
  round-robin orders are a pure function of the seed and the train split, so the whole state is plain
  numbers: the counts, the cursors, the call count (``state`` / ``from_state``). A checkpoint stores it as
  ``selection.json`` beside the stream's position (``retool.train.loop``), so a resumed run draws the same
  problems as an uninterrupted one.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from retool.config import PassRateConfig
from retool.data.problem import Problem
from retool.jsonl import JsonObject, JsonValue, as_list, as_number, as_object
from retool.rollout.types import Trajectory
from retool.train.datasource import DataPosition, OrderSnapshot
from retool.train.metrics import INFRA_STOPS

CATEGORY_PRIOR = 0.5  # a category never sampled: the rate whose groups are most often mixed
Status = Literal["in_band", "hopeless", "solved"]


@dataclass
class PassCount:
    """Discounted evidence of one problem or category: passes and attempts, older ones fading."""

    passed: float = 0.0
    attempts: float = 0.0

    def add(self, passed: int, attempts: int, window: float) -> None:
        """One group's ``passed`` of ``attempts``; what came before fades by ``exp(-attempts / window)``."""
        fade = math.exp(-attempts / window)
        self.passed = self.passed * fade + passed
        self.attempts = self.attempts * fade + attempts

    def rate(self, prior: float, prior_attempts: float) -> float:
        """The smoothed pass rate: ``prior`` counted as ``prior_attempts`` attempts."""
        return (self.passed + prior_attempts * prior) / (self.attempts + prior_attempts)


def mixed_group_probability(pass_rate: float, group_size: int) -> float:
    """The chance that a group of ``group_size`` attempts at ``pass_rate`` has both passes and failures."""
    return 1.0 - (1.0 - pass_rate) ** group_size - pass_rate**group_size


@dataclass
class PassRateEstimates:
    """Running, smoothed pass rates per problem (by id) and per category (module docstring)."""

    settings: PassRateConfig
    problems: dict[str, PassCount] = field(default_factory=dict)
    categories: dict[str, PassCount] = field(default_factory=dict)

    def observe(self, problem_id: str, category: str, passed: int, attempts: int) -> None:
        if attempts <= 0:
            return
        s = self.settings
        self.problems.setdefault(problem_id, PassCount()).add(passed, attempts, s.problem_window)
        self.categories.setdefault(category, PassCount()).add(passed, attempts, s.category_window)

    def category_rate(self, category: str) -> float:
        count = self.categories.get(category)
        return CATEGORY_PRIOR if count is None else count.rate(CATEGORY_PRIOR, self.settings.prior_attempts)

    def problem_rate(self, problem_id: str, category: str) -> float:
        """The problem's estimate; its category's while it was never sampled."""
        prior = self.category_rate(category)
        count = self.problems.get(problem_id)
        return prior if count is None else count.rate(prior, self.settings.prior_attempts)

    def status(self, rate: float) -> Status:
        if rate < self.settings.band_low:
            return "hopeless"
        return "solved" if rate > self.settings.band_high else "in_band"


def _counts_json(counts: dict[str, PassCount]) -> JsonObject:
    return {key: [c.passed, c.attempts] for key, c in sorted(counts.items())}


def _counts_from(value: JsonValue) -> dict[str, PassCount]:
    out: dict[str, PassCount] = {}
    for key, pair in as_object(value).items():
        passed, attempts = as_list(pair)
        out[key] = PassCount(float(as_number(passed)), float(as_number(attempts)))
    return out


@dataclass
class _Call:
    """One ``next_batch`` call's bookkeeping: its rng, what it drew, which pools ran dry, cached rates."""

    rng: random.Random
    taken: set[str] = field(default_factory=set)
    closed: set[str] = field(default_factory=set)  # categories with no in-band problem left to draw
    retired_left: bool = True
    weights: dict[str, float] = field(default_factory=dict)


class PassRateSelector:
    """Draws ``problems`` (the train split) by estimated pass rate (module docstring); ``category_of``
    names each problem's category, ``group_size`` is the G of the mixed-group weight. ``state``: what
    ``state()`` returned in a checkpoint (its seed wins over ``seed``, as a stream position's does)."""

    def __init__(
        self,
        problems: Sequence[Problem],
        category_of: Callable[[Problem], str],
        settings: PassRateConfig,
        *,
        group_size: int,
        seed: int,
        state: JsonObject | None = None,
    ) -> None:
        self.settings, self.weight_group_size, self._category_of = settings, group_size, category_of
        self.seed = seed if state is None else int(as_number(state["seed"]))
        by_id: dict[str, Problem] = {}
        for p in problems:  # one entry per id: the estimates are kept by id
            by_id.setdefault(p.id, p)
        unique = list(by_id.values())
        if not unique:
            raise ValueError("the pass-rate selection needs at least one problem")
        self._category = {p.id: category_of(p) for p in unique}
        by_category: dict[str, list[Problem]] = {}
        for p in unique:
            by_category.setdefault(self._category[p.id], []).append(p)
        order_rng = random.Random(f"retool-selection/{self.seed}/order")
        self._orders = {c: order_rng.sample(by_category[c], len(by_category[c])) for c in sorted(by_category)}
        self._all = order_rng.sample(unique, len(unique))  # the retired draws' round-robin
        self.estimates = PassRateEstimates(settings)
        self.cursors = dict.fromkeys(self._orders, 0)
        self.retired_cursor = 0
        self.calls = 0
        self.drawn = 0
        if state is not None:
            self._load(state)

    # -- the order ------------------------------------------------------------------------------------
    @property
    def position(self) -> DataPosition:
        """Problems drawn so far (as a stream's index; one endless epoch)."""
        return DataPosition(epoch=0, index=self.drawn, seed=self.seed)

    def category(self, problem: Problem) -> str:
        return self._category.get(problem.id) or self._category_of(problem)

    def rate(self, problem: Problem) -> float:
        return self.estimates.problem_rate(problem.id, self.category(problem))

    def next_batch(self, n: int) -> list[Problem]:
        call = _Call(random.Random(f"retool-selection/{self.seed}/draw/{self.calls}"))
        self.calls += 1
        out = [self._draw_one(call) for _ in range(n)]
        self.drawn += n
        return out

    def observe(self, problems: Sequence[Problem], groups: Sequence[Sequence[Trajectory]]) -> None:
        """Every sampled group updates its problem's and its category's estimate."""
        for problem, group in zip(problems, groups, strict=True):
            counted = [t for t in group if t.outcome.stop_reason not in INFRA_STOPS]
            passed = sum(1 for t in counted if t.outcome.correct)
            self.estimates.observe(problem.id, self.category(problem), passed, len(counted))

    def group_size(self, problem: Problem, default: int) -> int:
        """``group_size_rare`` for a problem estimated below ``rare_below`` (when larger), else ``default``."""
        rare = self.settings.group_size_rare
        return rare if rare > default and self.rate(problem) < self.settings.rare_below else default

    def snapshot(self) -> OrderSnapshot:
        return OrderSnapshot(self.state(), self.summary())

    # -- drawing --------------------------------------------------------------------------------------
    def _draw_one(self, call: _Call) -> Problem:
        explore = call.rng.random() < self.settings.explore  # drawn every time: the sequence stays fixed
        first, second = (self._retired, self._in_band) if explore else (self._in_band, self._retired)
        problem = first(call) or second(call)
        if problem is None:  # the batch already holds every problem: a source smaller than a batch
            call.taken.clear()
            call.closed.clear()
            call.retired_left = True
            problem = first(call) or second(call)
        assert problem is not None, "a non-empty source always has a problem to draw"
        call.taken.add(problem.id)
        return problem

    def _in_band(self, call: _Call) -> Problem | None:
        """A category by its mixed-group weight, then its next in-band problem not drawn yet."""
        if not call.weights:
            call.weights = {
                # a floor: with group size 1 no group is ever mixed, and the draw still needs a weight
                c: max(mixed_group_probability(self.estimates.category_rate(c), self.weight_group_size), 1e-9)
                for c in self._orders
            }
        while True:
            open_ = [c for c in self._orders if c not in call.closed]
            if not open_:
                return None
            category = call.rng.choices(open_, [call.weights[c] for c in open_])[0]
            order = self._orders[category]
            found = self._walk(order, self.cursors[category], call, want_in_band=True)
            if found is None:
                call.closed.add(category)
                continue
            self.cursors[category] = (found + 1) % len(order)
            return order[found]

    def _retired(self, call: _Call) -> Problem | None:
        """The next retired problem not drawn yet, in the seeded round-robin over all problems."""
        if not call.retired_left:
            return None
        found = self._walk(self._all, self.retired_cursor, call, want_in_band=False)
        if found is None:
            call.retired_left = False
            return None
        self.retired_cursor = (found + 1) % len(self._all)
        return self._all[found]

    def _walk(self, order: list[Problem], start: int, call: _Call, *, want_in_band: bool) -> int | None:
        """The index of the first problem from ``start`` on (wrapping) that is in the band (or retired)
        and not drawn in this call; None after a full turn."""
        for k in range(len(order)):
            i = (start + k) % len(order)
            problem = order[i]
            if problem.id in call.taken:
                continue
            if (self.estimates.status(self.rate(problem)) == "in_band") == want_in_band:
                return i
        return None

    # -- what a checkpoint and a metrics line hold -----------------------------------------------------
    def summary(self) -> dict[str, float]:
        """``selection/*``: problems in the band and retired (never-sampled ones at their category's
        estimate), problems never sampled, categories whose estimate is in the band."""
        statuses: Counter[str] = Counter()
        seen: Counter[str] = Counter()
        for pid in self.estimates.problems:
            category = self._category.get(pid)
            if category is not None:  # a problem of the train split (a requeued one may not be)
                seen[category] += 1
                statuses[self.estimates.status(self.estimates.problem_rate(pid, category))] += 1
        for category, order in self._orders.items():
            statuses[self.estimates.status(self.estimates.category_rate(category))] += (
                len(order) - seen[category]
            )
        in_band_categories = sum(
            self.estimates.status(self.estimates.category_rate(c)) == "in_band" for c in self._orders
        )
        return {
            "selection/in_band": float(statuses["in_band"]),
            "selection/retired_hopeless": float(statuses["hopeless"]),
            "selection/retired_solved": float(statuses["solved"]),
            "selection/never_sampled": float(len(self._category) - sum(seen.values())),
            "selection/categories_in_band": float(in_band_categories),
        }

    def state(self) -> JsonObject:
        """Everything that decides the next draws, as plain JSON (floats round-trip exactly)."""
        return {
            "seed": self.seed,
            "calls": self.calls,
            "drawn": self.drawn,
            "retired_cursor": self.retired_cursor,
            "cursors": {c: i for c, i in self.cursors.items()},
            "problems": _counts_json(self.estimates.problems),
            "categories": _counts_json(self.estimates.categories),
        }

    def _load(self, state: JsonObject) -> None:
        self.calls = int(as_number(state["calls"]))
        self.drawn = int(as_number(state["drawn"]))
        self.retired_cursor = int(as_number(state["retired_cursor"])) % len(self._all)
        for category, cursor in as_object(state["cursors"]).items():
            if category in self._orders:
                self.cursors[category] = int(as_number(cursor)) % len(self._orders[category])
        self.estimates.problems = _counts_from(state["problems"])
        self.estimates.categories = _counts_from(state["categories"])
