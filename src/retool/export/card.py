"""The model card (``README.md`` of an export): what the model is, what it was trained on and how, how it
scored, and the tool protocol a caller must follow to get the behaviour it was trained for.

Owns the card's facts and where each is read: the base model and its license (a GGUF's
``general.license``, the ``license:`` of a model folder's own README, the tiny model's marker file; else
"see the base model"), the run's settings (its ``config.toml``, a demo's ``settings.json``), the
evaluation table (``retool.export.source``), and the protocol, rendered by the same ``ChatProtocol`` the
trainer used: the system prompt, the tool schema, one call and one interpreter reply in the model's call
format. The front matter is the Hugging Face Hub's model-card metadata.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from retool.config import Config
from retool.export.source import ExportSource, Weights
from retool.protocol import CODE_TOOL, ChatProtocol

if TYPE_CHECKING:  # the name only: transformers is imported where an export runs
    from transformers import PreTrainedTokenizerBase

PROJECT_URL = "https://github.com/retool-rl/retool-rl"
TINY_MARKER = "retool_tiny.json"  # retool.backends.local.tinymodel writes it into every tiny model folder
_TINY = "the tiny model, randomly initialised by retool-rl (no upstream license; retool-rl is Apache-2.0)"


@dataclass(frozen=True)
class CardFile:
    """One entry of the card's file table."""

    path: str
    format: str
    load: str


def model_card(
    source: ExportSource, tokenizer: PreTrainedTokenizerBase, files: list[CardFile], name: str
) -> str:
    """The whole ``README.md``."""
    config = source.config or Config()
    license_id = base_license(source)
    parts = [
        _front_matter(source, license_id, files),
        f"# {name}\n\n{_summary(source)}",
        "## Model\n\n" + _model_facts(source, config, license_id),
        "## Files\n\n" + _files_table(files),
        "## Evaluation\n\n" + (source.evaluation or _NO_EVALUATION),
        "## Tool protocol\n\n" + protocol_section(tokenizer, config),
    ]
    return "\n\n".join(p.strip() for p in parts) + "\n"


_NO_EVALUATION = (
    "No evaluation is stored with this run. Measure it with `retool eval --mode retool --model DIR ...` "
    "and `--mode text-only` (same problems, sampling and verifier)."
)


def _front_matter(source: ExportSource, license_id: str | None, files: list[CardFile]) -> str:
    base = _base_name(source)
    lines = ["---"]
    if re.fullmatch(r"[\w.-]+/[\w.-]+", base) and not Path(base).exists():  # a Hub id
        lines.append(f"base_model: {base}")
    if license_id:
        lines.append(f"license: {license_id}")
    has_hf = any(f.format.startswith("hf") for f in files)
    lines.append(f"library_name: {'transformers' if has_hf or not files else 'peft'}")
    tags = ["retool", "tool-use", "code-interpreter", "math", "reinforcement-learning"]
    tags += ["gguf"] if any(f.format.startswith("gguf") for f in files) else []
    lines += ["pipeline_tag: text-generation", "tags:", *(f"- {t}" for t in tags), "---"]
    return "\n".join(lines)


def _summary(source: ExportSource) -> str:
    return (
        f"Exported by `retool export` from the {source.what}. Trained with [retool-rl]({PROJECT_URL}) "
        "(the ReTool recipe): reinforcement learning that teaches a model to call a Python interpreter while "
        "it solves math problems, rewarded only for the final `\\boxed{}` answer."
    )


def _base_name(source: ExportSource) -> str:
    """The model training started from, as the user named it (the config's ``model.name``)."""
    if source.config is not None:
        return source.config.model.name
    return source.weights.base


def _model_facts(source: ExportSource, config: Config, license_id: str | None) -> str:
    base = _base_name(source)
    facts = [
        f"- **Base model:** {base}" + (" (retool-rl's tiny model, built locally)" if base == "tiny" else "")
    ]
    if source.kind == "demo" and source.demo:
        facts.append(
            f"- **Recipe:** `retool demo --recipe {source.demo.get('recipe', '?')}`: cold-start SFT "
            "(`model_sft`), then RL (`model_rl`)"
        )
    elif source.kind == "demo":
        facts.append("- **Recipe:** `retool sft`: cold-start SFT on traces (`model_sft`)")
    elif source.kind == "run":
        facts.append("- **Recipe:** `retool train` (RL with the ReTool environment)")
    if source.config is not None:
        facts.append(f"- **Data:** `data.source = {config.data.source!r}`")
        facts.append(f"- **Training:** {_training_line(config, source.step)}")
    elif source.step is not None:
        facts.append(f"- **Steps:** {source.step}")
    facts.append(f"- **Weights:** {_weights_line(source.weights)}")
    facts.append(f"- **License (base model):** {_license_text(source, license_id)}")
    return "\n".join(facts)


def _training_line(config: Config, step: int | None) -> str:
    lora = config.lora
    how = (
        f"LoRA r={lora.rank}, alpha={lora.alpha} on {', '.join(lora.target_modules)}"
        if lora.enabled
        else "full fine-tuning"
    )
    rollout = config.rollout
    done = f"{step} of {config.train.steps} steps" if step is not None else f"{config.train.steps} steps"
    return (
        f"{done}; {rollout.questions_per_step} questions x group {rollout.group_size} per step; loss "
        f"`{config.loss.name}`; {how}; learning rate {config.optimizer.lr:g}; seed {config.train.seed}"
    )


def _weights_line(weights: Weights) -> str:
    if weights.adapter is not None:
        lora = weights.lora or {}
        targets = lora.get("target_modules")
        on = f" on {', '.join(str(t) for t in targets)}" if isinstance(targets, list) else ""
        return f"a LoRA adapter (r={lora.get('rank')}, alpha={lora.get('alpha')}{on}) merged into the base"
    if weights.full is not None:
        return "all weights trained (full fine-tuning)"
    return "the source folder's own weights (merged already)"


def _license_text(source: ExportSource, license_id: str | None) -> str:
    if license_id == "apache-2.0" and _is_tiny(source):
        return _TINY
    return license_id or "see the base model's own card"


def _files_table(files: list[CardFile]) -> str:
    rows = ["| file | format | load with |", "|---|---|---|"]
    rows += [f"| `{f.path}` | {f.format} | {f.load} |" for f in files]
    return "\n".join(rows)


def _is_tiny(source: ExportSource) -> bool:
    if source.config is not None and source.config.model.name == "tiny":
        return True
    return any(
        (Path(w.base) / TINY_MARKER).is_file() for w in (source.weights, source.adapter) if w is not None
    )


def base_license(source: ExportSource) -> str | None:
    """The base model's license id, where it is written down; None where it is not."""
    if _is_tiny(source):
        return "apache-2.0"
    for weights in (source.weights, source.adapter):
        if weights is None:
            continue
        found = _license_of(Path(weights.base).expanduser(), weights.gguf_file)
        if found:
            return found
    if source.config is not None:
        named = Path(source.config.model.name).expanduser()
        return _license_of(named.parent, named.name) if named.suffix == ".gguf" else _license_of(named, None)
    return None


def _license_of(folder: Path, gguf_file: str | None) -> str | None:
    """``general.license`` of a GGUF file, or the ``license:`` line of a folder's README front matter."""
    if gguf_file and (folder / gguf_file).is_file():
        import gguf  # deferred: gguf is optional (the gguf extra)

        field = gguf.GGUFReader(str(folder / gguf_file)).fields.get("general.license")
        return str(field.contents()) if field is not None else None
    readme = folder / "README.md"
    if readme.is_file():
        match = re.search(
            r"^license:\s*(\S+)\s*$", readme.read_text(encoding="utf-8", errors="replace"), re.M
        )
        return match.group(1) if match else None
    return None


def protocol_section(tokenizer: PreTrainedTokenizerBase, config: Config) -> str:
    """How a caller must present the interpreter, rendered with the trainer's own ``ChatProtocol``."""
    protocol = ChatProtocol.from_config(tokenizer, config)
    fmt = protocol.fmt
    call = fmt.render_call("print(2**10)")
    reply = protocol.tool_message("1024\n")
    budgets = config.rollout
    text_only = protocol.with_tools(False)
    lines = [
        f"The model was trained to call one tool, `code_interpreter`, in the **{fmt.name}** call format of its "
        "chat template. To get that behaviour, present the interpreter exactly as in training:",
        "",
        "1. The system prompt, word for word:",
        "",
        _fenced(protocol.system_prompt, "text"),
        "",
    ]
    if protocol.tools:
        lines += [
            "2. The tool schema, passed to the chat template as `tools=[...]` "
            "(`tokenizer.apply_chat_template(messages, tools=[CODE_TOOL], add_generation_prompt=True)`):",
            "",
            _fenced(json.dumps(CODE_TOOL, indent=2), "json"),
        ]
    else:
        lines.append(
            "2. No tool schema: the system prompt teaches the call syntax (this template has no tools)."
        )
    lines += [
        "",
        "3. A call ends the assistant's turn. It looks like this:",
        "",
        _fenced(call, "text"),
        "",
        "4. Run the code in a fresh Python process (nothing survives between calls; "
        f"{', '.join(config.sandbox.preimport)} importable; a {config.sandbox.timeout:g} s limit) and send back "
        f"what it printed (on an error, its stderr), cut from the front to {budgets.max_observation_tokens} "
        "tokens, as this message (the chat template renders it):",
        "",
        _fenced(json.dumps(reply, ensure_ascii=False), "json"),
        "",
        "5. Sample the next assistant turn. Stop a turn at the template's end-of-turn token "
        f"(`{tokenizer.convert_ids_to_tokens(protocol.end_of_turn_id)}`)"
        + (f" or at {', '.join(repr(s) for s in fmt.stop_strings)}" if fmt.stop_strings else "")
        + f". Training allowed at most {budgets.max_code_calls} calls and {budgets.max_assistant_turns} "
        "assistant turns. The answer is the last `\\boxed{...}` of a turn without a call.",
        "",
        "Text-only (the `text-only` evaluation): no tools, and this system prompt:",
        "",
        _fenced(text_only.system_prompt, "text"),
    ]
    return "\n".join(lines)


def _fenced(text: str, lang: str) -> str:
    fence = "````" if "```" in text else "```"
    return f"{fence}{lang}\n{text}\n{fence}"
