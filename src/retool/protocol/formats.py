"""Tool-call formats and the strict parser of an assistant turn (docs/spec.md §2, chapter 8.4.2).

Owns the three pluggable call syntaxes (Qwen3.5/Qwen3-Coder XML, Hermes JSON, paper-style markdown
code blocks), their detection from a chat template, and ``parse_assistant``.

The parser is deliberately strict and never repairs anything: a turn is ``tool`` only if it holds exactly
one well-formed call to ``code_interpreter`` with non-empty code and nothing but whitespace after it;
``answer`` only if it holds no call syntax at all; everything else is ``invalid`` with a ``reason``.
Reasoning (``<think>...</think>``) is not an action: only the text after the last ``</think>`` is
parsed, so a model musing about a tag inside its reasoning is not punished for it.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import ClassVar, Literal

from retool.jsonl import JsonValue
from retool.protocol.prompts import TOOL_NAME

logger = logging.getLogger(__name__)

Kind = Literal["tool", "answer", "invalid"]
THINK_END = "</think>"


@dataclass(frozen=True)
class ParsedAssistant:
    """One parsed assistant turn.

    ``content`` is the whole turn (stripped) for ``answer`` and ``invalid``, and the text before the
    call for ``tool``. ``code`` is set only for ``tool``; ``reason`` only for ``invalid``.
    """

    kind: Kind
    content: str
    code: str | None = None
    reason: str | None = None


class ToolFormat:
    """A call syntax.

    Subclasses set the markers and implement ``_find_openers``, ``_parse_call`` and ``_render``.
    """

    name: ClassVar[str] = ""
    uses_native_tools: ClassVar[bool] = True
    # Extra stop strings the sampler needs to end a turn right after a call (native formats end with
    # the end-of-turn token instead).
    stop_strings: ClassVar[tuple[str, ...]] = ()
    # Any of these anywhere in the visible text means the turn tried to use call syntax.
    markers: ClassVar[tuple[str, ...]] = ()
    # Strings that tool output must not contain verbatim (they would fake the observation's end).
    observation_guards: ClassVar[tuple[str, ...]] = ()

    def render_call(self, code: str) -> str:
        """The assistant text of one call to ``code_interpreter`` (SFT data, tests).

        Raises ``ValueError`` for code this format cannot carry (empty, or containing its own call
        syntax): the rendered call must parse back to exactly ``code``.
        """
        _check_code(code)
        text = self._render(code)
        parsed = self.parse(text)
        if parsed.kind != "tool" or parsed.code != code:
            raise ValueError(
                f"code cannot be carried by the {self.name} call format ({parsed.reason or 'round trip'})"
            )
        return text

    def _render(self, code: str) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _find_openers(self, visible: str) -> list[re.Match[str]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _parse_call(self, call_text: str) -> tuple[str | None, str, str]:
        """Parse text starting at the opener: return (code or None, reason, text after the call)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def parse(self, text: str) -> ParsedAssistant:
        whole = text.strip()
        cut = text.rfind(THINK_END)
        offset = cut + len(THINK_END) if cut >= 0 else 0
        visible = text[offset:]
        present = [m for m in self.markers if m in visible]
        if not present:
            return ParsedAssistant("answer", whole)
        openers = self._find_openers(visible)
        if not openers:
            return _invalid(whole, f"stray call syntax {present[0]!r} without a call opening")
        if len(openers) > 1:
            return _invalid(whole, f"{len(openers)} tool calls in one turn (at most one is allowed)")
        start = openers[0].start()
        before = visible[:start]
        stray = [m for m in self.markers if m in before]
        if stray:
            return _invalid(whole, f"stray call syntax {stray[0]!r} before the tool call")
        code, reason, after = self._parse_call(visible[start:])
        if code is None:
            return _invalid(whole, reason)
        if after.strip():
            return _invalid(whole, "text after the tool call")
        if not code.strip():
            return _invalid(whole, "empty code")
        return ParsedAssistant("tool", text[: offset + start].strip(), code=code)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _invalid(content: str, reason: str) -> ParsedAssistant:
    return ParsedAssistant("invalid", content, reason=reason)


class _TaggedFormat(ToolFormat):
    """Formats whose call is wrapped in ``<tool_call>...</tool_call>``."""

    opener: ClassVar[str] = "<tool_call>"
    closer: ClassVar[str] = "</tool_call>"
    observation_guards = ("<tool_response>", "</tool_response>")

    def _find_openers(self, visible: str) -> list[re.Match[str]]:
        return list(re.finditer(re.escape(self.opener), visible))

    def _parse_call(self, call_text: str) -> tuple[str | None, str, str]:
        end = call_text.find(self.closer)
        if end < 0:
            return None, f"unclosed tool call (no {self.closer})", ""
        body = call_text[len(self.opener) : end]
        after = call_text[end + len(self.closer) :]
        code, reason = self._parse_body(body)
        return code, reason, after

    def _parse_body(self, body: str) -> tuple[str | None, str]:  # pragma: no cover - abstract
        raise NotImplementedError


class HermesJsonFormat(_TaggedFormat):
    """Hermes / Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    name = "hermes"
    markers = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

    def _render(self, code: str) -> str:
        # Same bytes as the Qwen/Hermes templates' rendering of a structured call (tojson keeps non-ASCII).
        args = json.dumps({"code": code}, ensure_ascii=False)
        return f'<tool_call>\n{{"name": "{TOOL_NAME}", "arguments": {args}}}\n</tool_call>'

    def _parse_body(self, body: str) -> tuple[str | None, str]:
        try:
            obj: JsonValue = json.loads(body)
        except json.JSONDecodeError as exc:
            return None, f"tool call is not valid JSON: {exc.msg} at char {exc.pos}"
        if not isinstance(obj, dict):
            return None, "tool call JSON is not an object"
        if set(obj) != {"name", "arguments"}:
            return None, f"tool call JSON must have exactly 'name' and 'arguments', got {sorted(obj)}"
        if obj["name"] != TOOL_NAME:
            return None, f"unknown function {obj['name']!r} (expected {TOOL_NAME!r})"
        args = obj["arguments"]
        if not isinstance(args, dict):
            # A JSON string holding JSON is a near miss; nothing is repaired.
            return None, f"'arguments' must be an object, got {type(args).__name__}"
        if set(args) != {"code"}:
            return None, f"arguments must be exactly {{'code'}}, got {sorted(args)}"
        code = args["code"]
        if not isinstance(code, str):
            return None, f"'code' must be a string, got {type(code).__name__}"
        return code, ""


_XML_BODY = re.compile(
    r"\s*<function=([^>\n]*)>\s*<parameter=([^>\n]*)>(.*?)</parameter>\s*</function>\s*",
    re.DOTALL,
)


class QwenXmlFormat(_TaggedFormat):
    """Qwen3.5 / Qwen3-Coder: ``<tool_call>\\n<function=NAME>\\n<parameter=code>\\n...\\n</parameter>...``."""

    name = "qwen_xml"
    markers = (
        "<tool_call>",
        "</tool_call>",
        "<function=",
        "</function>",
        "<parameter=",
        "</parameter>",
        "<tool_response>",
        "</tool_response>",
    )

    def _render(self, code: str) -> str:
        return f"<tool_call>\n<function={TOOL_NAME}>\n<parameter=code>\n{code}\n</parameter>\n</function>\n</tool_call>"

    def _parse_body(self, body: str) -> tuple[str | None, str]:
        n_fn, n_param = body.count("<function="), body.count("<parameter=")
        if n_fn != 1:
            return None, f"tool call must hold exactly one <function=...> block, found {n_fn}"
        if n_param != 1:
            return None, f"call must have exactly one parameter 'code', found {n_param}"
        m = _XML_BODY.fullmatch(body)
        if m is None:
            return None, "malformed XML tool call"
        fn, param, value = m.group(1).strip(), m.group(2).strip(), m.group(3)
        if fn != TOOL_NAME:
            return None, f"unknown function {fn!r} (expected {TOOL_NAME!r})"
        if param != "code":
            return None, f"unknown parameter {param!r} (expected 'code')"
        # The template writes exactly one newline on each side of the value.
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        return value, ""


_MD_OPENER = re.compile(r"```(?:python|py)[ \t]*(?:\n|$)")


class MarkdownFormat(ToolFormat):
    """Paper-style: a turn ending in ```` ```python\\n...\\n``` ````, answered by ``<interpreter>...</interpreter>``.

    For models without native tool calling. No tool schema is passed to the template; the observation is
    delivered as a **user** message ``<interpreter>\\n...\\n</interpreter>`` (any chat template supports a
    user turn; not every one supports a ``tool`` role). The sampler stops on the closing fence.
    """

    name = "markdown"
    uses_native_tools = False
    stop_strings = ("```\n",)
    markers = ("```python", "```py", "<interpreter>", "</interpreter>")
    observation_guards = ("<interpreter>", "</interpreter>")

    def _render(self, code: str) -> str:
        return f"```python\n{code}\n```"

    def _find_openers(self, visible: str) -> list[re.Match[str]]:
        return list(_MD_OPENER.finditer(visible))

    def _parse_call(self, call_text: str) -> tuple[str | None, str, str]:
        m = _MD_OPENER.match(call_text)
        assert m is not None  # called at an opener
        end = call_text.find("```", m.end())
        if end < 0:
            return None, "unclosed code block (no closing ```)", ""
        value = call_text[m.end() : end]
        if value.endswith("\n"):
            value = value[:-1]
        return value, "", call_text[end + 3 :]


def _check_code(code: str) -> None:
    if not isinstance(code, str) or not code.strip():
        raise ValueError("a tool call needs non-empty code")


FORMATS: dict[str, type[ToolFormat]] = {
    "qwen_xml": QwenXmlFormat,
    "hermes": HermesJsonFormat,
    "markdown": MarkdownFormat,
}


def _template_text(tokenizer: object) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: prefer the tool-use one
        template = template.get("tool_use") or template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) else None


def detect_format(tokenizer: object) -> ToolFormat:
    """Pick the call syntax the tokenizer's chat template teaches its model.

    XML ``<function=...><parameter=...>`` inside ``<tool_call>`` -> ``qwen_xml``; ``<tool_call>`` with JSON
    -> ``hermes``; a template without tool calls (or none at all) -> ``markdown``.
    """
    template = _template_text(tokenizer)
    if template is None:
        fmt: ToolFormat = MarkdownFormat()
    elif "<tool_call>" in template and "<function=" in template and "<parameter=" in template:
        fmt = QwenXmlFormat()
    elif "<tool_call>" in template:
        fmt = HermesJsonFormat()
    else:
        fmt = MarkdownFormat()
    logger.info("tool-call format detected from chat template: %s", fmt.name)
    return fmt


def get_format(name: str | ToolFormat, tokenizer: object = None) -> ToolFormat:
    """``"qwen_xml" | "hermes" | "markdown"``, or ``"auto"`` (needs ``tokenizer``); instances pass through."""
    if isinstance(name, ToolFormat):
        return name
    if name == "auto":
        if tokenizer is None:
            raise ValueError("tool format 'auto' needs a tokenizer to read its chat template")
        return detect_format(tokenizer)
    try:
        return FORMATS[name]()
    except KeyError:
        raise ValueError(f"unknown tool format {name!r}; choose one of auto, {', '.join(FORMATS)}") from None


def parse_assistant(text: str, fmt: str | ToolFormat) -> ParsedAssistant:
    """Classify one assistant turn as ``tool`` / ``answer`` / ``invalid`` (strict; nothing repaired)."""
    return get_format(fmt).parse(text)
