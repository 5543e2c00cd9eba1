"""retool.reward.Verifier: worker processes, hard timeouts on hostile answers, stats, async, CLI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from retool.reward import Verifier

TIMEOUT = 2.0
# Returning "within the timeout" allows for the IPC and killing a worker on a loaded 2-core machine.
SLACK = 1.5

HOSTILE = {
    "nested_braces_10kB": "{" * 5000 + "1" + "}" * 5000,
    "thousands_of_boxed": "\\boxed{" * 3000 + "1" + "}" * 3000,
    "power_tower": "10^{10^{10}}",
    "digits_1e5": "9" * 100_000,
}


@pytest.fixture(scope="module")
def verifier() -> Iterator[Verifier]:
    with Verifier(workers=2, timeout=TIMEOUT) as v:
        yield v


def test_verify_basic(verifier: Verifier) -> None:
    ok = verifier.verify("\\frac{1}{2}", "0.5")
    assert (ok.equivalent, ok.status) == (True, "ok")
    wrong = verifier.verify("2", "3")
    assert (wrong.equivalent, wrong.status) == (False, "ok")


def test_chapter_pairs_match_in_process(verifier: Verifier) -> None:
    from retool.reward import answers_equivalent

    pairs = [("1/2", "0.5"), ("\\frac{1}{2}", "0.5"), ("x+1", "1+x"), ("128", "128.0"), ("3", "\\sqrt{9}")]
    for pred, ref in pairs:
        assert verifier.verify(pred, ref).equivalent == answers_equivalent(pred, ref)


@pytest.mark.parametrize("name", sorted(HOSTILE))
@pytest.mark.parametrize("side", ["pred", "ref"])
def test_hostile_answers_return_within_timeout(verifier: Verifier, name: str, side: str) -> None:
    hostile = HOSTILE[name]
    pred, ref = (hostile, "7") if side == "pred" else ("7", hostile)
    before = verifier.stats
    start = time.monotonic()
    outcome = verifier.verify(pred, ref)
    elapsed = time.monotonic() - start
    # elapsed_s is the check itself (send to answer or kill); the wall time may also include waiting for a
    # replacement worker to start, which the verifier deliberately does not charge to the check.
    assert outcome.elapsed_s < TIMEOUT + SLACK, f"{name} took {outcome.elapsed_s:.2f}s"
    assert elapsed < 60
    assert outcome.equivalent is False
    assert outcome.status in ("ok", "timeout", "error")
    after = verifier.stats
    assert after.checks == before.checks + 1
    # The pool still works afterwards.
    assert verifier.verify("4", "4").equivalent


def test_timeouts_and_errors_are_counted_apart_from_wrong_answers() -> None:
    with Verifier(workers=1, timeout=3.0) as v:
        wrong = v.verify("1", "2")
        # More digits than Python's int-from-string limit (4300): math-verify raises, which is an error.
        error = v.verify("9" * 5000, "7")
        timeout = v.verify(HOSTILE["power_tower"], "5")
        stats = v.stats
    assert (wrong.status, error.status, timeout.status) == ("ok", "error", "timeout")
    assert "SympifyError" in error.detail
    assert not (wrong.equivalent or error.equivalent or timeout.equivalent)
    assert (stats.checks, stats.wrong, stats.errors, stats.timeouts, stats.equivalent) == (3, 1, 1, 1, 0)


def test_hung_worker_is_killed_and_replaced() -> None:
    # soft_fraction > 1: the in-worker alarm never fires first, so the parent's hard kill must act.
    with Verifier(workers=1, timeout=1.0, soft_fraction=50.0) as v:
        assert v.verify("1", "1").equivalent  # the worker is up
        start = time.monotonic()
        outcome = v.verify(HOSTILE["power_tower"], "5")
        assert time.monotonic() - start < 1.0 + SLACK
        assert outcome.status == "timeout"
        assert v.stats.worker_kills == 1
        assert v.verify("x+1", "1+x").equivalent  # the replacement answers
        assert v.stats.worker_starts == 2


def test_crashed_worker_reports_error_and_is_replaced() -> None:
    with Verifier(workers=1, timeout=5.0) as v:
        assert v.verify("1", "1").equivalent
        worker = v._idle.get()
        v._idle.put(worker)
        worker.process.kill()  # simulate a worker dying (OOM killer, segfault)
        worker.process.wait()
        outcome = v.verify("1", "1")
        assert outcome.status == "error" and not outcome.equivalent
        assert v.verify("2", "2").equivalent
        assert v.stats.errors == 1


def test_async_and_threads(verifier: Verifier) -> None:
    async def main() -> list:
        return await asyncio.gather(*[verifier.averify(str(i), str(i)) for i in range(12)])

    outcomes = asyncio.run(main())
    assert all(o.equivalent and o.status == "ok" for o in outcomes)

    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(verifier.verify(str(i), str(i + 1)).equivalent))
        for i in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [False] * 6


def test_score_and_ascore(verifier: Verifier) -> None:
    good = verifier.score("so the answer is \\boxed{\\frac{1}{2}}", "0.5")
    assert (good.reward, good.correct, good.valid_format, good.answer, good.status) == (
        1.0,
        True,
        True,
        "\\frac{1}{2}",
        "ok",
    )
    none = asyncio.run(verifier.ascore("no box", "1"))
    assert (none.reward, none.valid_format, none.status) == (-1.0, False, "no_answer")
    wrong = asyncio.run(verifier.ascore("\\boxed{7}", "8"))
    assert (wrong.reward, wrong.correct, wrong.valid_format, wrong.status) == (-1.0, False, True, "ok")


def test_closed_verifier_refuses() -> None:
    v = Verifier(workers=1, timeout=1.0)
    v.close()
    with pytest.raises(RuntimeError, match="closed"):
        v.verify("1", "1")


def test_cli_verify_prints_one_json_line() -> None:
    from retool.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["verify", "\\frac{1}{2}", "0.5"])
    assert result.exit_code == 0
    assert json.loads(result.stdout.strip()) == {"equivalent": True, "status": "ok"}
    result = runner.invoke(app, ["verify", "--timeout", "1", "10^{10^{10}}", "5"])
    assert result.exit_code == 0
    assert json.loads(result.stdout.strip()) == {"equivalent": False, "status": "timeout"}
    result = runner.invoke(app, ["verify", "9" * 5000, "7"])
    assert result.exit_code == 0
    assert json.loads(result.stdout.strip()) == {"equivalent": False, "status": "error"}


def test_cli_verify_takes_negative_answers() -> None:
    from retool.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["verify", "-0", "0"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip()) == {"equivalent": True, "status": "ok"}
    result = runner.invoke(app, ["verify", "--timeout", "4", "-1/2", "-0.5"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip()) == {"equivalent": True, "status": "ok"}
    result = runner.invoke(app, ["verify", "-3", "3"])
    assert json.loads(result.stdout.strip()) == {"equivalent": False, "status": "ok"}


def test_cli_verify_subprocess_has_no_main_guard_problem(tmp_path) -> None:
    # A script without `if __name__ == "__main__"` must work: workers never re-import the caller's main.
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from retool.reward import Verifier\nv = Verifier(workers=1, timeout=5)\nprint(v.verify('2', '2').equivalent)\nv.close()\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_help_lists_prepare_and_verify() -> None:
    from retool.cli import app

    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "prepare" in result.stdout and "verify" in result.stdout


def test_from_config_wires_the_reward_section() -> None:
    from retool.config import RewardConfig, load_config

    cfg = load_config(None, ["reward.verify_workers=1", "reward.verify_timeout=3.5", "reward.tail_chars=20"])
    for source in (cfg, cfg.reward):
        with Verifier.from_config(source) as v:
            assert (v.workers, v.timeout, v.tail_chars) == (1, 3.5, 20)
    # tail_chars decides what is scored: a box more than 20 characters from the end is not read.
    with Verifier.from_config(RewardConfig(verify_workers=1, tail_chars=20)) as v:
        late = v.score("\\boxed{4}" + " " * 30, "4")
        assert (late.valid_format, late.status) == (False, "no_answer")
        assert v.score("x" * 40 + "\\boxed{4}", "4").correct
