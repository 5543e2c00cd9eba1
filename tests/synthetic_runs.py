"""Test helper: a synthetic run for the viewer's tests and its bench: no model, real plumbing.

Trajectories are real ``retool.rollout.Trajectory`` objects over a one-character-per-token "tokenizer"
(``ord`` / ``chr``) in a ChatML-like template; their datums come from the real ``build_step_data`` and
their records from the real ``TrajectoryLog`` and eval runner (``run_eval`` with ``save_transcripts``).
So the files on disk have exactly the shape a training run and an eval write, with sizes set by
``reasoning_chars``. ``hostile=True`` puts HTML/JS injection attempts into some model outputs, which
the viewer must show as text.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retool.components import Components
from retool.config import Config
from retool.data.problem import Problem
from retool.env import ReToolOutcome
from retool.evaluate.runner import run_eval
from retool.rollout import RolloutRequest
from retool.rollout.types import AssistantTurn, Trajectory, Transition
from retool.sandbox.base import ExecResult
from retool.train.metrics import MetricsLog, rollout_metrics
from retool.train.records import TRAJECTORIES_FILE, TrajectoryLog
from retool.train.step import build_step_data

SYSTEM = "You are a careful mathematician. Use the code_interpreter tool when computing helps."
HOSTILE = (
    '</script><script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
    " <!-- /*__JS__*/ __DATA__ --> & \u2028"
)
_FILLER = (
    "Let me think about this step by step. The quantity we need follows from the definition, so I "
    "will compute it carefully and check the result before I answer. "
)


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(tokens: Sequence[int]) -> str:
    return "".join(chr(t) for t in tokens)


class CharProtocol:
    """Just enough of ``ChatProtocol`` for the eval runner: ``decode`` and a format name."""

    class fmt:  # mirrors the attribute the runner reads (protocol.fmt.name)
        name = "markdown"

    decode = staticmethod(decode)


def _header(role: str) -> str:
    return f"<|im_start|>{role}\n"


_END = "<|im_end|>"


@dataclass
class _Plan:
    correct: bool
    calls: int
    error_first: bool
    timeout: bool
    unanswered: bool  # the last turn has no \boxed{} answer: stop reason "invalid"


def make_problems(n: int, seed: int, prefix: str = "mul") -> list[Problem]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        out.append(
            Problem(f"{prefix}-{i:04d}", f"Compute {a} * {b}. Put the answer in \\boxed{{}}.", str(a * b))
        )
    return out


def make_trajectory(
    problem: Problem,
    branch: int,
    rng: random.Random,
    *,
    use_tools: bool = True,
    skill: float = 0.5,
    reasoning_chars: tuple[int, int] = (150, 900),
    hostile: bool = False,
    problem_index: int = 0,
) -> Trajectory:
    """One finished trajectory with consistent tokens, messages, calls, results and reward.

    Long because every turn appends to the same token, message, call and result lists, which must stay
    consistent with one another (that consistency is what the viewer's tests check).
    """
    calls = 0 if not use_tools or rng.random() < 0.25 else rng.choice([1, 1, 1, 2, 3])
    plan = _Plan(
        correct=rng.random() < (skill if calls else skill * 0.4),
        calls=calls,
        error_first=calls > 1 and rng.random() < 0.6,
        timeout=calls > 0 and rng.random() < 0.04,
        unanswered=rng.random() < 0.06,
    )
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": problem.question},
    ]
    context = f"{_header('system')}{SYSTEM}{_END}\n{_header('user')}{problem.question}{_END}\n{_header('assistant')}"
    turns: list[AssistantTurn] = []
    codes: list[str] = []
    results: list[ExecResult] = []
    observations: list[str] = []
    a_str, b_str = problem.question.split()[1], problem.question.split()[3].rstrip(".")
    for k in range(plan.calls + 1):
        length = rng.randint(*reasoning_chars)
        think = (_FILLER * (length // len(_FILLER) + 1))[:length]
        if hostile and k == 0:
            think = HOSTILE + " " + think
        final = k == plan.calls
        if not final:
            broken = plan.error_first and k == 0
            code = f"a = {a_str}\nb = {b_str}\n# multiply\nprint(a * {'c' if broken else 'b'})"
            text = f"{think}\n```python\n{code}\n```"
            kind = "tool"
        else:
            answer = problem.answer if plan.correct else str(int(problem.answer) + rng.randint(1, 99))
            text = f"{think}\nSo the product is \\boxed{{{answer}}}."
            kind = "answer" if use_tools else ""
            if plan.unanswered:
                text, kind = f"{think}\nI am not sure.", "invalid" if use_tools else ""
        completion = encode(text + _END)
        prompt = encode(context)
        turns.append(
            AssistantTurn(prompt, completion, [-rng.random() for _ in completion], text, "stop", kind)
        )
        messages.append({"role": "assistant", "content": text})
        context += text + _END
        if final:
            break
        codes.append(code)
        if plan.timeout and k == plan.calls - 1:
            result = ExecResult(False, "", "", None, True, 30.0 + rng.random())
            observation = "Error: execution timed out after 30 seconds."
        elif plan.error_first and k == 0:
            stderr = "Traceback (most recent call last):\n  File \"<string>\", line 4, in <module>\nNameError: name 'c' is not defined"
            result = ExecResult(False, "", stderr, 1, False, 0.02 + rng.random() / 10)
            observation = stderr
        else:
            result = ExecResult(True, problem.answer + "\n", "", 0, False, 0.02 + rng.random() / 10)
            observation = result.stdout
        results.append(result)
        observations.append(observation)
        messages.append({"role": "user", "content": f"<interpreter>\n{observation}\n</interpreter>"})
        context += (
            f"\n{_header('user')}<interpreter>\n{observation}\n</interpreter>{_END}\n{_header('assistant')}"
        )
    final_text = turns[-1].text
    answer_found: str | None = None
    error: str | None = None
    reward_status = ""
    if plan.unanswered and use_tools:
        stop_reason, error = "invalid", "no tool call and no \\boxed{} answer"
    else:
        stop_reason = "answer"
        boxed = final_text.rsplit("\\boxed{", 1)
        answer_found = boxed[1].split("}", 1)[0] if len(boxed) == 2 else None
        reward_status = "ok" if answer_found is not None else "no_answer"
    correct = answer_found == problem.answer
    reward = 1.0 if correct else -1.0  # the last step's; the tool calls before it earn 0
    return Trajectory(
        problem=problem,
        group_index=branch,
        problem_index=problem_index,
        transitions=tuple(
            Transition(t, reward if i == len(turns) - 1 else 0.0, i == len(turns) - 1)
            for i, t in enumerate(turns)
        ),
        reward=reward,
        sample_seconds=0.01 * len(turns),
        outcome=ReToolOutcome(
            stop_reason=stop_reason,
            error=error,
            final_text=final_text,
            messages=tuple(messages),
            codes=tuple(codes),
            exec_results=tuple(results),
            observations=tuple(observations),
            observations_trimmed=(False,) * len(observations),
            correct=correct,
            valid_format=answer_found is not None,
            answer=answer_found,
            reward_status=reward_status,
            exec_seconds=sum(r.latency for r in results),
            use_tools=use_tools,
        ),
    )


def write_training_run(
    run_dir: str | Path,
    *,
    steps: int = 4,
    questions_per_step: int = 4,
    group_size: int = 4,
    groups_per_step: int | str = "all",
    seed: int = 0,
    reasoning_chars: tuple[int, int] = (150, 900),
    hostile: bool = False,
) -> Path:
    """``metrics.jsonl`` + ``trajectories.jsonl`` of a run whose skill rises with the step."""

    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    problems = make_problems(max(questions_per_step * steps // 2, questions_per_step), seed)
    log = TrajectoryLog(run / TRAJECTORIES_FILE, groups_per_step, seed)  # type: ignore[arg-type]
    metrics = MetricsLog(run / "metrics.jsonl")
    for step in range(1, steps + 1):
        skill = 0.2 + 0.6 * step / steps
        chosen = [
            problems[(step * questions_per_step + q) % len(problems)] for q in range(questions_per_step)
        ]
        groups = [
            [
                make_trajectory(
                    p,
                    b,
                    rng,
                    skill=skill,
                    reasoning_chars=reasoning_chars,
                    hostile=hostile and step == 1 and pi == 0 and b == 0,
                    problem_index=pi,
                )
                for b in range(group_size)
            ]
            for pi, p in enumerate(chosen)
        ]
        data = build_step_data(groups)
        log.write_step(step, groups, data, decode=decode)
        record: dict[str, Any] = {"step": step}
        record.update(rollout_metrics(groups))
        ratio = 1.0 + rng.uniform(-0.02, 0.02)
        record.update(
            {
                "policy/ratio_mean": ratio,
                "policy/ratio_min": ratio - rng.uniform(0.05, 0.2),
                "policy/ratio_max": ratio + rng.uniform(0.05, 0.3),
                "policy/clip_fraction": rng.uniform(0.0, 0.05),
                "policy/loss": rng.uniform(-0.1, 0.1),
                "policy/grad_norm": rng.uniform(0.1, 1.0),
                "task/degenerate_group_rate": data.n_degenerate / data.n_groups,
                "task/degenerate_groups": float(data.n_degenerate),
                "sampling/informative_share": 1.0 - data.n_degenerate / data.n_groups,
                "policy/entropy": 1.5 - skill,  # the policy sharpens as it learns
                "policy/ref_kl": 0.01 * step if step % 2 == 0 else None,  # train.ref_kl_every = 2
                "problem_ids": [p.id for p in chosen],
            }
        )
        metrics.append(record)
    return run


def write_eval(
    output: str | Path,
    *,
    mode: str,
    label: str,
    problems: Sequence[Problem],
    val_n: int = 4,
    skill: float = 0.5,
    seed: int = 0,
    reasoning_chars: tuple[int, int] = (150, 900),
) -> dict[str, Any]:
    """An eval JSONL + summary written by the real ``run_eval`` (``save_transcripts=True``)."""

    use_tools = mode == "retool"

    async def rollout(request: RolloutRequest) -> list[list[Trajectory]]:
        rng = random.Random(request.seed)
        return [
            [
                make_trajectory(
                    g.problem, b, rng, use_tools=use_tools, skill=skill, reasoning_chars=reasoning_chars
                )
                for b in range(g.group_size)
            ]
            for g in request.groups
        ]

    return asyncio.run(
        run_eval(
            list(problems),
            # No model: the scripted rollout below never samples, verifies or trains.
            Components(backend=None, protocol=CharProtocol(), verifier=None, sampler=object()),  # type: ignore[arg-type]
            config=Config(),
            mode=mode,
            output=output,
            val_n=val_n,
            seed=seed,
            identity={"model": "synthetic", "checkpoint": label, "dataset": "synthetic-mul"},
            save_transcripts=True,
            rollout_fn=rollout,
            bootstrap_resamples=200,
        )
    )


def write_demo_like(
    out: str | Path,
    *,
    steps: int = 4,
    questions_per_step: int = 4,
    group_size: int = 4,
    eval_problems: int = 6,
    val_n: int = 4,
    seed: int = 0,
    reasoning_chars: tuple[int, int] = (150, 900),
    hostile: bool = False,
) -> Path:
    """A folder shaped like ``runs/demo``: ``rl/`` (a training run) and ``eval/{sft,rl}_{mode}.jsonl``."""
    root = Path(out)
    write_training_run(
        root / "rl",
        steps=steps,
        questions_per_step=questions_per_step,
        group_size=group_size,
        seed=seed,
        reasoning_chars=reasoning_chars,
        hostile=hostile,
    )
    problems = make_problems(eval_problems, seed + 1, prefix="test")
    for label, skill in (("sft", 0.35), ("rl", 0.8)):
        for mode in ("text-only", "retool"):
            write_eval(
                root / "eval" / f"{label}_{mode}.jsonl",
                mode=mode,
                label=label,
                problems=problems,
                val_n=val_n,
                skill=skill if mode == "retool" else skill / 3,
                seed=seed,
                reasoning_chars=reasoning_chars,
            )
    (root / "settings.json").write_text(json.dumps({"synthetic": True, "seed": seed}) + "\n")
    return root
