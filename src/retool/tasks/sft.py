"""Cold-start SFT (the paper's first stage): code-interleaved trajectories built from the task family.

Each trajectory is built with the same ``ChatProtocol`` calls the RL rollout uses (``build_prompt``,
``encode_completion``, ``build_next_prompt``), so the SFT policy sees exactly the token layout it will
act in. Tool outputs are the code's real output (through the sandbox executor when one is given).
Loss: ``cross_entropy`` on assistant tokens only (weight 0 on prompt and observation tokens), through
a ``TrainingClient``.

The data mix is deliberately imperfect: on hard problems only a fraction of trajectories call the
tool, the rest answer directly with the true number (which a tiny model cannot reproduce). The SFT
policy therefore sometimes skips the tool on hard problems and fails; RL has something to fix.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from retool.backends.interface.clients import TrainingClient
from retool.backends.interface.types import AdamParams, Datum
from retool.config import SFTOptimizerConfig
from retool.data.problem import Problem
from retool.data.synthetic import Task
from retool.jsonl import JsonObject
from retool.protocol import ChatProtocol
from retool.protocol.chat import Message

logger = logging.getLogger(__name__)

# Runs trusted canonical code; returns the observation text the model sees.
Observer = Callable[[str], str]


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


@dataclass
class SFTExample:
    task: Task | Problem  # a synthetic task, or a problem from a file (``retool data coldstart``)
    style: str  # direct | tool | error_fix
    tokens: list[int]
    weights: list[float]  # per token of ``tokens``: 1 on assistant tokens
    text: str = ""

    def to_datum(self, scale: float = 1.0) -> Datum:
        return Datum(
            input_tokens=self.tokens[:-1],
            target_tokens=self.tokens[1:],
            weights=[w * scale for w in self.weights[1:]],
        )


def answer_text(value: int | str) -> str:
    return f"\\boxed{{{value}}}"


def _broken_variant(code: str, rng: random.Random) -> str:
    """A first attempt that fails the way small models' code does (a typo'd name)."""
    if rng.random() < 0.5 and code.startswith("print("):
        return "pritn(" + code[len("print(") :]
    return code.replace("print(", "print(x + ", 1) if "print(" in code else "x" + code


def build_trajectory(
    protocol: ChatProtocol,
    question: str,
    turns: Sequence[tuple[str, str]],
    final_text: str,
    observe: Observer,
    max_observation_tokens: int = 64,
) -> tuple[list[int], list[float], list[Message]]:
    """Tokens, per-token weights and messages of one tool trajectory, built turn by turn as a rollout is.

    ``turns``: (assistant text ending in a call, the call's code), in order; each call's observation is
    ``observe(code)`` trimmed as the rollout trims it; ``final_text`` is the last (answer) turn. Weight 1
    on assistant tokens, 0 on the prompt, the observations and the template's closing tokens.
    """
    messages = protocol.initial_messages(question)
    tokens = protocol.build_prompt(messages)
    weights = [0.0] * len(tokens)
    for text, code in turns:
        completion = protocol.encode_completion(text)
        # Trimmed exactly as the rollout trims it (the traceback's tail survives).
        observation = protocol.fit_observation(observe(code), max_observation_tokens)
        tool_msg = protocol.tool_message(observation)
        next_prompt = protocol.build_next_prompt(messages, tokens, completion, tool_msg)
        weights += [1.0] * len(completion)
        # Observation tokens (and the template's closing tokens the sampler did not emit) carry weight 0.
        weights += [0.0] * (len(next_prompt) - len(tokens) - len(completion))
        tokens = next_prompt
        messages = [*messages, protocol.assistant_message(text), tool_msg]
    final = protocol.encode_completion(final_text)
    messages.append(protocol.assistant_message(final_text))
    return [*tokens, *final], [*weights, *([1.0] * len(final))], messages


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


@dataclass
class SFTReport:
    steps: int
    examples: int
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    styles: dict[str, int] = field(default_factory=dict)
    conversion: JsonObject = field(default_factory=dict)  # how the examples were built (annotated solutions)

    def as_dict(self) -> JsonObject:
        extra: JsonObject = {"conversion": self.conversion} if self.conversion else {}
        return {
            "steps": self.steps,
            "examples": self.examples,
            "first_loss": self.losses[0] if self.losses else None,
            "final_loss": sum(self.losses[-5:]) / max(1, len(self.losses[-5:])) if self.losses else None,
            "seconds": self.seconds,
            "styles": dict(self.styles),
            **extra,
        }


def train_sft(
    client: TrainingClient,
    examples: Sequence[SFTExample],
    *,
    steps: int,
    batch_size: int = 16,
    lr: float = 3e-3,
    optimizer: SFTOptimizerConfig | None = None,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
    final_examples: Sequence[SFTExample] = (),
    final_steps: int = 0,
) -> SFTReport:
    """Cross-entropy SFT through ``client.forward_backward_async(..., "cross_entropy")`` + ``optim_step_async``.

    The loss per batch is the mean over assistant tokens (weights scaled by 1 / assistant tokens).
    Learning rate: peak ``lr``, linear warm-up then cosine decay to 10%, over all ``steps``; the warm-up
    and AdamW's settings are ``optimizer``'s (``[sft.optimizer]``; default: its defaults). With ``final_examples``
    the last ``final_steps`` steps draw their batches from those instead (a second stage, same schedule).
    All steps run in one event loop: a loop per call (the sync methods) cost ~1.5 ms a call, 3% of a tiny
    model's step.
    """
    if not examples:
        raise ValueError("no SFT examples")
    if final_steps and not final_examples:
        raise ValueError("final_steps > 0 needs final_examples")
    report = SFTReport(steps=steps, examples=len(examples) + len(final_examples))
    for ex in [*examples, *final_examples]:
        report.styles[ex.style] = report.styles.get(ex.style, 0) + 1
    start = time.perf_counter()
    batches = _sft_batches(examples, final_examples, steps, final_steps, batch_size, seed)
    settings = optimizer if optimizer is not None else SFTOptimizerConfig()
    asyncio.run(_train_steps(client, batches, steps, lr, settings, report, on_step))
    report.seconds = time.perf_counter() - start
    return report


def _sft_batches(
    examples: Sequence[SFTExample],
    final_examples: Sequence[SFTExample],
    steps: int,
    final_steps: int,
    batch_size: int,
    seed: int,
) -> Iterator[list[SFTExample]]:
    """Each step's batch: epochs of shuffled ``examples``, then of ``final_examples`` for the last
    ``final_steps`` steps."""
    rng = random.Random(f"retool-sft-order/{seed}")
    order: list[int] = []
    pool = examples
    for step in range(steps):
        if final_steps and step == steps - final_steps:
            pool, order = final_examples, []
        if len(order) < batch_size:
            fresh = list(range(len(pool)))
            rng.shuffle(fresh)
            order += fresh
        yield [pool[i] for i in order[:batch_size]]
        del order[:batch_size]


async def _train_steps(
    client: TrainingClient,
    batches: Iterator[list[SFTExample]],
    steps: int,
    lr: float,
    optimizer: SFTOptimizerConfig,
    report: SFTReport,
    on_step: Callable[[int, float], None] | None,
) -> None:
    warmup = optimizer.warmup
    for step, batch in enumerate(batches):
        n_tokens = sum(sum(ex.weights[1:]) for ex in batch)
        datums = [ex.to_datum(1.0 / n_tokens) for ex in batch]
        result = await client.forward_backward_async(datums, "cross_entropy")
        frac = (
            (step + 1) / warmup
            if step < warmup
            else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
        )
        await client.optim_step_async(
            AdamParams(
                lr=lr * frac,
                beta1=optimizer.beta1,
                beta2=optimizer.beta2,
                eps=optimizer.eps,
                weight_decay=optimizer.weight_decay,
                grad_clip_norm=optimizer.grad_clip_norm,
            )
        )
        report.losses.append(float(result.loss))
        if on_step is not None:
            on_step(step, float(result.loss))
