"""The ``code_interpreter`` tool schema and the system prompts (docs/spec.md §2, chapter 8.4.2).

Owns the wording the model sees. The tool-use prompt is format-neutral: native formats (Hermes JSON,
Qwen XML) get the call syntax from the chat template's own tool preamble; the markdown format, which
has no native tools, appends ``MARKDOWN_TOOL_INSTRUCTIONS``.
"""

from __future__ import annotations

from retool.jsonl import JsonObject

TOOL_NAME = "code_interpreter"

CODE_TOOL: JsonObject = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Run Python code and return printed output. Each execution starts fresh.",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "Python code to run; print what you want to see."},
            },
            "required": ["code"],
        },
    },
}

TOOL_SYSTEM_PROMPT = (
    "You solve math problems step by step with the help of a Python interpreter.\n"
    "Use the code_interpreter tool when computation, symbolic manipulation or enumeration helps you "
    "solve the problem exactly and quickly.\n"
    "Call the tool at most once per turn, then wait for its result.\n"
    "The result is what your code prints: always print() the values you want to see.\n"
    "Every run starts fresh: no variables, files or other state survive between calls, so define "
    "everything you need again each time.\n"
    "Keep code quick (a few seconds) and small in memory; do not read or write files; keep any "
    "search space small.\n"
    "If a run returns an error, work out why and, if needed, retry with corrected code.\n"
    "Finish with exactly one line containing \\boxed{<final answer>}.\n"
    "Never call the tool and give the final answer in the same turn."
)

TEXT_SYSTEM_PROMPT = (
    "You solve math problems step by step. You have no tools: reason carefully and compute by hand.\n"
    "Finish with exactly one line containing \\boxed{<final answer>}."
)

MARKDOWN_TOOL_INSTRUCTIONS = (
    "To call the code_interpreter, end your turn with a single fenced block\n"
    "```python\n<code>\n```\n"
    "and write nothing after it. The output will come back in the next message as "
    "<interpreter>...</interpreter>."
)

# The same rules in about a third of the tokens, for small models and short contexts (``model.system_prompt
# = "compact"``): on CPU every prompt token is paid again in every trained sequence.
TOOL_SYSTEM_PROMPT_COMPACT = (
    "Solve the math problem. You can run Python with the code_interpreter tool: print what you need to "
    "see; every run starts fresh; keep code small and quick; at most one call per turn; on an error, fix "
    "the code and retry. Give the final answer as \\boxed{<answer>} in a turn without a tool call."
)

TEXT_SYSTEM_PROMPT_COMPACT = (
    "Solve the math problem step by step; you have no tools. Give the final answer as \\boxed{<answer>}."
)

MARKDOWN_TOOL_INSTRUCTIONS_COMPACT = (
    "To run code, end your turn with one ```python block; its output comes back as "
    "<interpreter>...</interpreter>."
)

PROMPT_STYLES = ("full", "compact")


def system_prompt_text(use_tools: bool, native_tools: bool, style: str = "full") -> str:
    """The system prompt of a mode: text-only, tool use with a native call format (the template teaches
    the syntax), or tool use in the markdown format (the prompt teaches it), in the ``full`` or
    ``compact`` wording."""
    if style not in PROMPT_STYLES:
        raise ValueError(f"unknown system prompt style {style!r}; use one of {', '.join(PROMPT_STYLES)}")
    compact = style == "compact"
    if not use_tools:
        return TEXT_SYSTEM_PROMPT_COMPACT if compact else TEXT_SYSTEM_PROMPT
    tool = TOOL_SYSTEM_PROMPT_COMPACT if compact else TOOL_SYSTEM_PROMPT
    if native_tools:
        return tool
    return f"{tool}\n\n{MARKDOWN_TOOL_INSTRUCTIONS_COMPACT if compact else MARKDOWN_TOOL_INSTRUCTIONS}"
