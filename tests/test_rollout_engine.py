"""Rollout engine and ReTool environment tests with a scripted sampler and a fake executor over a real tokenizer.

The sampler is scripted per (problem index, branch, turn): it recovers that key from the request seed
(``request_seed`` is public and deterministic), encodes the scripted text with the tiny model's tokenizer
and appends the end-of-turn token, as a real sampler would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# The chapter's round-synchronous scheduling is a comparison the benchmarks keep (bench/_round_sync.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _round_sync import run_round_sync
from retool.backends.interface.clients import SamplingClient
from retool.backends.interface.types import Sample, SamplingParams
from retool.config import RolloutConfig, SamplingConfig
from retool.data.problem import Problem
from retool.env import (
    AssistantTurn,
    Budgets,
    Env,
    EnvGroupBuilder,
    Observation,
    Outcome,
    ReToolGroupBuilder,
    ReToolOutcome,
    StepResult,
    ToolSetup,
    retool_outcome,
)
from retool.protocol import ChatProtocol
from retool.rollout import (
    STOP_REASONS,
    RolloutRequest,
    Trajectory,
    request_seed,
    run_rollout,
)
from retool.sandbox.base import ExecResult, Executor
from retool.train.sampling import run_group_rollouts


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def make_protocol(tokenizer: Any, use_tools: bool = True) -> ChatProtocol:
    return ChatProtocol(tokenizer, use_tools=use_tools)


@pytest.fixture(scope="module")
def protocol(tokenizer):
    return make_protocol(tokenizer)


def call(protocol: Any, code: str, prefix: str = "Let me compute.\n") -> str:
    return prefix + protocol.fmt.render_call(code)


# -- fakes --------------------------------------------------------------------------------------------


class ScriptedSampler(SamplingClient):
    """Returns scripted completions keyed by (problem index, branch, turn); records every request."""

    def __init__(
        self,
        tokenizer: Any,
        protocol: Any,
        script: dict,
        *,
        seed: int = 0,
        n_problems: int = 4,
        group_size: int = 4,
        turns: int = 8,
        delay: float = 0.0,
        fail: set | None = None,
        events: list | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.end = next(iter(protocol.stop_token_ids))
        self.script = script
        self.keys = {
            request_seed(seed, p, b, t): (p, b, t)
            for p in range(n_problems)
            for b in range(-1, group_size)
            for t in range(turns)
        }
        self.delay = delay
        self.fail = fail or set()
        self.events = events if events is not None else []
        self.requests: list[dict] = []
        self.inflight = 0
        self.max_inflight = 0

    def _sample(self, text: str, max_tokens: int, k: int) -> Sample:
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.end]
        stop = "stop"
        if len(ids) > max_tokens:
            ids, stop = ids[:max_tokens], "length"
        return Sample(
            tokens=ids, logprobs=[-0.01 * (k + 1 + i % 7) for i in range(len(ids))], stop_reason=stop
        )

    async def sample_async(self, prompt_tokens, num_samples: int, params: SamplingParams) -> list[Sample]:
        key = self.keys[params.seed]
        self.requests.append(
            {
                "key": key,
                "num_samples": num_samples,
                "max_tokens": params.max_tokens,
                "prompt_len": len(prompt_tokens),
                "stop": params.stop,
            }
        )
        self.events.append(("sample", key))
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.inflight -= 1
        if key in self.fail:
            raise ConnectionError(f"scripted failure at {key}")
        p, b, t = key
        if b == -1:
            texts = [self.script[(p, i, 0)] for i in range(num_samples)]
            return [self._sample(x, params.max_tokens, i) for i, x in enumerate(texts)]
        return [self._sample(self.script[(p, b, t)], params.max_tokens, b)]


class FakeExecutor(Executor):
    """Code -> scripted result. ``outputs[code] = (stdout, ok, delay)``; code "RAISE" raises."""

    timeout = 30.0

    def __init__(self, outputs: dict | None = None, events: list | None = None) -> None:
        super().__init__()
        self.outputs = outputs or {}
        self.events = events if events is not None else []
        self.calls: list[str] = []

    def _run(self, code: str) -> ExecResult:  # pragma: no cover - arun is overridden
        raise NotImplementedError

    async def arun(self, code: str) -> ExecResult:
        self.calls.append(code)
        self.events.append(("exec_start", code))
        stdout, ok, delay = self.outputs.get(code, (f"out:{code}\n", True, 0.0))
        await asyncio.sleep(delay)
        self.events.append(("exec_end", code))
        if code == "RAISE":
            raise OSError("sandbox worker died")
        result = ExecResult(
            ok=ok,
            stdout=stdout if ok else "",
            stderr="" if ok else stdout,
            returncode=0 if ok else 1,
            timed_out=False,
            latency=delay,
        )
        self.stats.record(result)
        return result


@dataclass
class _Reward:
    reward: float
    correct: bool
    valid_format: bool
    answer: str | None
    status: str


class FakeVerifier:
    def __init__(self) -> None:
        self.seen: list[str] = []

    async def ascore(self, text: str, ref: str) -> _Reward:
        self.seen.append(text)
        m = re.findall(r"\\boxed\{([^{}]*)\}", text[-300:])
        if not m:
            return _Reward(-1.0, False, False, None, "no_answer")
        ok = m[-1].strip() == ref.strip()
        return _Reward(1.0 if ok else -1.0, ok, True, m[-1], "ok")


PROBLEMS = [Problem(id=f"p{i}", question=f"What is {i} + {i}?", answer=str(2 * i)) for i in range(4)]


SCHEDULERS = {"per_trajectory": run_rollout, "round_sync": run_round_sync}


def run(
    problems,
    sampler,
    protocol,
    executor,
    *,
    group_size,
    seed=0,
    use_tools=True,
    verifier=None,
    on_trajectory=None,
    scheduling="per_trajectory",
    **rollout_kw,
) -> list[list[Trajectory]]:
    cfg = RolloutConfig(**rollout_kw)
    return asyncio.run(
        run_group_rollouts(
            problems,
            sampler=sampler,
            protocol=protocol,
            executor=executor,
            verifier=verifier or FakeVerifier(),
            rollout=cfg,
            sampling=SamplingConfig(temperature=0.7, top_p=0.9),
            group_size=group_size,
            seed=seed,
            use_tools=use_tools,
            on_trajectory=on_trajectory,
            rollout_fn=SCHEDULERS[scheduling],
        )
    )


def run_one(sampler, protocol, executor, **rollout_kw) -> Trajectory:
    """The one trajectory of a one-branch group on the first problem."""
    (group,) = run(PROBLEMS[:1], sampler, protocol, executor, group_size=1, **rollout_kw)
    return group[0]


# -- tests --------------------------------------------------------------------------------------------


def test_single_turn_answers_group_branching_and_rewards(tokenizer, protocol):
    script = {
        (0, 0, 0): "It is \\boxed{0}",
        (0, 1, 0): "It is \\boxed{5}",
        (0, 2, 0): "no box here",
        (1, 0, 0): "\\boxed{2}",
        (1, 1, 0): "\\boxed{2}",
        (1, 2, 0): "\\boxed{3}",
    }
    sampler = ScriptedSampler(tokenizer, protocol, script, group_size=3)
    seen: list[Trajectory] = []
    groups = run(PROBLEMS[:2], sampler, protocol, FakeExecutor(), group_size=3, on_trajectory=seen.append)
    assert [len(g) for g in groups] == [3, 3]
    assert [r["num_samples"] for r in sampler.requests] == [3, 3]  # one group request per question
    assert [[t.reward for t in g] for g in groups] == [[1.0, -1.0, -1.0], [1.0, 1.0, -1.0]]
    assert [t.outcome.valid_format for t in groups[0]] == [True, True, False]
    assert all(t.outcome.stop_reason == "answer" for g in groups for t in g)
    assert [t.group_index for t in groups[1]] == [0, 1, 2]
    assert all(t.problem is PROBLEMS[1] for t in groups[1])
    assert sorted(id(t) for t in seen) == sorted(id(t) for g in groups for t in g)
    t = groups[0][1]
    assert t.outcome.final_text == "It is \\boxed{5}" and t.outcome.answer == "5"
    assert t.full_tokens() == [*t.turns[0].prompt_tokens, *t.turns[0].completion_tokens]
    assert t.completion_token_count == len(t.turns[0].completion_tokens)
    assert t.turns[0].completion_tokens[-1] in protocol.stop_token_ids  # the emitted stop token is kept
    # Branches share the prompt but are independent objects.
    assert groups[0][0].turns[0].prompt_tokens == groups[0][1].turns[0].prompt_tokens
    assert groups[0][0].outcome.messages is not groups[0][1].outcome.messages


def test_three_turn_continuity_and_records(tokenizer, protocol):
    script = {
        (0, 0, 0): call(protocol, "print(1/0)"),
        (0, 0, 1): call(protocol, "print(2 + 2)", prefix="Fix it.\n"),
        (0, 0, 2): "So the answer is \\boxed{0}",
        (0, 1, 0): "\\boxed{1}",
    }
    executor = FakeExecutor(
        {
            "print(1/0)": ("ZeroDivisionError: division by zero\n", False, 0.0),
            "print(2 + 2)": ("4\n", True, 0.0),
        }
    )
    sampler = ScriptedSampler(tokenizer, protocol, script, group_size=2)
    (group,) = run(PROBLEMS[:1], sampler, protocol, executor, group_size=2)
    t = group[0]
    assert t.outcome.stop_reason == "answer" and t.outcome.correct and t.reward == 1.0
    assert len(t.turns) == 3 and t.outcome.code_calls == 2
    assert t.outcome.codes == ("print(1/0)", "print(2 + 2)") and executor.calls == list(t.outcome.codes)
    assert [r.ok for r in t.outcome.exec_results] == [False, True]
    assert "ZeroDivisionError" in t.outcome.observations[0] and "4" in t.outcome.observations[1]
    # Continuity: each prompt starts with the previous prompt + its completion.
    for prev, cur in zip(t.turns, t.turns[1:], strict=False):
        head = [*prev.prompt_tokens, *prev.completion_tokens]
        assert cur.prompt_tokens[: len(head)] == head
        assert len(cur.prompt_tokens) > len(head)  # the observation and header follow
    t.check_continuity()
    full = t.full_tokens()
    assert full[: len(t.turns[0].prompt_tokens)] == t.turns[0].prompt_tokens
    assert full == [*t.turns[2].prompt_tokens, *t.turns[2].completion_tokens]
    assert t.completion_token_count == sum(len(x.completion_tokens) for x in t.turns)
    # Every sampled token sits at its recorded place in the full sequence, with its logprobs kept.
    for turn in t.turns:
        n = len(turn.prompt_tokens)
        assert full[n : n + len(turn.completion_tokens)] == turn.completion_tokens
        assert len(turn.logprobs) == len(turn.completion_tokens)
    assert [m["role"] for m in t.outcome.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert t.outcome.final_text == "So the answer is \\boxed{0}"
    assert t.outcome.had_exec_error and t.outcome.had_error_then_correct
    assert [x.kind for x in t.turns] == ["tool", "tool", "answer"]
    # The group request asks for 2 samples; the continuations of branch 0 for 1 each.
    assert [(r["key"], r["num_samples"]) for r in sampler.requests] == [
        ((0, -1, 0), 2),
        ((0, 0, 1), 1),
        ((0, 0, 2), 1),
    ]
    assert (
        group[1].outcome.stop_reason == "answer"
        and not group[1].outcome.correct
        and group[1].outcome.code_calls == 0
    )


def test_self_correction_needs_a_retry(tokenizer, protocol):
    script = {(0, 0, 0): call(protocol, "bad()"), (0, 0, 1): "\\boxed{0}"}
    executor = FakeExecutor({"bad()": ("NameError: name 'bad' is not defined\n", False, 0.0)})
    t = run_one(ScriptedSampler(tokenizer, protocol, script, group_size=1), protocol, executor)
    assert t.outcome.correct and t.outcome.had_exec_error and not t.outcome.had_error_then_correct


def test_max_code_calls_ends_without_executing(tokenizer, protocol):
    script = {(0, 0, 0): call(protocol, "print(1)"), (0, 0, 1): call(protocol, "print(2)")}
    executor = FakeExecutor()
    t = run_one(
        ScriptedSampler(tokenizer, protocol, script, group_size=1),
        protocol,
        executor,
        max_code_calls=1,
        max_assistant_turns=6,
    )
    assert t.outcome.stop_reason == "max_code_calls" and t.reward == -1.0 and not t.outcome.correct
    assert executor.calls == ["print(1)"] and t.outcome.code_calls == 1 and len(t.turns) == 2
    assert t.outcome.final_text == t.turns[-1].text


def test_max_turns_on_a_tool_call(tokenizer, protocol):
    script = {(0, 0, k): call(protocol, f"print({k})") for k in range(6)}
    executor = FakeExecutor()
    t = run_one(
        ScriptedSampler(tokenizer, protocol, script, group_size=1),
        protocol,
        executor,
        max_code_calls=10,
        max_assistant_turns=3,
    )
    assert t.outcome.stop_reason == "max_turns" and t.reward == -1.0
    assert len(t.turns) == 3 and executor.calls == ["print(0)", "print(1)"]


@pytest.mark.parametrize(
    "text",
    [
        "{call}\nand then more text",  # text after the call
        "{call}{call}",  # two calls in one turn
        "<tool_call>not json</tool_call>",  # malformed call
    ],
)
def test_invalid_turn_ends_with_minus_one(tokenizer, protocol, text):
    script = {
        (0, 0, 0): text.replace("{call}", protocol.fmt.render_call("print(1)")),
        (0, 1, 0): "\\boxed{0}",
    }
    executor = FakeExecutor()
    (group,) = run(
        PROBLEMS[:1],
        ScriptedSampler(tokenizer, protocol, script, group_size=2),
        protocol,
        executor,
        group_size=2,
    )
    assert group[0].outcome.stop_reason == "invalid" and group[0].reward == -1.0 and executor.calls == []
    assert group[1].outcome.stop_reason == "answer" and group[1].reward == 1.0


def test_tokens_per_turn_is_capped_by_remaining_trajectory_budget(tokenizer, protocol):
    script = {(0, 0, 0): call(protocol, "print(1)"), (0, 0, 1): "\\boxed{0}"}
    prompt_len = len(protocol.build_prompt(protocol.initial_messages(PROBLEMS[0].question)))
    sampler = ScriptedSampler(tokenizer, protocol, script, group_size=1)
    t = run_one(
        sampler,
        protocol,
        FakeExecutor(),
        max_tokens_per_turn=64,
        max_trajectory_tokens=prompt_len + 5000,
    )
    assert [r["max_tokens"] for r in sampler.requests] == [64, 64]
    assert t.outcome.stop_reason == "answer"

    sampler = ScriptedSampler(tokenizer, protocol, script, group_size=1)
    t = run_one(
        sampler,
        protocol,
        FakeExecutor(),
        max_tokens_per_turn=64,
        max_trajectory_tokens=prompt_len + 10,
    )
    assert sampler.requests[0]["max_tokens"] == 10
    assert t.turns[0].sampler_stop == "length" and len(t.turns[0].completion_tokens) == 10
    assert len(t.full_tokens()) <= prompt_len + 10


def test_context_full_when_observation_does_not_fit(tokenizer, protocol):
    first = call(protocol, "print('x' * 500)")
    script = {(0, 0, 0): first, (0, 0, 1): "\\boxed{0}"}
    prompt_len = len(protocol.build_prompt(protocol.initial_messages(PROBLEMS[0].question)))
    first_len = len(tokenizer.encode(first, add_special_tokens=False)) + 1
    executor = FakeExecutor({"print('x' * 500)": ("x y z " * 200, True, 0.0)})
    sampler = ScriptedSampler(tokenizer, protocol, script, group_size=1)
    t = run_one(
        sampler,
        protocol,
        executor,
        max_observation_tokens=400,
        max_trajectory_tokens=prompt_len + first_len + 30,
    )
    assert t.outcome.stop_reason == "context_full" and t.reward == -1.0
    assert executor.calls == ["print('x' * 500)"] and len(t.turns) == 1 and len(t.outcome.observations) == 1
    assert len(sampler.requests) == 1


def test_context_full_before_the_first_turn(tokenizer, protocol):
    sampler = ScriptedSampler(tokenizer, protocol, {}, group_size=2)
    (group,) = run(PROBLEMS[:1], sampler, protocol, FakeExecutor(), group_size=2, max_trajectory_tokens=5)
    assert [t.outcome.stop_reason for t in group] == ["context_full", "context_full"]
    assert sampler.requests == [] and all(t.full_tokens() == [] and t.reward == -1.0 for t in group)


def test_observation_trimming_keeps_the_tail(tokenizer, protocol):
    lines = [f'  File "<string>", line {i}, in f{i}' for i in range(60)]
    traceback = (
        "Traceback (most recent call last):\n" + "\n".join(lines) + "\nZeroDivisionError: division by zero\n"
    )
    script = {(0, 0, 0): call(protocol, "f0()"), (0, 0, 1): "\\boxed{0}"}
    executor = FakeExecutor({"f0()": (traceback, False, 0.0)})
    t = run_one(
        ScriptedSampler(tokenizer, protocol, script, group_size=1),
        protocol,
        executor,
        max_observation_tokens=64,
    )
    obs = t.outcome.observations[0]
    assert t.outcome.observations_trimmed == (True,)
    assert obs.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "Traceback (most recent call last)" not in obs  # the head is what goes
    assert len(tokenizer.encode(obs, add_special_tokens=False)) <= 64 + 8  # a short trim marker may be added
    # The model sees the trimmed text, not the whole traceback.
    seen = tokenizer.decode(t.turns[1].prompt_tokens[len(t.turns[0].prompt_tokens) :])
    assert "ZeroDivisionError" in seen and "line 0, in f0" not in seen
    assert t.outcome.stop_reason == "answer" and t.outcome.correct


def test_sampler_failure_ends_only_that_trajectory(tokenizer, protocol):
    script = {
        (0, 0, 0): call(protocol, "print(1)"),
        (0, 0, 1): "\\boxed{0}",
        (0, 1, 0): call(protocol, "print(2)"),
        (0, 1, 1): "\\boxed{0}",
        (1, 0, 0): "\\boxed{2}",
        (1, 1, 0): "\\boxed{2}",
    }
    sampler = ScriptedSampler(tokenizer, protocol, script, group_size=2, fail={(0, 1, 1)})
    g0, g1 = run(PROBLEMS[:2], sampler, protocol, FakeExecutor(), group_size=2)
    assert [t.outcome.stop_reason for t in g0] == ["answer", "sampler_error"]
    assert g0[1].reward == -1.0 and "scripted failure" in (g0[1].outcome.error or "")
    assert len(g0[1].turns) == 1 and g0[1].outcome.code_calls == 1
    assert [t.reward for t in g1] == [1.0, 1.0]

    # A failed group request ends that question's whole group, and only it.
    sampler = ScriptedSampler(tokenizer, protocol, script, group_size=2, fail={(0, -1, 0)})
    g0, g1 = run(PROBLEMS[:2], sampler, protocol, FakeExecutor(), group_size=2)
    assert [t.outcome.stop_reason for t in g0] == ["sampler_error", "sampler_error"]
    assert all(t.turns == () and t.transitions == () for t in g0)
    assert [t.reward for t in g1] == [1.0, 1.0]


@pytest.mark.parametrize("scheduling", ["per_trajectory", "round_sync"])
def test_executor_failure_ends_only_that_trajectory(tokenizer, protocol, scheduling):
    script = {
        (0, 0, 0): call(protocol, "RAISE"),
        (0, 1, 0): call(protocol, "print(1)"),
        (0, 1, 1): "\\boxed{0}",
    }
    (group,) = run(
        PROBLEMS[:1],
        ScriptedSampler(tokenizer, protocol, script, group_size=2),
        protocol,
        FakeExecutor(),
        group_size=2,
        scheduling=scheduling,
    )
    assert group[0].outcome.stop_reason == "executor_error" and group[0].reward == -1.0
    assert "sandbox worker died" in (group[0].outcome.error or "")
    assert group[1].outcome.stop_reason == "answer" and group[1].outcome.correct


def _overlap_run(tokenizer, protocol, scheduling: str) -> list:
    events: list = []
    script = {
        (0, 0, 0): call(protocol, "fast()"),
        (0, 0, 1): call(protocol, "fast2()"),
        (0, 0, 2): "\\boxed{0}",
        (0, 1, 0): call(protocol, "slow()"),
        (0, 1, 1): "\\boxed{0}",
    }
    executor = FakeExecutor(
        {"fast()": ("1\n", True, 0.0), "fast2()": ("2\n", True, 0.0), "slow()": ("3\n", True, 0.5)},
        events=events,
    )
    sampler = ScriptedSampler(tokenizer, protocol, script, group_size=2, events=events)
    (group,) = run(PROBLEMS[:1], sampler, protocol, executor, group_size=2, scheduling=scheduling)
    assert [t.outcome.stop_reason for t in group] == ["answer", "answer"] and all(
        t.outcome.correct for t in group
    )
    return events


def test_per_trajectory_scheduling_overlaps_sampling_and_execution(tokenizer, protocol):
    events = _overlap_run(tokenizer, protocol, "per_trajectory")
    slow_end = events.index(("exec_end", "slow()"))
    # The fast branch sampled again, executed again and finished before the slow execution returned.
    assert events.index(("sample", (0, 0, 1))) < slow_end
    assert events.index(("exec_end", "fast2()")) < slow_end
    assert events.index(("sample", (0, 0, 2))) < slow_end


def test_round_sync_scheduling_waits_for_the_round(tokenizer, protocol):
    events = _overlap_run(tokenizer, protocol, "round_sync")
    slow_end = events.index(("exec_end", "slow()"))
    assert events.index(("sample", (0, 0, 1))) > slow_end  # the barrier holds the fast branch back


def test_schedulers_produce_the_same_trajectories(tokenizer, protocol):
    script = {}
    for p in range(3):
        for b in range(3):
            n_calls = (p + b) % 3
            for k in range(n_calls):
                script[(p, b, k)] = call(protocol, f"print({p}*{b}+{k})")
            script[(p, b, n_calls)] = f"\\boxed{{{2 * p if b != 1 else 7}}}"
    out = {}
    for scheduling in ("per_trajectory", "round_sync"):
        sampler = ScriptedSampler(tokenizer, protocol, script, seed=3, group_size=3, delay=0.001)
        groups = run(
            PROBLEMS[:3], sampler, protocol, FakeExecutor(), group_size=3, scheduling=scheduling, seed=3
        )
        out[scheduling] = [
            [(t.full_tokens(), t.outcome.stop_reason, t.reward, t.outcome.code_calls) for t in g]
            for g in groups
        ]
    assert out["per_trajectory"] == out["round_sync"]
    assert sum(x[2] for g in out["round_sync"] for x in g) == 3.0  # 6 correct, 3 wrong


def test_inflight_sampling_cap(tokenizer, protocol):
    script = {(p, 0, 0): "\\boxed{1}" for p in range(4)}
    sampler = ScriptedSampler(tokenizer, protocol, script, group_size=1, delay=0.05)
    run(PROBLEMS, sampler, protocol, FakeExecutor(), group_size=1, max_inflight_samples=2)
    assert sampler.max_inflight == 2
    sampler = ScriptedSampler(tokenizer, protocol, script, group_size=1, delay=0.05)
    run(PROBLEMS, sampler, protocol, FakeExecutor(), group_size=1, max_inflight_samples=64)
    assert sampler.max_inflight == 4


def test_request_seeds_are_per_problem_branch_and_turn(tokenizer, protocol):
    script = {(p, b, 0): call(protocol, "print(1)") for p in range(2) for b in range(2)}
    script.update({(p, b, 1): "\\boxed{0}" for p in range(2) for b in range(2)})
    seeds = []
    for seed in (0, 0, 1):
        sampler = ScriptedSampler(tokenizer, protocol, script, seed=seed, group_size=2)
        run(PROBLEMS[:2], sampler, protocol, FakeExecutor(), group_size=2, seed=seed)
        seeds.append(sorted(r["key"] for r in sampler.requests))
    assert seeds[0] == seeds[1] == seeds[2]  # every key resolved through its own seed table
    assert seeds[0] == [(0, -1, 0), (0, 0, 1), (0, 1, 1), (1, -1, 0), (1, 0, 1), (1, 1, 1)]
    all_seeds = {request_seed(0, p, b, t) for p in range(8) for b in range(-1, 8) for t in range(6)}
    assert len(all_seeds) == 8 * 9 * 6
    assert request_seed(0, 1, 2, 3) == request_seed(0, 1, 2, 3) != request_seed(1, 1, 2, 3)


def test_text_only_mode_is_one_turn_without_tools(tokenizer):
    protocol = make_protocol(tokenizer, use_tools=False)
    tool_protocol = make_protocol(tokenizer, use_tools=True)
    script = {(0, 0, 0): call(tool_protocol, "print(1)"), (0, 1, 0): "\\boxed{0}"}
    sampler = ScriptedSampler(tokenizer, protocol, script, group_size=2)
    (group,) = run(PROBLEMS[:1], sampler, protocol, None, group_size=2, use_tools=False)
    assert [t.outcome.stop_reason for t in group] == ["answer", "answer"]
    assert [len(t.turns) for t in group] == [1, 1] and group[0].outcome.code_calls == 0
    assert [t.reward for t in group] == [-1.0, 1.0]
    prompt = tokenizer.decode(group[0].turns[0].prompt_tokens)
    assert "code_interpreter" not in prompt
    assert "code_interpreter" in tokenizer.decode(
        tool_protocol.build_prompt(tool_protocol.initial_messages(PROBLEMS[0].question))
    )
    with pytest.raises(ValueError, match="use_tools"):
        run(PROBLEMS[:1], sampler, tool_protocol, None, group_size=2, use_tools=False)


def test_stop_reasons_are_known_and_bad_arguments_are_refused(tokenizer, protocol):
    assert set(STOP_REASONS) >= {
        "answer",
        "invalid",
        "max_turns",
        "max_code_calls",
        "context_full",
        "sampler_error",
    }
    sampler = ScriptedSampler(tokenizer, protocol, {}, group_size=1)
    with pytest.raises(ValueError, match="group_size"):
        run(PROBLEMS[:1], sampler, protocol, FakeExecutor(), group_size=0)
    with pytest.raises(ValueError, match="executor"):
        run(PROBLEMS[:1], sampler, protocol, None, group_size=1)
    assert run([], sampler, protocol, FakeExecutor(), group_size=2) == []


@pytest.mark.parametrize(
    ("name", "fmt"), [("Qwen2.5-Instruct", "auto"), ("Qwen3.5", "auto"), ("Qwen2.5-Instruct", "markdown")]
)
def test_three_turns_on_real_qwen_templates(qwen_tokenizers, name, fmt):
    tok = qwen_tokenizers[name]
    # Qwen3.5 in thinking mode drops earlier reasoning from history (not append-only): run it without.
    protocol = ChatProtocol(tok, fmt=fmt, enable_thinking=False if name == "Qwen3.5" else None)
    script = {
        (0, 0, 0): call(protocol, "print(1/0)"),
        (0, 0, 1): call(protocol, "print(2 + 2)", prefix="Fixing the division.\n"),
        (0, 0, 2): "The sum is \\boxed{0}.",
    }
    executor = FakeExecutor(
        {
            "print(1/0)": (
                "Traceback (most recent call last):\nZeroDivisionError: division by zero\n",
                False,
                0.0,
            ),
            "print(2 + 2)": ("4\n", True, 0.0),
        }
    )
    sampler = ScriptedSampler(tok, protocol, script, group_size=1)
    t = run_one(sampler, protocol, executor)
    assert (
        t.outcome.stop_reason == "answer"
        and t.outcome.correct
        and t.outcome.code_calls == 2
        and len(t.turns) == 3
    )
    t.check_continuity()
    assert [x.kind for x in t.turns] == ["tool", "tool", "answer"]
    rendered = protocol.decode(t.full_tokens())
    assert "ZeroDivisionError: division by zero" in rendered and "\n4\n" in rendered
    if fmt == "markdown":
        # Markdown calls stop on the closing fence; strings only, end-of-turn ids written as text.
        assert all(isinstance(s, str) for s in sampler.requests[0]["stop"])
        assert "```\n" in sampler.requests[0]["stop"] and "<|im_end|>" in sampler.requests[0]["stop"]
        assert "<interpreter>" in rendered
    else:
        assert list(sampler.requests[0]["stop"]) == list(protocol.stop_token_ids)


def test_real_verifier_and_real_sandbox(tokenizer, protocol):
    """End to end with the project's own executor and verifier: the traceback is fed back, the retry
    prints the value, and the boxed answer is checked for mathematical equivalence (1/2 == 0.5)."""
    from retool.config import SandboxConfig
    from retool.reward import Verifier
    from retool.sandbox import make_executor

    script = {
        (0, 0, 0): call(protocol, "print(1/0)"),
        (0, 0, 1): call(protocol, "print(1/2)", prefix="Fix.\n"),
        (0, 0, 2): "So it is \\boxed{\\frac{1}{2}}",
        (0, 1, 0): "\\boxed{3}",
    }
    problem = Problem(id="half", question="What is 1/2?", answer="0.5")
    cfg = SandboxConfig(workers=1, preimport=["math"], timeout=10.0)
    with make_executor(cfg) as executor, Verifier(workers=1, timeout=10.0) as verifier:
        sampler = ScriptedSampler(tokenizer, protocol, script, group_size=2)
        (group,) = run([problem], sampler, protocol, executor, group_size=2, verifier=verifier)
    t = group[0]
    assert [r.ok for r in t.outcome.exec_results] == [False, True]
    assert "ZeroDivisionError" in t.outcome.observations[0] and t.outcome.observations[1].strip() == "0.5"
    assert (
        t.outcome.stop_reason == "answer"
        and t.outcome.correct
        and t.reward == 1.0
        and t.outcome.had_error_then_correct
    )
    assert group[1].reward == -1.0 and not group[1].outcome.correct


# -- the environment seam: the engine only schedules ----------------------------------------------------


class CountdownEnv(Env):
    """A toy environment with no protocol and no tool: the prompt is ``start`` tokens; every action earns
    its token count as reward and appends one token to the prompt, until ``steps`` steps are taken."""

    def __init__(self, start: tuple[int, ...], steps: int) -> None:
        self.prompt, self.left, self.rewards = start, steps, []

    def initial_observation(self) -> Observation:
        return Observation(self.prompt, (0,), 4)

    async def step(self, action: Sample) -> StepResult:
        turn = AssistantTurn(
            list(self.prompt), list(action.tokens), list(action.logprobs), "", action.stop_reason
        )
        self.prompt = (*self.prompt, *action.tokens, 7)
        self.left -= 1
        reward = float(len(action.tokens))
        self.rewards.append(reward)
        done = self.left == 0
        return StepResult(
            reward, done, None if done else Observation(self.prompt, (0,), 4), {"n": reward}, turn
        )

    async def interrupt(self, reason: Any, error: str | None = None) -> StepResult:
        self.stopped = reason
        return StepResult(-5.0, True, None)

    def outcome(self) -> Outcome:
        return Outcome(stop_reason=getattr(self, "stopped", "answer"))  # a toy env reports no tool


class CountdownGroup(EnvGroupBuilder):
    """``group_size`` countdowns of one problem; ``shared``: the same first prompt for all of them. The
    group reward is +10 for the branch(es) with the most reward."""

    def __init__(self, problem_index: int, group_size: int, shared: bool) -> None:
        self.problem, self.problem_index, self.group_size = PROBLEMS[problem_index], problem_index, group_size
        self.shared = shared

    def make_envs(self) -> list[Env]:
        return [CountdownEnv((1, 2) if self.shared else (1, 2, 100 + b), 2) for b in range(self.group_size)]

    async def group_rewards(self, outcomes: Sequence[Outcome]) -> list[float]:
        self.outcomes = list(outcomes)
        return [10.0 if b == 0 else 0.0 for b in range(len(outcomes))]


class LengthSampler(SamplingClient):
    """Samples ``1 + seed % 3`` tokens per sample (a pure function of the request seed and the sample)."""

    def __init__(self, fail_prompt_len: int | None = None) -> None:
        self.requests: list[tuple[int, int, int]] = []
        self.fail_prompt_len = fail_prompt_len

    async def sample_async(self, prompt_tokens, num_samples: int, params: SamplingParams) -> list[Sample]:
        self.requests.append((len(prompt_tokens), num_samples, params.seed))
        if len(prompt_tokens) == self.fail_prompt_len:
            raise ConnectionError("gone")
        out = []
        for k in range(num_samples):
            n = 1 + (params.seed + k) % 3
            out.append(Sample(tokens=[5] * n, logprobs=[-0.1] * n, stop_reason="stop"))
        return out


@pytest.mark.parametrize("scheduling", ["per_trajectory", "round_sync"])
def test_the_engine_steps_any_environment_and_adds_group_rewards(scheduling: str) -> None:
    for shared in (True, False):
        sampler = LengthSampler()
        builders = [CountdownGroup(i, 3, shared) for i in range(2)]
        request = RolloutRequest(builders, sampler, SamplingConfig(), seed=4)
        groups = asyncio.run(SCHEDULERS[scheduling](request))
        for i, group in enumerate(groups):
            assert [t.group_index for t in group] == [0, 1, 2] and all(t.problem_index == i for t in group)
            for t in group:
                assert len(t.transitions) == 2 and [x.done for x in t.transitions] == [False, True]
                steps = [x.reward for x in t.transitions]
                assert steps == [float(len(x.turn.completion_tokens)) for x in t.transitions]
                assert [x.metrics["n"] for x in t.transitions] == steps
                assert t.reward == sum(steps) + (10.0 if t.group_index == 0 else 0.0)
                t.check_continuity()  # each prompt extends the previous prompt + completion
                # seen through the ReTool lens (the trainer's metrics), an environment without a tool made no calls
                assert t.outcome.stop_reason == "answer" and not retool_outcome(t.outcome).use_tools
                assert retool_outcome(t.outcome).code_calls == 0
        first_turn = [r for r in sampler.requests if r[0] in (2, 3)]
        if shared:  # one request per group for the shared first prompt, with the group's seed
            assert sorted(first_turn) == sorted((2, 3, request_seed(4, i, -1, 0)) for i in range(2))
        else:  # distinct first prompts: one request per branch, with the branch's seed
            assert sorted(first_turn) == sorted(
                (3, 1, request_seed(4, i, b, 0)) for i in range(2) for b in range(3)
            )


def test_a_failed_request_interrupts_the_environment_and_its_reward_counts() -> None:
    sampler = LengthSampler(fail_prompt_len=2)  # the shared first prompt of length 2 fails
    groups = asyncio.run(run_rollout(RolloutRequest([CountdownGroup(0, 2, True)], sampler, SamplingConfig())))
    assert [(t.outcome.stop_reason, t.transitions, t.reward) for t in groups[0]] == [
        ("sampler_error", (), -5.0 + 10.0),
        ("sampler_error", (), -5.0),
    ]


def test_trajectories_are_immutable_and_never_default_a_reward() -> None:
    with pytest.raises(TypeError, match="reward"):
        Trajectory(problem=PROBLEMS[0], group_index=0, outcome=ReToolOutcome(stop_reason="answer"))  # type: ignore[call-arg]
    t = Trajectory(
        problem=PROBLEMS[0], group_index=0, reward=1.0, outcome=ReToolOutcome(stop_reason="answer")
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.reward = -1.0  # type: ignore[misc]


def test_the_retool_env_owns_parse_execute_observe_and_score(tokenizer, protocol) -> None:
    """One ``ReToolEnv`` driven by hand: a tool call gives reward 0 and an observation that extends the
    prompt + completion token-exactly; the answer ends it with the verifier's reward."""
    setup = ToolSetup(protocol, FakeExecutor({"print(2 + 2)": ("4\n", True, 0.0)}), FakeVerifier(), Budgets())
    (env,) = ReToolGroupBuilder(PROBLEMS[2], setup, 1).make_envs()
    first = env.initial_observation()
    assert list(first.prompt_tokens) == protocol.build_prompt(protocol.initial_messages(PROBLEMS[2].question))
    assert (
        first.stop == tuple(protocol.stop_token_ids)
        and first.max_tokens == RolloutConfig().max_tokens_per_turn
    )
    end = protocol.stop_token_ids[0]

    def action(text: str) -> Sample:
        ids = [*tokenizer.encode(text, add_special_tokens=False), end]
        return Sample(tokens=ids, logprobs=[-0.1] * len(ids), stop_reason="stop")

    called = action(call(protocol, "print(2 + 2)"))
    result = asyncio.run(env.step(called))
    assert (
        (result.reward, result.done) == (0.0, False)
        and result.turn is not None
        and result.turn.kind == "tool"
    )
    nxt = result.next_observation
    assert nxt is not None and nxt.prompt_tokens[: len(first.prompt_tokens) + len(called.tokens)] == (
        *first.prompt_tokens,
        *called.tokens,
    )
    assert "4" in tokenizer.decode(list(nxt.prompt_tokens[len(first.prompt_tokens) + len(called.tokens) :]))
    done = asyncio.run(env.step(action("So \\boxed{4}")))
    assert (done.reward, done.done, done.next_observation) == (1.0, True, None)
    outcome = env.outcome()
    assert (outcome.stop_reason, outcome.codes, outcome.correct, outcome.answer) == (
        "answer",
        ("print(2 + 2)",),
        True,
        "4",
    )


def test_an_environment_that_is_not_done_must_say_what_comes_next() -> None:
    class Broken(CountdownEnv):
        async def step(self, action: Sample) -> StepResult:
            return StepResult(0.0, False, None)

    class BrokenGroup(CountdownGroup):
        def make_envs(self) -> list[Env]:
            return [Broken((1, 2), 2)]

    request = RolloutRequest([BrokenGroup(0, 1, True)], LengthSampler(), SamplingConfig())
    with pytest.raises(RuntimeError, match="no next observation"):
        asyncio.run(run_rollout(request))
