"""DeepMind Mathematics' answers checked as the benchmark means them (``retool.reward.mathematics``), on real
rows the official generator made for every module (``tests/data/mathematics``), in process and through the
verifier's worker processes."""

from __future__ import annotations

import json
import math
import re
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
        ("198081599.5", "198081599.4", "arithmetic__add_or_sub", False),  # a wrong last digit, any magnitude
        ("0.0008053600", "0.0008053609", "measurement__conversion", False),
        ("-326516380.5", "-326516380.4", "arithmetic__add_or_sub", False),
        ("0.0000000021", "0.000000002106854835", "measurement__conversion", False),  # close, but not it
        ("999.999999999999", "1000", "arithmetic__mul", False),  # the nearest decimal of 15 digits
        ("0.30000000000000004", "0.3", "arithmetic__add_or_sub", True),  # what 0.1 + 0.2 prints
        ("-0.30000000000000004", "-0.3", "arithmetic__add_or_sub", True),
        ("0.30000000000000004", "-0.3", "arithmetic__add_or_sub", False),
        ("15.999999999999998", "16", "arithmetic__mul", True),
        ("0.50", "0.5", "arithmetic__mul", True),  # trailing zeros
        ("5e-1", "1/2", "arithmetic__div", True),  # scientific notation
        ("2.106854835e-09", "0.000000002106854835", "measurement__conversion", True),
        ("2.106854836e-09", "0.000000002106854835", "measurement__conversion", False),
        ("6.39164871455009e+16", "63916487145500894.99", "arithmetic__add_or_sub_big", True),  # past float64
        ("-0.21052631578947367", "-4/19", "arithmetic__div", True),  # a fraction as a float prints it
        ("-0.2105263158", "-4/19", "arithmetic__div", False),  # a rounded decimal is not the fraction
        # Cancellation noise is refused (mathematics._float_printed says why), with the unrounded answer:
        ("145.0599999999995", "145.06", "arithmetic__add_or_sub", False),  # -10577 + 10722.06
        ("0.6228000000000122", "0.62", "numbers__round_number_composed", False),  # 145 - 144.3772, unrounded
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


# A number written with a decimal point, alone or as a list element (``-0.2`` in ``f, -0.2, k``).
_DECIMAL = re.compile(r"-?\d*\.\d+")
# The modules whose fixture rows hold decimal answers (those of every split together).
_DECIMAL_MODULES = {
    "arithmetic__add_or_sub",
    "arithmetic__add_or_sub_big",
    "arithmetic__mul",
    "arithmetic__mul_big",
    "comparison__closest",
    "comparison__sort",
    "comparison__sort_composed",
    "measurement__conversion",
    "numbers__round_number",
    "numbers__round_number_composed",
}


def wrong_digits(number: str) -> list[str]:
    """``number`` with the last of its first 15 significant digits (the most float64 always tells apart)
    one up and one down."""
    digits = [i for i, c in enumerate(number) if c.isdigit()]
    significant = [i for i in digits if i >= next(j for j in digits if number[j] != "0")][:15]
    i = significant[-1]
    return [number[:i] + str((int(number[i]) + step) % 10) + number[i + 1 :] for step in (1, 9)]


def test_a_wrong_digit_is_refused_in_every_module_with_decimal_answers(fixture_data: Path) -> None:
    accepted, modules = [], set()
    for r in rows(fixture_data):
        answer, module = r["answer"], r["module"]
        for found in _DECIMAL.finditer(answer):
            modules.add(module)
            number = found.group()
            for wrong in [*wrong_digits(number), number[1:] if number[0] == "-" else "-" + number]:
                pred = answer[: found.start()] + wrong + answer[found.end() :]
                if check(pred, answer, module):
                    accepted.append((module, pred, answer))
    assert accepted == []
    assert modules == _DECIMAL_MODULES


def test_a_decimal_answer_is_accepted_as_written_and_as_a_float_prints_it(fixture_data: Path) -> None:
    refused = []
    for r in rows(fixture_data):
        answer, module = r["answer"], r["module"]
        if not _DECIMAL.fullmatch(answer) or answer_form(answer, module) != "value":
            continue
        value = float(answer)
        printed = [
            answer + "00",
            repr(value),
            f"{value:.17g}",
            f"{value:.17e}",
            repr(math.nextafter(value, math.inf)),  # a float one step off: the last operation's rounding
            repr(math.nextafter(value, -math.inf)),
        ]
        refused += [(module, pred, answer) for pred in printed if not check(pred, answer, module)]
    assert refused == []


@pytest.mark.parametrize(
    ("computed", "answer", "module"),
    [
        (0.1 + 0.2, "0.3", "arithmetic__add_or_sub"),
        (0.458 + -0.293, "0.165", "arithmetic__add_or_sub"),
        (1.7 + -2.322, "-0.622", "arithmetic__add_or_sub"),
        (63916487145500895 - 0.01, "63916487145500894.99", "arithmetic__add_or_sub_big"),
        (0.05 * 10158.6, "507.93", "arithmetic__mul"),
        (-0.631 * -0.0086288, "0.0054447728", "arithmetic__mul_big"),
        (56207848 * 10.2, "573320049.6", "arithmetic__mul_big"),
        (0.3422231 * 12, "4.1066772", "measurement__conversion"),
        (35094.02 / 1000, "35.09402", "measurement__conversion"),
        (7.584677406 / 3600000000, "0.000000002106854835", "measurement__conversion"),
        (7.584677406 * 1e-6 / 3600, "0.000000002106854835", "measurement__conversion"),
        (-4 / 19, "-4/19", "arithmetic__div"),
        (1 / 3, "1/3", "arithmetic__div"),
    ],
)
def test_what_python_prints_for_a_computed_answer_is_accepted(
    computed: float, answer: str, module: str
) -> None:
    assert check(repr(computed), answer, module)


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
