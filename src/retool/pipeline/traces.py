"""``retool sft --data FILE``: ReTool's first stage for any model, on a trace file.

Fine-tunes the model ``model.name`` names (the tiny model, a named demo model such as ``smollm2``, a local
HF folder or a GGUF file) on the traces of a JSONL file in ``retool.train.sft``'s format: the one
``retool data coldstart`` writes from annotated solutions, and the one expert iteration writes from a
model's own verified attempts (``retool.train.expert_iteration``). Every trace must be the model's own
tokenisation (its tokenizer, chat template and system prompt): a file written for another model is refused
with the line of its first such trace. Traces the RL budgets (``[rollout]``) would cut short are left out and
counted: trained on, they teach behaviour that RL and evaluation stop half-way.

Writes ``<out>/model_sft`` (an HF folder, LoRA merged: ``retool eval --model <out>/model_sft``) and
``<out>/sft_report.json`` (steps, the loss curve, the traces used and left out).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from retool.components import build_components
from retool.config import Config
from retool.jsonl import JsonObject
from retool.pipeline.real_model import REAL_MODELS, resolve_model_path
from retool.pipeline.run import (
    local_backend,
    phase_config,
    save_hf,
    set_torch_threads,
    with_available_isolation,
)
from retool.pipeline.settings import Event
from retool.protocol import ChatProtocol
from retool.train.sft import (
    SFTExample,
    SFTProgress,
    TraceFileError,
    budget_violation,
    protocol_mismatch,
    read_trace_rows,
    train_sft_as_configured,
)

MODEL_FOLDER = "model_sft"
REPORT_FILE = "sft_report.json"


def fitting_traces(
    rows: list[tuple[int, SFTExample]], protocol: ChatProtocol, config: Config, path: Path
) -> tuple[list[SFTExample], JsonObject]:
    """The traces to train on: every one must be ``protocol``'s own (a ``TraceFileError`` names the first
    that is not); those over the RL budgets are left out, counted with the first one's reason."""
    used: list[SFTExample] = []
    over: list[str] = []
    for line, example in rows:
        mismatch = protocol_mismatch(example, protocol)
        if mismatch is not None:
            raise TraceFileError(
                f"{path}:{line}: trace {example.task.id!r} was not tokenised for model.name = "
                f"{config.model.name!r} ({mismatch}; system_prompt = {config.model.system_prompt!r}): write the "
                f"traces for this model, e.g. `retool data coldstart --model {config.model.name}`"
            )
        why = budget_violation(example, config.rollout)
        if why is None:
            used.append(example)
        else:
            over.append(f"line {line}: {why}")
    if not used:
        raise TraceFileError(f"{path}: every trace is over the RL budgets ([rollout]), e.g. {over[0]}")
    counts: JsonObject = {"read": len(rows), "used": len(used), "over_budget": len(over)}
    if over:
        counts["first_over_budget"] = over[0]
    return used, counts


def _progress(steps: int, on_event: Event | None) -> Callable[[int, float], None]:
    """Each SFT step on the progress display (``on_event``), or, without one, a log line every few steps."""
    if on_event is None:
        return SFTProgress(steps)
    return lambda step, loss: on_event("sft_step", {"step": step + 1, "steps": steps, "loss": loss})


def run_trace_sft(config: Config, data: Path, out: Path, on_event: Event | None = None) -> JsonObject:
    """SFT of ``config``'s model on the traces in ``data`` with ``[sft]``'s settings; the model and the
    report under ``out`` (module docstring). Returns the report."""
    from retool.backends.local.client import autocast_dtype  # deferred: torch (~2 s)

    emit = on_event or (lambda kind, event: None)
    rows = read_trace_rows(data)
    name = config.model.name
    model = str(resolve_model_path(name)) if name in REAL_MODELS else name
    out.mkdir(parents=True, exist_ok=True)
    set_torch_threads(config)
    # The tiny model is built into <out>/tiny_model; the backend keeps its state under <out>.
    sft_config = phase_config(with_available_isolation(config), model, out)
    with build_components(sft_config, tools=False) as parts:
        examples, counts = fitting_traces(rows, parts.protocol.with_tools(True), config, data)
        client = local_backend(parts)
        client.train_autocast = autocast_dtype(config.sft.autocast, client.device)
        steps = config.sft.steps_for(len(examples))
        emit("phase", {"phase": "sft", "detail": f"{len(examples)} traces of {data}, {steps} steps"})
        start = time.perf_counter()
        report = train_sft_as_configured(parts.backend, examples, config, on_step=_progress(steps, on_event))
        emit("phase_done", {"phase": "sft", "seconds": time.perf_counter() - start})
        client.train_autocast = None
        folder = save_hf(client, out / MODEL_FOLDER)
    result: JsonObject = {
        "data": str(data),
        "base_model": name,
        "model": str(folder),
        "traces": counts,
        "sft": report.as_dict(),
        "config": config.sft.model_dump(mode="json"),  # the [sft] settings it ran with
        "losses": list(report.losses),
    }
    (out / REPORT_FILE).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result
