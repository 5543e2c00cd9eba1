"""retool.reward answer extraction and in-process equivalence (the chapter's exercise pairs)."""

from __future__ import annotations

import time

import pytest

from retool.reward import answers_equivalent, check_equivalence, extract_last_boxed, score_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}} done", "\\frac{\\sqrt{3}}{2}"),
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("no box here", None),
        ("\\boxed{unclosed \\frac{1}{2}", None),
        ("\\boxed{1} and a dangling \\boxed{", None),  # only the last marker counts, as in the chapter
        ("\\boxed{}", ""),
        ("\\boxed{{a}{b}}", "{a}{b}"),
    ],
)
def test_extract_last_boxed(text: str, expected: str | None) -> None:
    assert extract_last_boxed(text) == expected


def test_extract_is_fast_on_hostile_text() -> None:
    hostile = ["\\boxed{" * 20000 + "1", "\\boxed{" + "{" * 50000 + "}" * 50000 + "}", "}" * 100000]
    start = time.monotonic()
    results = [extract_last_boxed(t) for t in hostile]
    assert time.monotonic() - start < 2.0
    assert results[0] is None
    assert results[1] == "{" * 50000 + "}" * 50000


# The chapter's exercise (8.4.4): which pairs does math-verify count as equal? Pinned to what math-verify
# 0.9 decides; if an upgrade changes a verdict, this test says which one.
CHAPTER_PAIRS = [
    ("1/2", "0.5", True),
    ("\\frac{1}{2}", "0.5", True),
    ("x+1", "1+x", True),
    ("128", "128.0", True),
    ("3", "\\sqrt{9}", True),
]


@pytest.mark.parametrize(("pred", "ref", "expected"), CHAPTER_PAIRS)
def test_chapter_pairs(pred: str, ref: str, expected: bool) -> None:
    assert answers_equivalent(pred, ref) is expected


@pytest.mark.parametrize(("pred", "ref"), [("2", "3"), ("x+2", "x+1"), ("\\frac{1}{3}", "0.5"), ("", "5")])
def test_non_equivalent(pred: str, ref: str) -> None:
    assert answers_equivalent(pred, ref) is False
    assert check_equivalence(pred, ref)[1] == "ok"  # a wrong answer is not a verifier error


def test_math_verify_exceptions_are_errors_not_wrong_answers() -> None:
    equivalent, status, detail = check_equivalence("9" * 5000, "7")
    assert (equivalent, status) == (False, "error")
    assert detail.startswith("parse:")
    assert answers_equivalent("9" * 5000, "7") is False


def test_score_answer_in_process_uses_last_300_chars() -> None:
    good = score_answer("reasoning ... so \\boxed{\\frac{1}{2}}", "0.5")
    assert (good.reward, good.correct, good.valid_format, good.answer, good.status) == (
        1.0,
        True,
        True,
        "\\frac{1}{2}",
        "ok",
    )
    wrong = score_answer("\\boxed{3}", "4")
    assert (wrong.reward, wrong.correct, wrong.valid_format, wrong.status) == (-1.0, False, True, "ok")
    missing = score_answer("I think it is 4", "4")
    assert (missing.reward, missing.valid_format, missing.answer, missing.status) == (
        -1.0,
        False,
        None,
        "no_answer",
    )
    # A box earlier than the last 300 characters does not count.
    early = score_answer("\\boxed{4}" + " filler" * 60, "4")
    assert early.status == "no_answer" and early.reward == -1.0


def test_in_process_check_works_off_the_main_thread() -> None:
    # math-verify's default timeout uses signal.alarm, which raises in a non-main thread; ours never does.
    import threading

    results: list[bool] = []
    thread = threading.Thread(target=lambda: results.append(answers_equivalent("1/2", "0.5")))
    thread.start()
    thread.join()
    assert results == [True]
