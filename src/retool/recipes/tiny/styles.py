"""The tiny recipe's cold start: code-interleaved SFT trajectories of the synthetic task family in a mix of
styles (``SFTMix``: a direct answer, a call, a failing call then its fix), each built with
``retool.train.trace.build_trajectory``. Tool outputs are the code's real output (through the sandbox
executor when one is given).

The data mix is deliberately imperfect: on hard problems only a fraction of trajectories call the
tool, the rest answer directly with the true number (which a tiny model cannot reproduce). The SFT
policy therefore sometimes skips the tool on hard problems and fails; RL has something to fix.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from retool.data.synthetic import Task
from retool.protocol import ChatProtocol
from retool.train.sft import SFTExample
from retool.train.trace import Observer, answer_text, build_trajectory


@dataclass(frozen=True)
class SFTMix:
    """Shares of trajectory styles. On hard problems: tool / tool-after-an-error / direct answer."""

    hard_tool: float = 0.35
    hard_error_fix: float = 0.1
    easy_tool: float = 0.05  # otherwise easy problems are answered directly
    # Loss weight of the answer digits in a *direct* answer to a hard problem. The true number there is
    # noise the tiny model cannot learn; full weight would spend its capacity memorising it. The decision
    # to answer directly (the ``\boxed{`` tokens) keeps full weight, which is what RL later corrects.
    direct_hard_answer_weight: float = 0.1

    def __post_init__(self) -> None:
        for name in ("hard_tool", "hard_error_fix", "easy_tool", "direct_hard_answer_weight"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"SFTMix.{name} must be in [0, 1]")
        if self.hard_tool + self.hard_error_fix > 1.0:
            raise ValueError("SFTMix.hard_tool + hard_error_fix must be <= 1")


def _broken_variant(code: str, rng: random.Random) -> str:
    """A first attempt that fails the way small models' code does (a typo'd name)."""
    if rng.random() < 0.5 and code.startswith("print("):
        return "pritn(" + code[len("print(") :]
    return code.replace("print(", "print(x + ", 1) if "print(" in code else "x" + code


def build_example(
    task: Task,
    style: str,
    protocol: ChatProtocol,
    observe: Observer,
    rng: random.Random,
    direct_hard_answer_weight: float = 1.0,
    max_observation_tokens: int = 64,
) -> SFTExample:
    """One SFT trajectory for ``task`` in ``style``, tokenised with ``protocol``."""
    calls: list[str] = []
    if style == "tool":
        calls = [task.code]
    elif style == "error_fix":
        calls = [_broken_variant(task.code, rng), task.code]
    elif style != "direct":
        raise ValueError(f"unknown SFT style {style!r}")
    turns = [(protocol.fmt.render_call(code), code) for code in calls]
    final_text = answer_text(task.answer)
    tokens, weights, _ = build_trajectory(
        protocol, task.question, turns, final_text, observe, max_observation_tokens
    )
    if style == "direct" and task.hard:
        final = len(protocol.encode_completion(final_text))
        head = len(protocol.encode("\\boxed{"))
        digits = final - head - 2  # the closing brace and the end-of-turn token keep full weight
        weights[len(weights) - final :] = [1.0] * head + [direct_hard_answer_weight] * digits + [1.0, 1.0]
    return SFTExample(task=task, style=style, tokens=tokens, weights=weights)


def choose_style(task: Task, mix: SFTMix, rng: random.Random) -> str:
    u = rng.random()
    if task.hard:
        if u < mix.hard_tool:
            return "tool"
        if u < mix.hard_tool + mix.hard_error_fix:
            return "error_fix"
        return "direct"
    return "tool" if u < mix.easy_tool else "direct"


def build_sft_examples(
    tasks: Sequence[Task],
    protocol: ChatProtocol,
    observe: Observer,
    mix: SFTMix | None = None,
    seed: int = 0,
    max_observation_tokens: int = 64,
) -> list[SFTExample]:
    mix = mix or SFTMix()
    rng = random.Random(f"retool-sft/{seed}")
    return [
        build_example(
            t,
            choose_style(t, mix, rng),
            protocol,
            observe,
            rng,
            mix.direct_hard_answer_weight,
            max_observation_tokens,
        )
        for t in tasks
    ]
