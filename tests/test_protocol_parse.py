"""Strict parsing of assistant turns for the three tool-call formats (docs/spec.md §2): tool / answer / invalid."""

from __future__ import annotations

import json

import pytest

from retool.protocol import (
    HermesJsonFormat,
    MarkdownFormat,
    ParsedAssistant,
    QwenXmlFormat,
    ToolFormat,
    detect_format,
    get_format,
    parse_assistant,
)

FORMATS: list[ToolFormat] = [HermesJsonFormat(), QwenXmlFormat(), MarkdownFormat()]
IDS = [f.name for f in FORMATS]
CODE = 'import math\nfor k in range(3):\n    print(k, math.comb(5, k) < 10, "a\\"b", \'<x>\')'


def _parse(fmt: ToolFormat, text: str) -> ParsedAssistant:
    a, b = fmt.parse(text), parse_assistant(text, fmt.name)
    assert a == b
    return a


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_render_call_round_trips(fmt: ToolFormat) -> None:
    for code in (CODE, "print(1)", "x = 'ünïcödé'\nprint(x)", "print({'a': [1, 2]})"):
        p = _parse(fmt, "I will compute it.\n\n" + fmt.render_call(code))
        assert p.kind == "tool", p.reason
        assert p.code == code
        assert p.content == "I will compute it."
        assert p.reason is None


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_tool_with_reasoning_and_trailing_whitespace(fmt: ToolFormat) -> None:
    text = (
        "<think>\nmaybe <tool_call> or ```python in thought\n</think>\n\n"
        + fmt.render_call("print(2)")
        + "\n  \n"
    )
    p = _parse(fmt, text)
    assert p.kind == "tool" and p.code == "print(2)"
    assert p.content.startswith("<think>")


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_answer_only(fmt: ToolFormat) -> None:
    for text in ("The answer is \\boxed{12}.", "<think>\nhmm\n</think>\n\nSo \\boxed{3}", ""):
        p = _parse(fmt, text)
        assert p.kind == "answer" and p.code is None and p.reason is None
        assert p.content == text.strip()


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_two_calls_invalid(fmt: ToolFormat) -> None:
    p = _parse(fmt, fmt.render_call("print(1)") + "\n" + fmt.render_call("print(2)"))
    assert p.kind == "invalid" and "2 tool calls" in (p.reason or "")
    assert p.code is None


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_text_after_call_invalid(fmt: ToolFormat) -> None:
    for tail in ("\nThe answer is \\boxed{4}", "x", "\n<|im_start|>"):
        p = _parse(fmt, fmt.render_call("print(1)") + tail)
        assert p.kind == "invalid" and p.reason == "text after the tool call"


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_empty_code_invalid(fmt: ToolFormat) -> None:
    with pytest.raises(ValueError):
        fmt.render_call("  \n")
    empty = {
        "hermes": '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "  \\n "}}\n</tool_call>',
        "qwen_xml": "<tool_call>\n<function=code_interpreter>\n<parameter=code>\n\n</parameter>\n</function>\n</tool_call>",
        "markdown": "```python\n   \n```",
    }[fmt.name]
    p = _parse(fmt, empty)
    assert p.kind == "invalid" and p.reason == "empty code"


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_unclosed_call_invalid(fmt: ToolFormat) -> None:
    full = fmt.render_call("print(1)")
    closer = {"hermes": "</tool_call>", "qwen_xml": "</tool_call>", "markdown": "```"}[fmt.name]
    cut = full[: full.rfind(closer)]
    p = _parse(fmt, "Let me run: " + cut)
    assert p.kind == "invalid" and "unclosed" in (p.reason or "")


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_stray_tags_invalid(fmt: ToolFormat) -> None:
    strays = {
        "hermes": ["The answer </tool_call> \\boxed{1}", "<tool_response>\n4\n</tool_response>\n\\boxed{4}"],
        "qwen_xml": ["<function=code_interpreter>\nprint(1)\n</function>", "</parameter> \\boxed{1}"],
        "markdown": ["<interpreter>\n4\n</interpreter>\n\\boxed{4}", "```python3\nprint(1)\n```"],
    }[fmt.name]
    for text in strays:
        p = _parse(fmt, text)
        assert p.kind == "invalid" and "stray" in (p.reason or ""), (text, p)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_stray_tag_before_call_invalid(fmt: ToolFormat) -> None:
    before = {"hermes": "</tool_call>", "qwen_xml": "</function>", "markdown": "<interpreter>"}[fmt.name]
    p = _parse(fmt, f"oops {before}\n" + fmt.render_call("print(1)"))
    assert p.kind == "invalid" and "before the tool call" in (p.reason or "")


HERMES_BAD = [
    ('{"name": "code_interpreter", "arguments": {"code": "print(1)"}', "not valid JSON"),  # missing brace
    ("{'name': 'code_interpreter', 'arguments': {'code': 'print(1)'}}", "not valid JSON"),  # single quotes
    ('{"name": "code_interpreter", "arguments": {"code": "print(1)",}}', "not valid JSON"),  # trailing comma
    ('{"name": "code_interpreter", "arguments": "{\\"code\\": \\"print(1)\\"}"}', "must be an object"),
    ('{"name": "python", "arguments": {"code": "print(1)"}}', "unknown function"),
    ('{"name": "code_interpreter", "arguments": {"source": "print(1)"}}', "exactly {'code'}"),
    ('{"name": "code_interpreter", "arguments": {"code": "print(1)", "timeout": 3}}', "exactly {'code'}"),
    ('{"name": "code_interpreter", "arguments": {"code": 5}}', "must be a string"),
    ('{"name": "code_interpreter"}', "exactly 'name' and 'arguments'"),
    ('["code_interpreter"]', "not an object"),
    ("", "not valid JSON"),
]


@pytest.mark.parametrize(("body", "reason"), HERMES_BAD)
def test_hermes_bad_json_never_repaired(body: str, reason: str) -> None:
    p = _parse(HermesJsonFormat(), f"<tool_call>\n{body}\n</tool_call>")
    assert p.kind == "invalid" and reason in (p.reason or ""), p.reason


def test_hermes_compact_json_accepted() -> None:
    body = json.dumps({"name": "code_interpreter", "arguments": {"code": "print(1)"}}, separators=(",", ":"))
    p = _parse(HermesJsonFormat(), f"<tool_call>{body}</tool_call>")
    assert p.kind == "tool" and p.code == "print(1)"


XML_BAD = [
    ("<function=python>\n<parameter=code>\nprint(1)\n</parameter>\n</function>", "unknown function"),
    (
        "<function=code_interpreter>\n<parameter=source>\nprint(1)\n</parameter>\n</function>",
        "unknown parameter",
    ),
    (
        "<function=code_interpreter>\n<parameter=code>\nprint(1)\n</parameter>\n<parameter=t>\n3\n</parameter>\n"
        "</function>",
        "exactly one parameter",
    ),
    ("<function=code_interpreter>\n<parameter=code>\nprint(1)\n</function>", "malformed"),
    ("<function=code_interpreter>\nprint(1)\n</function>", "exactly one parameter"),
    ("\n<parameter=code>\nprint(1)\n</parameter>\n", "exactly one <function"),
    (
        "<function=code_interpreter>\n<parameter=code>\nprint(1)\n</parameter>\n</function>\n"
        "<function=code_interpreter>\n<parameter=code>\nprint(2)\n</parameter>\n</function>",
        "exactly one <function",
    ),
    ('{"name": "code_interpreter", "arguments": {"code": "print(1)"}}', "exactly one <function"),
]


@pytest.mark.parametrize(("body", "reason"), XML_BAD)
def test_xml_malformed(body: str, reason: str) -> None:
    p = _parse(QwenXmlFormat(), f"<tool_call>\n{body}\n</tool_call>")
    assert p.kind == "invalid" and reason in (p.reason or ""), p.reason


def test_xml_keeps_inner_code_verbatim() -> None:
    code = "s = '<b>'\nif 1 < 2 > 0:\n    print(s)\n"
    p = _parse(QwenXmlFormat(), QwenXmlFormat().render_call(code))
    assert p.kind == "tool" and p.code == code


def test_markdown_details() -> None:
    md = MarkdownFormat()
    assert md.stop_strings and all("```" in s for s in md.stop_strings)
    assert not md.uses_native_tools
    # A plain (non-python) fence in an answer is not a call.
    assert _parse(md, "Example:\n```\n1 2 3\n```\nSo \\boxed{6}").kind == "answer"
    # The sampler stopped on the stop string: closing fence plus newline at the end is still a call.
    p = _parse(md, "Compute.\n```python\nprint(3)\n```\n")
    assert p.kind == "tool" and p.code == "print(3)"
    # The model hallucinating the interpreter's output after its call.
    p = _parse(md, "```python\nprint(3)\n```\n<interpreter>\n3\n</interpreter>")
    assert p.kind == "invalid"
    with pytest.raises(ValueError):
        md.render_call("print('```')")


def test_hermes_tool_name_in_answer_text_is_fine() -> None:
    assert _parse(HermesJsonFormat(), "I used code_interpreter earlier; \\boxed{5}").kind == "answer"


def test_xml_and_hermes_cross_format_invalid() -> None:
    xml_call = QwenXmlFormat().render_call("print(1)")
    hermes_call = HermesJsonFormat().render_call("print(1)")
    assert _parse(HermesJsonFormat(), xml_call).kind == "invalid"
    assert _parse(QwenXmlFormat(), hermes_call).kind == "invalid"
    assert _parse(MarkdownFormat(), hermes_call).kind == "answer"  # no call syntax of *this* format


def test_get_format_names() -> None:
    assert isinstance(get_format("qwen_xml"), QwenXmlFormat)
    assert isinstance(get_format("hermes"), HermesJsonFormat)
    assert isinstance(get_format("markdown"), MarkdownFormat)
    fmt = HermesJsonFormat()
    assert get_format(fmt) is fmt
    with pytest.raises(ValueError, match="unknown tool format"):
        get_format("yaml")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        get_format("auto")


class _Tok:
    def __init__(self, template: object) -> None:
        self.chat_template = template


def test_detect_format_from_templates(qwen_tokenizers: dict) -> None:
    assert isinstance(detect_format(qwen_tokenizers["Qwen2.5-Instruct"]), HermesJsonFormat)
    assert isinstance(detect_format(qwen_tokenizers["Qwen3"]), HermesJsonFormat)
    assert isinstance(detect_format(qwen_tokenizers["Qwen3.5"]), QwenXmlFormat)
    assert isinstance(get_format("auto", qwen_tokenizers["Qwen3.5"]), QwenXmlFormat)
    assert isinstance(detect_format(_Tok(None)), MarkdownFormat)
    assert isinstance(detect_format(_Tok("{{ messages[0].content }}")), MarkdownFormat)
    assert isinstance(
        detect_format(_Tok({"default": "x", "tool_use": "<tool_call>{{ tools }}"})), HermesJsonFormat
    )


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_render_parse_round_trip_fuzz(fmt: ToolFormat) -> None:
    """Random code either round-trips exactly or is refused by render_call; never silently altered."""
    import random

    rng = random.Random(1234)
    alphabet = [
        *"abcxyz0123 \t\n\n()[]{}:=+-*/<>'\"\\#é中`",
        "</tool_call>",
        "<tool_call>",
        "```",
        "</think>",
    ]
    refused = 0
    for _ in range(400):
        code = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        try:
            text = fmt.render_call(code)
        except ValueError:
            refused += 1
            continue
        p = _parse(fmt, text)
        assert p.kind == "tool" and p.code == code
    assert refused < 400  # most random code is carried


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_render_call_refuses_own_syntax(fmt: ToolFormat) -> None:
    bad = {"hermes": "print('</tool_call>')", "qwen_xml": "s = '<parameter=x>'", "markdown": "print('```')"}
    with pytest.raises(ValueError, match="cannot be carried"):
        fmt.render_call(bad[fmt.name])
