"""End to end through the real rollout engine, protocol and verifier, with a scripted fake sampler.

The fake sampler answers each (problem, branch, turn) from a script: a right ``\\boxed{}`` answer, a
wrong one, no answer, or tool calls (one that works, one that fails and is retried). Every metric of the
resulting eval is checked against values computed by hand from the script. The same fakes drive a
``retool eval`` subprocess that is SIGKILLed midway and rerun (``test_eval_sigkill_resume``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from retool.backends.interface.clients import SamplingClient
from retool.backends.interface.types import Sample, SamplingParams
from retool.config import Config
from retool.data.problem import Problem
from retool.sandbox.base import ExecResult, Executor

PROBLEMS = [
    Problem(id="p1", question="Problem one: find seventy.", answer="70"),
    Problem(id="p2", question="Problem two: find five hundred eighty-eight.", answer="588"),
    Problem(id="p3", question="Problem three: find five.", answer="5"),
]
REF = {p.id: int(p.answer) for p in PROBLEMS}
# Per mode, per problem: the behaviour of each branch (see FakeSampler.turn_text).
SCRIPTS: dict[str, dict[str, list[str]]] = {
    "retool": {
        "p1": ["tool", "fix", "wrong", "none"],
        "p2": ["fixwrong", "wrong", "wrong", "right"],
        "p3": ["right", "right", "right", "tool"],
    },
    "text-only": {
        "p1": ["right", "wrong", "wrong", "none"],
        "p2": ["wrong", "wrong", "wrong", "wrong"],
        "p3": ["right", "right", "none", "right"],
    },
}
MARK = re.compile(r"@@(\w+)/b(\d+)@@")
LATENCY_OK, LATENCY_ERR = 0.1, 0.2


class FakeExecutor(Executor):
    """'1/0' fails with a traceback, anything else prints 2; latencies are fixed so metrics are exact."""

    timeout = 5.0

    def _run(self, code: str) -> ExecResult:
        if "1/0" in code:
            return ExecResult(False, "", "ZeroDivisionError: division by zero\n", 1, False, LATENCY_ERR)
        return ExecResult(True, "2\n", "", 0, False, LATENCY_OK)


class FakeSampler(SamplingClient):
    """Scripted completions. The first turn of a problem is one request for all branches; each completion
    starts with a marker ``@@<problem>/b<branch>@@`` so later turns know whose prompt they continue."""

    def __init__(self, tokenizer: Any, fmt: Any, mode: str, kill_at_request: int | None = None) -> None:
        self.tok = tokenizer
        self.fmt = fmt
        self.script = SCRIPTS[mode]
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.first_turn_requests = 0
        self.kill_at_request = kill_at_request
        self.prompts: list[str] = []
        self.params: list[SamplingParams] = []

    def turn_text(self, pid: str, branch: int, turn: int) -> str:
        behaviour = self.script[pid][branch]
        right, wrong = REF[pid], REF[pid] + 1
        turns = {
            "right": [f"So the answer is \\boxed{{{right}}}."],
            "wrong": [f"So the answer is \\boxed{{{wrong}}}."],
            "none": ["I am not sure."],
            "tool": [self.fmt.render_call("print(1+1)"), f"The code agrees: \\boxed{{{right}}}"],
            "fix": [
                self.fmt.render_call("print(1/0)"),
                self.fmt.render_call("print(2)"),
                f"\\boxed{{{right}}}",
            ],
            "fixwrong": [self.fmt.render_call("print(1/0)"), f"\\boxed{{{wrong}}}"],
        }[behaviour]
        return f"@@{pid}/b{branch}@@ {turns[turn]}"  # the marker tells later turns whose prompt it is

    def completion(self, text: str) -> Sample:
        tokens = [*self.tok.encode(text, add_special_tokens=False), self.end_id]
        return Sample(tokens=tokens, logprobs=[-0.5] * len(tokens), stop_reason="stop")

    async def sample_async(
        self, prompt_tokens: Sequence[int], num_samples: int, params: SamplingParams
    ) -> list[Sample]:
        await asyncio.sleep(0)
        text = self.tok.decode(list(prompt_tokens))
        self.prompts.append(text)
        self.params.append(params)
        pid = next(p.id for p in PROBLEMS if p.question in text)
        assistant_turns = text.count("<|im_start|>assistant") - 1  # the open header is the current turn
        if assistant_turns == 0:
            self.first_turn_requests += 1
            if self.kill_at_request is not None and self.first_turn_requests == self.kill_at_request:
                os.kill(os.getpid(), signal.SIGKILL)  # die like a preempted job: no cleanup at all
            return [self.completion(self.turn_text(pid, b, 0)) for b in range(num_samples)]
        (branch,) = {int(b) for p, b in MARK.findall(text) if p == pid}
        return [self.completion(self.turn_text(pid, branch, assistant_turns))]


def _problem_cfg() -> Config:
    cfg = Config()
    cfg.rollout.max_code_calls = 4
    cfg.rollout.max_assistant_turns = 6
    cfg.rollout.max_tokens_per_turn = 256
    cfg.rollout.max_trajectory_tokens = 4096
    cfg.sampling.temperature = 1.0
    cfg.sampling.top_p = 0.7
    cfg.reward.verify_workers = 1
    return cfg


@pytest.fixture(scope="module")
def tokenizer(fixture_data: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(fixture_data / "tokenizers" / "Qwen2.5-Instruct")


def run_mode(tokenizer: Any, mode: str, output: Path) -> tuple[dict, FakeSampler]:
    from retool.components import Components
    from retool.evaluate import run_eval
    from retool.protocol import ChatProtocol
    from retool.reward import Verifier

    protocol = ChatProtocol(tokenizer, fmt="auto", use_tools=mode == "retool")
    sampler = FakeSampler(tokenizer, protocol.fmt, mode)
    with Verifier(workers=1, timeout=10.0) as verifier:
        comps = Components(
            backend=None,  # type: ignore[arg-type]  # an eval samples; it never trains
            protocol=protocol,
            verifier=verifier,
            executor=FakeExecutor(),
            sampler=sampler,
        )
        summary = asyncio.run(
            run_eval(PROBLEMS, comps, config=_problem_cfg(), mode=mode, output=output, val_n=4, seed=0)
        )
    return summary, sampler


def n_tokens(tokenizer: Any, texts: list[str]) -> int:
    return sum(len(tokenizer.encode(t, add_special_tokens=False)) + 1 for t in texts)


def test_retool_mode_metrics_by_hand(tokenizer: Any, tmp_path: Path) -> None:
    summary, sampler = run_mode(tokenizer, "retool", tmp_path / "r.jsonl")
    m = summary["metrics"]
    assert summary["status"] == "complete" and m["problems"] == 3 and m["candidates"] == 12
    # correct: p1 2/4 (tool, fix), p2 1/4 (right), p3 4/4
    assert m["average_at_n"] == pytest.approx((2 / 4 + 1 / 4 + 4 / 4) / 3)
    assert m["pass_at_n"] == 1.0
    assert m["pass_at_k"]["2"] == pytest.approx((5 / 6 + 1 / 2 + 1) / 3)
    assert m["pass_at_k"]["4"] == 1.0
    # votes: p1 70 (x2) beats 71; p2 589 (x3) beats 588; p3 5
    assert m["maj_at_n"] == pytest.approx(2 / 3)
    assert m["format_rate"] == pytest.approx(11 / 12)  # only p1's "none" lacks a box
    assert m["tool_call_rate"] == pytest.approx(4 / 12)
    assert m["mean_code_calls"] == pytest.approx(5 / 12)
    assert m["mean_turns"] == pytest.approx(17 / 12)
    assert m["executions"] == 5
    assert m["exec_error_rate"] == pytest.approx(2 / 5)
    assert m["mean_exec_latency"] == pytest.approx((3 * LATENCY_OK + 2 * LATENCY_ERR) / 5)
    assert m["self_correction_given_error"] == pytest.approx(1 / 2)  # fix yes, fixwrong no
    assert m["self_correction_rate"] == pytest.approx(1 / 12)
    assert m["correct_without_code_rate"] == pytest.approx(4 / 12)
    assert m["stop_reasons"] == {"answer": 12}
    texts = [
        sampler.turn_text(p, b, t)
        for p, row in SCRIPTS["retool"].items()
        for b, beh in enumerate(row)
        for t in range({"tool": 2, "fix": 3, "fixwrong": 2}.get(beh, 1))
    ]
    assert m["tokens_generated"] == n_tokens(tokenizer, texts)
    s = summary["settings"]
    assert (s["tool_format"], s["temperature"], s["top_p"], s["val_n"]) == ("hermes", 1.0, 0.7, 4)
    assert all(p.temperature == 1.0 and p.top_p == 0.7 for p in sampler.params)
    assert "code_interpreter" in sampler.prompts[0]  # the tool is registered
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "r.jsonl").read_text().splitlines())}
    rec = records["p1"]
    assert sorted(records) == ["p1", "p2", "p3"] and [c["answer"] for c in rec["candidates"]] == [
        "70",
        "70",
        "71",
        None,
    ]
    assert [c["code_calls"] for c in rec["candidates"]] == [1, 2, 0, 0]


def test_text_only_mode_metrics_by_hand(tokenizer: Any, tmp_path: Path) -> None:
    summary, sampler = run_mode(tokenizer, "text-only", tmp_path / "t.jsonl")
    m = summary["metrics"]
    assert m["average_at_n"] == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)
    assert m["pass_at_n"] == pytest.approx(2 / 3)
    # votes: p1 71 (x2) beats 70 -> 0; p2 589 -> 0; p3 5 -> 1
    assert m["maj_at_n"] == pytest.approx(1 / 3)
    assert m["format_rate"] == pytest.approx(10 / 12)
    assert m["mean_turns"] == 1.0 and m["mean_code_calls"] == 0.0 and m["executions"] == 0
    assert m["self_correction_given_error"] is None
    assert all("code_interpreter" not in p for p in sampler.prompts)  # no tool registered
    assert len(sampler.prompts) == 3  # one request per problem: one turn, all branches at once


# --- SIGKILL and resume through the real CLI ---------------------------------------------------------

CHILD = r"""
import sys
sys.path.insert(0, {tests!r})
import test_eval_rollout as T
from retool import components
from retool.evaluate import runner
from transformers import AutoTokenizer

tok = AutoTokenizer.from_pretrained({tokenizer_dir!r})
kill_at = {kill_at}

class FakeBackend:
    tokenizer = tok

    async def close_async(self):
        pass

def fake_parts(config, tools=True):
    from retool.protocol import ChatProtocol
    from retool.reward import Verifier
    protocol = ChatProtocol.from_config(tok, config, use_tools=tools)
    parts = components.Components(FakeBackend(), protocol, Verifier.from_config(config), T.FakeExecutor())
    parts.refresh_sampler = lambda: _sampler(parts, protocol)
    return parts

async def _sampler(parts, protocol):
    parts.sampler = T.FakeSampler(tok, protocol.fmt, "retool", kill_at_request=kill_at)
    return parts.sampler

runner.build_components = fake_parts  # the harness's backend and sandbox; everything else is real
from retool.cli import app
app(sys.argv[1:], prog_name="retool")
"""


def _child(tmp: Path, tokenizer_dir: Path, args: list[str], kill_at: int | None) -> tuple[int, str, str]:
    """Run ``retool eval`` in a child process; (returncode, stdout, stderr).

    Output goes to files, not pipes, and the child gets its own session: after a SIGKILL, helper
    processes it started may outlive it for a moment, and must neither hold our pipes open nor leak.
    """
    script = tmp / f"child_{kill_at}.py"
    tests = str(Path(__file__).parent)
    script.write_text(CHILD.format(tests=tests, tokenizer_dir=str(tokenizer_dir), kill_at=kill_at))
    out_path, err_path = tmp / f"child_{kill_at}.out", tmp / f"child_{kill_at}.err"
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(script), *args], stdout=out, stderr=err, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # only the group this test started
    return rc, out_path.read_text(), err_path.read_text()


@pytest.mark.slow
def test_eval_sigkill_resume(tokenizer: Any, fixture_data: Path, tmp_path: Path) -> None:
    data = tmp_path / "probs.jsonl"
    data.write_text(
        "".join(json.dumps({"id": p.id, "question": p.question, "answer": p.answer}) + "\n" for p in PROBLEMS)
    )
    out = tmp_path / "killed.jsonl"
    args = [
        "eval",
        "--mode",
        "retool",
        "--model",
        "fake",
        "--dataset",
        str(data),
        "--val-n",
        "4",
        "--temperature",
        "1.0",
        "--top-p",
        "0.7",
        "--output",
        str(out),
        "--concurrency",
        "1",
        "--set",
        "reward.verify_workers=1",
        "--set",
        "rollout.max_tokens_per_turn=256",
    ]
    tok_dir = fixture_data / "tokenizers" / "Qwen2.5-Instruct"
    rc, _, err = _child(tmp_path, tok_dir, args, kill_at=3)  # dies asking for problem 3's first turn
    assert rc == -signal.SIGKILL, err[-2000:]
    done = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert done == ["p1", "p2"]
    with out.open("a") as fh:  # and a torn write on top
        fh.write('{"id": "p3", "index": 2, "candidates": [{"ans')
    rc, out_text, err = _child(tmp_path, tok_dir, args, kill_at=None)
    assert rc == 0, err[-3000:]
    assert "Average@4" in out_text
    final = json.loads(out.with_suffix(".summary.json").read_text())
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["p1", "p2", "p3"]
    # The uninterrupted run (in this process, through the library).
    whole, _ = run_mode(tokenizer, "retool", tmp_path / "whole.jsonl")
    assert final["status"] == whole["status"] == "complete"
    assert final["metrics"] == whole["metrics"]
    assert final["timing"]["sessions"] == 2


@pytest.mark.slow
def test_evaluate_local_backend_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The real path: local backend sampler, ChatProtocol, forkserver sandbox; results independent of how
    many problems run at once (per-problem seeds), and a rerun of a finished eval does nothing."""
    from retool.config import override_config
    from retool.env import ProblemList
    from retool.evaluate import evaluate

    cfg = _problem_cfg()
    cfg.model.name = str(tiny_model_dir)
    cfg.backend.device = "cpu"
    cfg.rollout.max_tokens_per_turn = 16
    cfg.sandbox.workers = 1
    cfg.eval.val_n = 2
    probs = [Problem(id=f"t{i}", question=f"What is {i} + {i}?", answer=str(2 * i)) for i in range(3)]
    kw = {"mode": "retool", "source": ProblemList(probs, name="toy")}
    a = evaluate(override_config(cfg, ["eval.concurrency=1"]), output=tmp_path / "a.jsonl", **kw)
    b = evaluate(override_config(cfg, ["eval.concurrency=3"]), output=tmp_path / "b.jsonl", **kw)
    assert a["status"] == b["status"] == "complete" and a["metrics"]["candidates"] == 6
    assert a["settings"]["tool_format"] == "hermes" and a["settings"]["model"] == str(tiny_model_dir)

    def texts(p: Path) -> dict:
        rows = [json.loads(line) for line in p.read_text().splitlines()]
        return {r["id"]: [c["final_text_tail"] for c in r["candidates"]] for r in rows}

    assert texts(tmp_path / "a.jsonl") == texts(tmp_path / "b.jsonl")
    again = evaluate(override_config(cfg, ["eval.concurrency=2"]), output=tmp_path / "a.jsonl", **kw)
    assert again["metrics"] == a["metrics"] and again["timing"]["sessions"] == 2
