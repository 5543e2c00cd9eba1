"""Supervised fine-tuning on code-integrated traces: the trace, its file, and the trainer (ReTool's first stage).

Owns what every cold start shares, whatever built its traces (the synthetic style mix of
``retool.recipes.tiny.styles``, annotated solutions converted by ``retool data coldstart``, a model's own verified
attempts kept by ``retool.train.expert_iteration``):

- ``SFTExample``: one trace as the tokens the model sees and a weight per token (1 on the assistant's
  tokens, 0 on the prompt and on the interpreter's output), tokenised by one model's protocol;
- the trace file (``write_examples`` / ``read_examples``, one JSON line per trace), and what may be trained
  from it on a given model: ``protocol_mismatch`` (a trace tokenised for another tokenizer or chat template)
  and ``budget_violation`` (a trace the rollout's budgets would have cut short);
- ``train_sft``: cross-entropy on the assistant tokens through any ``TrainingClient``, with a warm-up and
  cosine schedule, and ``SFTProgress``, its progress lines.

The traces store token ids, not messages: a call format differs between models (Hermes JSON, Qwen XML,
markdown blocks), so a trace cannot be re-rendered for another model's template without rewriting its
calls. A file written for one model is therefore refused on another (``protocol_mismatch``), with the
command that writes it for the right one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from retool.backends.interface.clients import TrainingClient
from retool.backends.interface.types import AdamParams, Datum
from retool.config import Config, RolloutConfig, SFTOptimizerConfig
from retool.data.problem import Problem
from retool.data.synthetic import Task
from retool.errors import UserError
from retool.jsonl import JsonObject, jsonl_lines
from retool.protocol import ChatProtocol

logger = logging.getLogger(__name__)


@dataclass
class SFTExample:
    task: Task | Problem  # a synthetic task, or a problem from a file or a source
    style: str  # how it was built: direct | tool | error_fix | annotated | sampled ...
    tokens: list[int]
    weights: list[float]  # per token of ``tokens``: 1 on assistant tokens
    text: str = ""

    def to_datum(self, scale: float = 1.0) -> Datum:
        return Datum(
            input_tokens=self.tokens[:-1],
            target_tokens=self.tokens[1:],
            weights=[w * scale for w in self.weights[1:]],
        )


class TraceFileError(UserError):
    """A trace file that cannot be trained on: missing, a broken row, or traces of another model."""


# -- the trace file ---------------------------------------------------------------------------------


def write_examples(examples: Sequence[SFTExample], path: str | Path) -> None:
    """One JSON line per trace: the problem, ``style``, ``tokens``, ``weights`` and the decoded ``text``."""
    with Path(path).open("w", encoding="utf-8") as fh:
        for ex in examples:
            problem = ex.task.to_problem() if isinstance(ex.task, Task) else ex.task
            record = {
                **problem.to_dict(),
                "style": ex.style,
                "tokens": ex.tokens,
                "weights": ex.weights,
                "text": ex.text,
            }
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")


def read_trace_rows(path: str | Path) -> list[tuple[int, SFTExample]]:
    """(line number, trace) of every row ``write_examples`` wrote; a row that is not one raises a
    ``TraceFileError`` naming the file and the line."""
    if not Path(path).is_file():
        raise TraceFileError(f"{path}: no such file")
    rows: list[tuple[int, SFTExample]] = []
    for line in jsonl_lines(path):
        try:
            record = json.loads(line.raw)
        except ValueError as exc:
            raise TraceFileError(f"{path}:{line.number}: not a JSON line ({exc})") from None
        rows.append((line.number, _example(record, f"{path}:{line.number}")))
    return rows


def read_examples(path: str | Path) -> list[SFTExample]:
    """The traces ``write_examples`` wrote, ready for ``train_sft`` (see ``read_trace_rows``)."""
    return [example for _, example in read_trace_rows(path)]


def _example(record: object, where: str) -> SFTExample:
    """The trace one row holds; a ``TraceFileError`` at ``where`` saying what the row lacks."""
    if not isinstance(record, dict):
        raise TraceFileError(f"{where}: a JSON {type(record).__name__}, not a trace object")
    missing = [k for k in ("id", "question", "answer", "style", "tokens", "weights") if k not in record]
    if missing:
        raise TraceFileError(
            f"{where}: not an SFT trace (no {', '.join(missing)}); traces are written by "
            "`retool data coldstart` or expert iteration"
        )
    tokens, weights = record["tokens"], record["weights"]
    if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
        raise TraceFileError(f"{where}: 'tokens' is not a list of token ids")
    if not isinstance(weights, list) or not all(isinstance(w, int | float) for w in weights):
        raise TraceFileError(f"{where}: 'weights' is not a list of numbers")
    if len(tokens) != len(weights):
        raise TraceFileError(f"{where}: {len(tokens)} tokens but {len(weights)} weights")
    if not any(weights):
        raise TraceFileError(f"{where}: no token has a weight: nothing to train on")
    source = str(record.get("data_source", ""))
    problem = Problem(str(record["id"]), str(record["question"]), str(record["answer"]), source)
    text = str(record.get("text", ""))
    return SFTExample(
        problem, str(record["style"]), [int(t) for t in tokens], [float(w) for w in weights], text
    )


# -- what a model can train on ---------------------------------------------------------------------


def protocol_mismatch(example: SFTExample, protocol: ChatProtocol) -> str | None:
    """Why ``example`` was not tokenised by ``protocol`` (None: it was): its tokens must begin with the
    protocol's own prompt for its question, with the tool registered or (a text-only trace) without. A
    trace of another tokenizer, chat template or system prompt begins otherwise."""
    modes = (protocol, protocol.with_tools(False)) if protocol.use_tools else (protocol,)
    longest = 0
    for mode in modes:
        prompt = mode.build_prompt(mode.initial_messages(example.task.question))
        if example.tokens[: len(prompt)] == prompt:
            return None
        same = next((i for i, (a, b) in enumerate(zip(prompt, example.tokens, strict=False)) if a != b), 0)
        longest = max(longest, same)
    return f"its prompt differs from this model's prompt for its question at token {longest}"


def assistant_spans(weights: Sequence[float]) -> list[int]:
    """Lengths of the runs of trained tokens: one per assistant turn (prompt and observations weigh 0)."""
    spans: list[int] = []
    run = 0
    for w in [*weights, 0.0]:
        if w > 0:
            run += 1
        elif run:
            spans.append(run)
            run = 0
    return spans


def budget_violation(example: SFTExample, budgets: RolloutConfig) -> str | None:
    """Why the rollout would have cut ``example`` short (None: it fits): more calls or turns than allowed,
    a turn over ``max_tokens_per_turn`` or a trajectory over ``max_trajectory_tokens``. Trained on, such a
    trajectory would teach behaviour that RL and evaluation then stop half-way."""
    turns = assistant_spans(example.weights)
    # A turn's span includes its end-of-turn token, which the sampler emits within the turn's budget.
    if len(turns) - 1 > budgets.max_code_calls:
        return f"{len(turns) - 1} calls > max_code_calls {budgets.max_code_calls}"
    if len(turns) > budgets.max_assistant_turns:
        return f"{len(turns)} turns > max_assistant_turns {budgets.max_assistant_turns}"
    if max(turns, default=0) > budgets.max_tokens_per_turn:
        return f"a turn of {max(turns)} tokens > max_tokens_per_turn {budgets.max_tokens_per_turn}"
    if len(example.tokens) > budgets.max_trajectory_tokens:
        return f"{len(example.tokens)} tokens > max_trajectory_tokens {budgets.max_trajectory_tokens}"
    return None


# -- training ---------------------------------------------------------------------------------------


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


class SFTProgress:
    """``train_sft``'s ``on_step`` that logs a progress line every ``every`` steps (and at the last): step,
    the mean loss since the previous line, seconds a step and the time left at that rate."""

    def __init__(self, steps: int, every: int = 10, label: str = "sft") -> None:
        self.steps, self.every, self.label = steps, max(1, every), label
        self._start = time.perf_counter()
        self._losses: list[float] = []

    def __call__(self, step: int, loss: float) -> None:
        self._losses.append(loss)
        done = step + 1
        if done % self.every and done != self.steps:
            return
        per_step = (time.perf_counter() - self._start) / done
        logger.info(
            "%s step %d/%d  loss %.4f  %.2f s/step  ETA %s",
            self.label,
            done,
            self.steps,
            sum(self._losses) / len(self._losses),
            per_step,
            _duration(per_step * (self.steps - done)),
        )
        self._losses.clear()


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def train_sft_as_configured(
    client: TrainingClient,
    examples: Sequence[SFTExample],
    config: Config,
    on_step: Callable[[int, float], None] | None = None,
    final_examples: Sequence[SFTExample] = (),
) -> SFTReport:
    """``train_sft`` with ``[sft]``'s steps (``SFTConfig.steps_for`` the examples), batch size, learning rate
    and optimizer and ``train.seed`` (``final_examples``: ``final_share`` of the steps at the end)."""
    s = config.sft
    steps = s.steps_for(len(examples) + len(final_examples))
    return train_sft(
        client,
        examples,
        steps=steps,
        batch_size=s.batch_size,
        lr=s.lr,
        optimizer=s.optimizer,
        seed=config.train.seed,
        on_step=on_step,
        final_examples=final_examples,
        final_steps=s.final_steps_of(steps) if final_examples else 0,
    )


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
