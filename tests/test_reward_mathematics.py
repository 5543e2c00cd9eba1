"""DeepMind Mathematics' answers checked as the benchmark means them (``retool.reward.mathematics``), on real
rows the official generator made for every module (``tests/data/mathematics``), in process and through the
verifier's worker processes."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from retool.reward.equivalence import check_equivalence, typed_reference
from retool.reward.mathematics import UnsupportedForm, answer_form, check, check_reference, clean, exact_match
from retool.reward.verifier import Verifier


def rows(fixture_data: Path) -> list[dict[str, str]]:
    folder = fixture_data / "mathematics"
    out = []
    for split in ("train", "interpolate", "extrapolate"):
        text = (folder / f"mathematics_{split}.jsonl").read_text(encoding="utf-8")
        out += [json.loads(line) for line in text.splitlines() if line.strip()]
    return out


def test_the_fixture_holds_every_module_of_every_split(fixture_data: Path) -> None:
    modules: dict[str, set[str]] = defaultdict(set)
    for row in rows(fixture_data):
        modules[row["split"]].add(row["module"])
    assert {split: len(names) for split, names in modules.items()} == {
        "train": 56,
        "interpolate": 56,
        "extrapolate": 15,
    }


def test_every_reference_answer_of_every_module_checks_against_itself(fixture_data: Path) -> None:
    failed = [
        (r["module"], r["answer"])
        for r in rows(fixture_data)
        if not check(r["answer"], r["answer"], r["module"])
    ]
    assert failed == []


def test_another_question_s_answer_is_refused_in_every_module(fixture_data: Path) -> None:
    by_module: dict[str, list[str]] = defaultdict(list)
    for r in rows(fixture_data):
        by_module[r["module"]].append(r["answer"])
    accepted = []
    for module, answers in by_module.items():
        for a in answers:
            for b in answers:
                if a != b and check(b, a, module):
                    accepted.append((module, b, a))
    assert accepted == []
    assert len(by_module) >= 56  # every module had answers to compare


@pytest.mark.parametrize(
    ("pred", "answer", "module", "expected"),
    [
        ("-0.75", "-3/4", "arithmetic__mul", True),  # a decimal for a fraction
        ("y = 16", "16", "algebra__linear_1d", True),
        ("\\frac{-4}{19}", "-4/19", "arithmetic__mixed", True),  # LaTeX in the box
        ("0.6000000000000001", "0.6", "arithmetic__mul", True),  # a float's rounding, as printed
        ("0.6001", "0.6", "arithmetic__mul", False),
        ("(-201)/39 + (-12)/(-78)", "-5", "arithmetic__mixed", False),  # the question restated is no answer
        ("-10/2", "-5", "arithmetic__div", False),  # nor is an unreduced fraction
        ("-8/38", "-4/19", "arithmetic__div", False),
        ("2, -1", "-1, 2", "algebra__polynomial_roots", True),  # roots in any order
        ("2, -1", "-1, 2", "comparison__sort", False),  # a sort is ordered
        ("(a)", "a", "comparison__closest", True),
        ("yes", "True", "numbers__is_prime", True),
        ("False", "True", "numbers__is_prime", False),
        ("07:26 am", "7:26 AM", "measurement__time", True),
        ("-A1D6", "-a1d6", "arithmetic__add_or_sub_in_base", True),
        ("2*(y + 780350)*(y - 295)", "2*(y - 295)*(y + 780350)", "algebra__polynomial_roots", True),
        ("2*y**2 + 1560110*y - 460406500", "2*(y - 295)*(y + 780350)", "algebra__polynomial_roots", False),
        ("-47*p^3", "-47*p**3", "polynomials__expand", True),
        ("p*(3 - 2)", "p", "polynomials__collect", True),  # sympy evaluates it to p
        ("(t + 1)**2", "t**2 + 2*t + 1", "polynomials__expand", False),  # not expanded
        ("-880 + 109*\\sqrt{2}/4", "-880 + 109*sqrt(2)/4", "arithmetic__simplify_surd", True),
        ("sqrt(8)", "2*sqrt(2)", "arithmetic__simplify_surd", True),  # sympy simplifies sqrt(8) itself
        ("554*a**2 - 2*a + 149", "554*a**2 - 2*a + 149", "algebra__sequence_nth_term", True),
        ("554*x**2 - 2*x + 149", "554*a**2 - 2*a + 149", "algebra__sequence_nth_term", False),
    ],
)
def test_equivalent_answers_pass_where_the_form_allows(
    pred: str, answer: str, module: str, expected: bool
) -> None:
    assert check(pred, answer, module) is expected


def test_the_paper_s_exact_match_is_string_equality() -> None:
    assert exact_match(" 16 ", "16")
    assert not exact_match("-3/4", "-0.75")
    assert not exact_match("y = 16", "16")


def test_model_text_is_never_evaluated(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    hostile = f"__import__('os').system('touch {marker}')"
    assert check(hostile, "1", "arithmetic__mul") is False
    assert check("open('/etc/passwd').read()", "1", "arithmetic__mul") is False
    assert check("x.__class__", "x", "polynomials__collect") is False
    assert not marker.exists()


def test_forms_and_cleaning() -> None:
    assert answer_form("True", "numbers__is_prime") == "bool"
    assert answer_form("-1, 2", "comparison__sort") == "ordered_list"
    assert answer_form("-1, 2", "numbers__list_prime_factors") == "list"
    assert answer_form("2*(y - 295)*(y + 780350)", "algebra__polynomial_roots") == "factor"
    assert clean("$\\boxed{x}$".replace("\\boxed{x}", "\\frac{1}{2}")) == "(1)/(2)"


def test_a_typed_reference_reaches_the_checker_and_a_bad_one_is_an_error_not_a_wrong_answer() -> None:
    ref = typed_reference("mathematics", "comparison__closest", "a")
    assert check_equivalence("(a)", ref) == (True, "ok", "")
    assert check_equivalence("b", ref) == (False, "ok", "")
    broken = typed_reference("mathematics", "")
    equivalent, status, detail = check_equivalence("1", broken)
    assert (equivalent, status) == (False, "error") and "mathematics" in detail
    with pytest.raises(UnsupportedForm):
        check_reference("1", "no separator")
    with pytest.raises(ValueError, match="unknown answer checker"):
        typed_reference("nonesuch", "x")


def test_the_verifier_s_workers_score_typed_references() -> None:
    with Verifier(workers=1, timeout=3.0) as verifier:
        ok = verifier.score(
            "so the answer is \\boxed{-3/4}", typed_reference("mathematics", "arithmetic__div", "-3/4")
        )
        wrong = verifier.score("\\boxed{True}", typed_reference("mathematics", "numbers__is_prime", "False"))
        # A power no machine finishes, inside an expression the checker parses: the worker is killed.
        hostile = verifier.score(
            "\\boxed{x**(9**9**9)}", typed_reference("mathematics", "polynomials__collect", "x")
        )
    assert (ok.reward, ok.correct, ok.status) == (1.0, True, "ok")
    assert (wrong.reward, wrong.correct) == (-1.0, False)
    assert (hostile.reward, hostile.correct) == (-1.0, False)  # a soft or a hard timeout, never a hang
