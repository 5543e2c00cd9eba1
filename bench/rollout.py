"""Benchmark: per-trajectory rollout scheduling vs the chapter's round-synchronous scheme, one workload.

The workload is the chapter's step shape (8 questions x group 8, budgets 4 code calls / 6 turns / 1024
tokens per turn / 512 per observation / 8192 per trajectory). The sampler is a fake with realistic
latency: a request sleeps ``base + per_token x tokens`` of its longest sample (a batched request returns
when its longest sequence is done). Code runs for real in the sandbox (``retool.sandbox.make_executor``,
forkserver backend): programs of varying length (mostly short, some medium, a few long; some raise).
The workload is a pure function of the seed, so both schedulers get exactly the same requests.

    python bench/rollout.py                  # defaults: ~30-60 s in all
    python bench/rollout.py --questions 4 --group 4 --per-token-ms 1

Prints the wall time of each scheduler and their ratio (target: per-trajectory >= 1.5x faster).
``--write`` also writes what it printed to docs/results/rollout.md and refills the pages that quote it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from _results import recording, write_printed  # bench/, on sys.path when run as a script
from _round_sync import run_round_sync
from retool.backends.interface.clients import SamplingClient
from retool.backends.interface.types import Sample, SamplingParams
from retool.config import RewardConfig, RolloutConfig, SamplingConfig, SandboxConfig
from retool.data.problem import Problem
from retool.rollout import Trajectory, run_rollout
from retool.train.sampling import run_group_rollouts

ANSWER_CORRECT_P = 0.5


class LatencySampler(SamplingClient):
    """Deterministic fake policy: decides from the request seed whether to call code (and which) or to
    answer, emits tokens of the real tokenizer, and sleeps like a decoder would."""

    def __init__(self, protocol: Any, problems: Sequence[Problem], *, per_token: float, base: float) -> None:
        self.protocol = protocol
        # Requests are recognised from their tokens, not by decoding the prompt (decoding thousands of
        # tokens per request would put the fake's own CPU cost on the event loop).
        self.first_prompts = {
            tuple(protocol.build_prompt(protocol.initial_messages(p.question))): p for p in problems
        }
        self.first_len = {len(k) for k in self.first_prompts}
        marker = protocol.encode("<tool_response>")
        self.obs_marker = marker[0] if len(marker) == 1 else None
        self.per_token = per_token
        self.base = base
        self.filler = protocol.encode("Let me reason about this step carefully. ")
        self.end = list(protocol.stop_token_ids)[:1]
        self.requests = 0
        self.tokens = 0
        self.cpu_seconds = 0.0

    def _locate(self, prompt_tokens: Sequence[int]) -> tuple[Problem, int]:
        for n in self.first_len:
            problem = self.first_prompts.get(tuple(prompt_tokens[:n]))
            if problem is not None:
                break
        else:
            raise KeyError("prompt of an unknown problem")
        if self.obs_marker is not None:
            turn = list(prompt_tokens).count(self.obs_marker)
        else:
            text = self.protocol.decode(list(prompt_tokens))
            turn = text.count("<tool_response>") + text.count("<interpreter>")
        return problem, turn

    def _code(self, rng: random.Random) -> str:
        r = rng.random()
        if r < 0.10:
            return "x = [1, 2, 3]\nprint(x[10])"  # IndexError: the model has to fix it
        if r < 0.70:
            sleep = rng.uniform(0.02, 0.2)  # quick arithmetic
        elif r < 0.93:
            sleep = rng.uniform(0.3, 1.0)  # a modest search
        else:
            sleep = rng.uniform(1.5, 3.0)  # a slow enumeration
        n = rng.randint(1_000, 50_000)
        return f"import time\ntime.sleep({sleep:.3f})\nprint(sum(i * i % 7 for i in range({n})))"

    def _one(self, rng: random.Random, turn: int, answer: str, max_tokens: int) -> Sample:
        length = int(min(900, max(30, rng.lognormvariate(5.0, 0.7))))  # median ~150 tokens
        body = (self.filler * (length // len(self.filler) + 1))[:length]
        if turn < 3 and rng.random() < 0.75:
            tail = self.protocol.encode("\n" + self.protocol.fmt.render_call(self._code(rng)))
        else:
            guess = answer if rng.random() < ANSWER_CORRECT_P else answer + "1"
            tail = self.protocol.encode(f"\nSo the answer is \\boxed{{{guess}}}")
        tokens = [*body, *tail, *self.end]
        stop = "stop"
        if len(tokens) > max_tokens:
            tokens, stop = tokens[:max_tokens], "length"
        return Sample(tokens=tokens, logprobs=[-0.5] * len(tokens), stop_reason=stop)

    async def sample_async(
        self, prompt_tokens: Sequence[int], num_samples: int, params: SamplingParams
    ) -> list[Sample]:
        problem, turn = self._locate(prompt_tokens)
        rng = random.Random(params.seed)
        samples = [self._one(rng, turn, problem.answer, params.max_tokens) for _ in range(num_samples)]
        longest = max(len(s.tokens) for s in samples)
        await asyncio.sleep(self.base + self.per_token * longest)
        self.requests += 1
        self.tokens += sum(len(s.tokens) for s in samples)
        return samples


def make_verifier() -> tuple[Any, str]:
    from retool.reward import Verifier

    return Verifier.from_config(RewardConfig()), "retool.reward.Verifier (the reward section's defaults)"


def make_bench_executor(workers: int, isolation: str) -> tuple[Any, str]:
    from retool.sandbox import make_executor

    cfg = SandboxConfig(
        backend="forkserver", isolation=isolation, timeout=10.0, workers=workers, preimport=["math"]
    )
    ex = make_executor(cfg)
    detail = getattr(ex, "isolation", cfg.isolation)
    return ex, f"{type(ex).__name__} via make_executor (isolation={detail}, workers={workers})"


def summarize(groups: list[list[Trajectory]]) -> dict[str, float]:
    trajs = [t for g in groups for t in g]
    lat = [r.latency for t in trajs for r in t.outcome.exec_results]
    reasons: dict[str, int] = {}
    for t in trajs:
        reasons[t.outcome.stop_reason] = reasons.get(t.outcome.stop_reason, 0) + 1
    return {
        "trajectories": len(trajs),
        "code_calls": sum(t.outcome.code_calls for t in trajs),
        "exec_errors": sum(t.outcome.exec_errors for t in trajs),
        "mean_exec_s": statistics.mean(lat) if lat else 0.0,
        "max_exec_s": max(lat) if lat else 0.0,
        "turns": sum(t.num_turns for t in trajs),
        "correct": sum(t.outcome.correct for t in trajs),
        "reasons": reasons,  # type: ignore[dict-item]
    }


async def run_once(
    scheduling: str,
    problems: list[Problem],
    protocol: Any,
    executor: Any,
    verifier: Any,
    args: argparse.Namespace,
) -> tuple[float, list[list[Trajectory]], LatencySampler]:
    sampler = LatencySampler(protocol, problems, per_token=args.per_token_ms / 1000, base=args.base_ms / 1000)
    rollout = RolloutConfig(
        questions_per_step=len(problems),
        group_size=args.group,
        max_code_calls=4,
        max_assistant_turns=6,
        max_tokens_per_turn=1024,
        max_observation_tokens=512,
        max_trajectory_tokens=8192,
        max_inflight_samples=64,
    )
    start, cpu0 = time.perf_counter(), time.process_time()
    groups = await run_group_rollouts(
        problems,
        sampler=sampler,
        protocol=protocol,
        executor=executor,
        verifier=verifier,
        rollout=rollout,
        sampling=SamplingConfig(),
        group_size=args.group,
        seed=args.seed,
        rollout_fn=run_round_sync if scheduling == "round_sync" else run_rollout,
    )
    sampler.cpu_seconds = time.process_time() - cpu0
    return time.perf_counter() - start, groups, sampler


async def main_async(args: argparse.Namespace) -> int:
    from retool.backends.local.tinymodel import build_tokenizer
    from retool.protocol import ChatProtocol

    tokenizer = build_tokenizer()
    protocol = ChatProtocol(tokenizer)
    rng = random.Random(args.seed)
    problems = [
        Problem(id=f"q{i}", question=f"Question {i}: what is {a} times {b}?", answer=str(a * b))
        for i, (a, b) in enumerate((rng.randint(10, 99), rng.randint(10, 99)) for _ in range(args.questions))
    ]
    executor, ex_desc = make_bench_executor(args.workers, args.isolation)
    verifier, ver_desc = make_verifier()
    try:
        # Warm the pool so neither scheduler pays start-up costs.
        await asyncio.gather(*(executor.arun("print(1)") for _ in range(args.workers)))
        print(
            f"workload : {args.questions} questions x group {args.group}, budgets 4/6/1024/512/8192, seed {args.seed}"
        )
        print(
            f"sampler  : fake, {args.base_ms:g} ms + {args.per_token_ms:g} ms/token of the longest sample per request"
        )
        print(f"executor : {ex_desc}")
        print(f"verifier : {ver_desc}")
        print(f"tool fmt : {protocol.fmt.name} (tiny tokenizer, {len(tokenizer)} tokens)")
        results = {}
        for scheduling in ("per_trajectory", "round_sync"):
            wall, groups, sampler = await run_once(scheduling, problems, protocol, executor, verifier, args)
            s = summarize(groups)
            results[scheduling] = (
                wall,
                s,
                sampler,
                [[(t.full_tokens(), t.outcome.stop_reason) for t in g] for g in groups],
            )
            print(
                f"{scheduling:>15}: {wall:6.2f} s  | {s['trajectories']} traj, {s['turns']} turns, "
                f"{sampler.requests} sample requests, {sampler.tokens} tokens, {s['code_calls']} code calls "
                f"({s['exec_errors']} errors, mean {s['mean_exec_s']:.2f} s, max {s['max_exec_s']:.2f} s), "
                f"{s['correct']} correct, stops {s['reasons']}"
            )
            chain = max(t.sample_seconds + t.outcome.exec_seconds for g in groups for t in g)
            print(
                f"{'':>15}  longest single trajectory (its own sampling + execution): {chain:.2f} s; "
                f"CPU time of this process (template rendering, tokenizing, bookkeeping): {sampler.cpu_seconds:.2f} s"
            )
        same = results["per_trajectory"][3] == results["round_sync"][3]
        per, sync = results["per_trajectory"][0], results["round_sync"][0]
        ratio = sync / per
        print(f"same trajectories under both schedulers: {'yes' if same else 'NO'}")
        print(
            f"round_sync / per_trajectory wall time = {ratio:.2f}x  (target >= 1.5x: {'met' if ratio >= 1.5 else 'NOT met'})"
        )
    finally:
        executor.close()
        close = getattr(verifier, "close", None)
        if close is not None:
            close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--workers", type=int, default=16, help="sandbox executions at once")
    parser.add_argument("--isolation", choices=["strict", "none"], default="strict")
    parser.add_argument("--per-token-ms", type=float, default=2.0)
    parser.add_argument("--base-ms", type=float, default=50.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", action="store_true", help="also write docs/results/rollout.md")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with recording(args.write) as rec:
        rc = asyncio.run(main_async(args))
    if args.write:
        write_printed("rollout.md", "Rollout scheduling: `bench/rollout.py`", rec)
    return rc


if __name__ == "__main__":
    sys.exit(main())
