"""Eval metrics against hand-computed values (and brute force where a formula could hide a bug)."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from retool.evaluate import metrics as M


def cand(
    correct: bool,
    answer: str | None = "1",
    *,
    valid: bool = True,
    calls: int = 0,
    turns: int = 1,
    lat: tuple[float, ...] = (),
    errors: int = 0,
    timeouts: int = 0,
    selfc: bool = False,
    tokens: int = 10,
    stop: str = "answer",
) -> dict:
    return {
        "answer": answer,
        "correct": correct,
        "valid_format": valid,
        "code_calls": calls,
        "turns": turns,
        "exec_latencies": list(lat),
        "exec_errors": errors,
        "exec_timeouts": timeouts,
        "self_corrected": selfc,
        "completion_tokens": tokens,
        "stop_reason": stop,
    }


def rec(pid: str, cands: list[dict]) -> dict:
    return {"id": pid, "candidates": cands}


@pytest.fixture()
def records() -> list[dict]:
    # P1: 3/4 correct; answers 70, 12, 70.0, \text{70}: three vote for "70".
    p1 = [
        cand(True, "70", calls=1, turns=2, lat=(0.5,), tokens=100),
        cand(False, "12", calls=2, turns=3, lat=(1.0, 2.0), errors=1, tokens=200),
        cand(True, "70.0", calls=0, turns=1, tokens=50),
        cand(True, "\\text{70}", calls=2, turns=3, lat=(0.25, 0.25), errors=1, selfc=True, tokens=150),
    ]
    # P2: 0/4 correct; one no-answer (invalid format), three different wrong answers.
    p2 = [
        cand(
            False,
            None,
            valid=False,
            calls=4,
            turns=5,
            lat=(1.0, 1.0, 1.0, 3.0),
            timeouts=1,
            tokens=400,
            stop="max_code_calls",
        ),
        cand(False, "5", tokens=20),
        cand(False, "6", tokens=20),
        cand(False, "7", tokens=20),
    ]
    # P3: 4/4 correct, text only.
    p3 = [cand(True, "588", tokens=30) for _ in range(4)]
    return [rec("p1", p1), rec("p2", p2), rec("p3", p3)]


def test_average_and_pass(records: list[dict]) -> None:
    assert M.average_at_n(records) == pytest.approx((3 / 4 + 0 + 1) / 3)
    assert M.pass_at_n(records) == pytest.approx(2 / 3)


def test_pass_at_k_hand_computed(records: list[dict]) -> None:
    curve = M.pass_at_k_curve(records)
    assert sorted(curve) == [1, 2, 3, 4]
    assert curve[1] == pytest.approx(M.average_at_n(records))  # pass@1 == Average@N
    # P1 (n=4, c=3): pass@k = 1 for every k; P2: 0; P3: 1.
    for k in (2, 3, 4):
        assert curve[k] == pytest.approx(2 / 3)
    # A harder case: n=4, c=1 -> pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6.
    assert M.pass_at_k_estimate(4, 1, 2) == pytest.approx(0.5)
    assert M.pass_at_k_estimate(4, 2, 2) == pytest.approx(1 - 1 / 6)
    assert M.pass_at_k_estimate(4, 0, 4) == 0.0
    with pytest.raises(ValueError):
        M.pass_at_k_estimate(4, 5, 1)
    with pytest.raises(ValueError):
        M.pass_at_k_estimate(4, 1, 5)


@pytest.mark.parametrize("n", [1, 3, 5, 7])
def test_pass_at_k_matches_brute_force(n: int) -> None:
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            exact = Fraction(sum(any(s) for s in subsets), len(subsets))
            assert M.pass_at_k_estimate(n, c, k) == pytest.approx(float(exact))


def test_majority_vote(records: list[dict]) -> None:
    assert [M.majority_score(r) for r in records] == [1.0, 0.0, 1.0]
    assert M.maj_at_n(records) == pytest.approx(2 / 3)


def test_majority_tie_is_expected_random_tiebreak() -> None:
    # "70" twice (right), "12" twice (wrong), no-answers do not vote: tie -> 1/2.
    r = rec(
        "t", [cand(True, "70"), cand(False, "12"), cand(True, "70"), cand(False, "12 "), cand(False, None)]
    )
    assert M.majority_score(r) == 0.5
    # Three-way tie, one right -> 1/3; nobody answered -> 0.
    r3 = rec("t3", [cand(True, "1"), cand(False, "2"), cand(False, "3")])
    assert M.majority_score(r3) == pytest.approx(1 / 3)
    assert M.majority_score(rec("none", [cand(False, None), cand(False, None)])) == 0.0
    # A wrong majority beats a right minority.
    assert M.majority_score(rec("w", [cand(False, "9"), cand(False, "9"), cand(True, "4")])) == 0.0


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("070", "70"),
        ("70.0", "70"),
        (" 70 ", "70"),
        ("$70$", "70"),
        ("\\text{70}", "70"),
        ("1,000", "1000"),
        ("336^\\circ", "336"),
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("\\left(1, 2\\right)", "(1,2)"),
        ("0.5", "0.5"),
        (None, None),
        ("", None),
    ],
)
def test_normalize_answer(raw: str | None, norm: str | None) -> None:
    assert M.normalize_answer(raw) == norm


def test_summarize_all_fields(records: list[dict]) -> None:
    s = M.summarize(records)
    assert s["problems"] == 3 and s["candidates"] == 12 and s["val_n"] == 4
    assert s["format_rate"] == pytest.approx(11 / 12)
    # candidates with code: p1 #0,#1,#3 and p2 #0 -> 4 of 12
    assert s["tool_call_rate"] == pytest.approx(4 / 12)
    assert s["mean_code_calls"] == pytest.approx((1 + 2 + 0 + 2 + 4) / 12)
    assert s["mean_turns"] == pytest.approx((2 + 3 + 1 + 3 + 5 + 1 + 1 + 1 + 4) / 12)
    # correct with zero calls: p1 #2 and the 4 of p3
    assert s["correct_without_code_rate"] == pytest.approx(5 / 12)
    # erred candidates: p1 #1 (error, not fixed), p1 #3 (fixed), p2 #0 (timeout) -> 1/3
    assert s["self_correction_given_error"] == pytest.approx(1 / 3)
    assert s["self_correction_rate"] == pytest.approx(1 / 12)
    assert s["executions"] == 9
    assert s["exec_error_rate"] == pytest.approx(2 / 9)
    assert s["exec_timeout_rate"] == pytest.approx(1 / 9)
    assert s["mean_exec_latency"] == pytest.approx(10.0 / 9)
    assert s["total_exec_latency"] == pytest.approx(10.0)
    assert s["tokens_generated"] == 100 + 200 + 50 + 150 + 400 + 60 + 120
    assert s["mean_completion_tokens"] == pytest.approx(1080 / 12)
    assert s["stop_reasons"] == {"answer": 11, "max_code_calls": 1}
    assert s["pass_at_k"]["1"] == pytest.approx(s["average_at_n"])
    lo, hi = s["average_at_n_ci95"]
    assert lo <= s["average_at_n"] <= hi


def test_headline_intervals_are_the_summary_metrics_with_their_bootstrap(records: list[dict]) -> None:
    iv = M.headline_intervals(records, seed=3)
    assert set(iv) == {"average_at_n", "pass_at_n", "format_rate", "tool_call_rate"}
    assert iv["average_at_n"]["value"] == M.average_at_n(records)
    assert iv["pass_at_n"]["value"] == M.pass_at_n(records)
    assert iv["format_rate"]["value"] == pytest.approx((1 + 3 / 4 + 1) / 3)  # one of P2's four: invalid
    assert iv["tool_call_rate"]["value"] == pytest.approx((3 / 4 + 1 / 4 + 0) / 3)
    lo, hi = M.bootstrap_ci(M.per_problem_accuracy(records), resamples=1000, seed=3)
    assert (iv["average_at_n"]["lo"], iv["average_at_n"]["hi"]) == (lo, hi)
    # A candidate missing a key (an older record) counts as not having it; no candidates: zeros.
    sparse = M.headline_intervals([rec("a", [{"correct": True}, {}]), rec("b", [])])
    assert sparse["average_at_n"]["value"] == pytest.approx(0.25) and sparse["format_rate"]["value"] == 0.0
    assert M.headline_intervals([])["pass_at_n"] == {"value": 0.0, "lo": 0.0, "hi": 0.0}


def test_self_correction_none_without_errors() -> None:
    assert M.summarize([rec("a", [cand(True)])])["self_correction_given_error"] is None


def test_empty_records() -> None:
    s = M.summarize([])
    assert s["average_at_n"] == 0.0 and s["pass_at_k"] == {} and s["candidates"] == 0


def test_bootstrap_ci_matches_normal_approximation_and_is_seeded() -> None:
    values = [0.0, 1.0] * 15  # 30 problems, mean 0.5
    lo, hi = M.bootstrap_ci(values, resamples=4000, seed=1)
    half = 1.96 * math.sqrt(0.25 / 30)  # ~0.179
    assert lo == pytest.approx(0.5 - half, abs=0.03)
    assert hi == pytest.approx(0.5 + half, abs=0.03)
    assert M.bootstrap_ci(values, resamples=4000, seed=1) == (lo, hi)
    spread = [i / 29 for i in range(30)]  # continuous values: another seed gives another interval
    assert M.bootstrap_ci(spread, resamples=200, seed=1) == M.bootstrap_ci(spread, resamples=200, seed=1)
    assert M.bootstrap_ci(spread, resamples=200, seed=1) != M.bootstrap_ci(spread, resamples=200, seed=2)
    assert M.bootstrap_ci([0.25] * 10) == (0.25, 0.25)


def _rec(pid: str, correct: list[bool]) -> dict:
    return {"id": pid, "candidates": [cand(c) for c in correct]}


def test_paired_gain_matches_hand_computation_and_pairs_by_id() -> None:
    before = [_rec("a", [False, False]), _rec("b", [True, False]), _rec("c", [True, True])]
    after = [_rec("c", [True, True]), _rec("a", [True, True]), _rec("b", [True, False])]  # other order
    g = M.paired_gain(before, after, resamples=500)
    # per-problem differences: a +1, b 0, c 0 -> mean 1/3
    assert g["gain"] == pytest.approx(1 / 3) and g["problems"] == 3
    lo, hi = g["ci95"]
    assert 0.0 <= lo <= 1 / 3 <= hi <= 1.0
    # Every resample's mean lies in {0, 1/3, 2/3, 1}; the interval cannot leave [0, 1].
    with pytest.raises(ValueError, match="same problems"):
        M.paired_gain(before, after[:2])


def test_paired_interval_is_narrower_than_the_unpaired_spread() -> None:
    # Problems of very different difficulty, each improved by exactly one of four samples:
    # pairing removes the difficulty spread, so the interval collapses onto the gain.
    before = [_rec(f"p{i}", [k < i % 4 for k in range(4)]) for i in range(40)]
    after = [_rec(f"p{i}", [k <= i % 4 for k in range(4)]) for i in range(40)]
    g = M.paired_gain(before, after)
    assert g["gain"] == pytest.approx(0.25)
    assert g["ci95"] == pytest.approx([0.25, 0.25])
    lo, hi = M.bootstrap_ci(M.per_problem_accuracy(after))
    assert hi - lo > 0.1
