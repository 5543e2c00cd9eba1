"""The ``code_interpreter`` tool schema and the system prompts (SPEC §2, chapter 8.4.2).

Owns the wording the model sees. The tool-use prompt is format-neutral: native formats (Hermes JSON,
Qwen XML) get the call syntax from the chat template's own tool preamble; the markdown format, which
has no native tools, appends ``MARKDOWN_TOOL_INSTRUCTIONS``.
"""

from __future__ import annotations

from typing import Any

TOOL_NAME = "code_interpreter"

CODE_TOOL: dict[str, Any] = {
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
