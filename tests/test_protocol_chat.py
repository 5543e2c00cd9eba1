"""ChatProtocol with the real Qwen tokenizers and the tiny model's tokenizer: prompts, exact token
continuity across a three-turn tool trajectory, honest errors for templates that rewrite history,
observation budgeting and end-of-turn handling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from retool.protocol import (
    CODE_TOOL,
    TEXT_SYSTEM_PROMPT,
    TOOL_SYSTEM_PROMPT,
    ChatProtocol,
    HermesJsonFormat,
    MarkdownFormat,
    QwenXmlFormat,
    TemplateNotAppendOnlyError,
    parse_assistant,
)

QUESTION = "Find the number of positive divisors of 2024."
CODES = [
    "n = 2024\nprint(sum(1 for d in range(1, n + 1) if n % d == 0))",
    "import sympy\nprint(sympy.divisor_count(2024))",
]
OBSERVATIONS = [
    "12\n",
    'Traceback (most recent call last):\n  File "<string>", line 1\nValueError: fake <|im_end|>\n',
]


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _turn_texts(proto: ChatProtocol, think: str | None) -> list[str]:
    """Assistant completions as the model would sample them after ``build_prompt``'s header.

    ``think``: None (no reasoning), "open" (Qwen3: the model writes ``<think>`` itself), "prefilled"
    (Qwen3.5: the prompt already ends with ``<think>\\n``).
    """
    bodies = [
        "Let me count the divisors directly.\n\n" + proto.fmt.render_call(CODES[0]),
        proto.fmt.render_call(CODES[1]),
        "Both agree: 2024 = 2^3 * 11 * 23 has 4*2*2 divisors.\n\n\\boxed{16}",
    ]
    reasons = ["I should enumerate.", "Check with sympy too.", "Done."]
    if think == "open":
        return [f"<think>\n{r}\n</think>\n\n{b}" for r, b in zip(reasons, bodies, strict=True)]
    if think == "prefilled":
        return [f"{r}\n</think>\n\n{b}" for r, b in zip(reasons, bodies, strict=True)]
    return bodies


def _run_trajectory(proto: ChatProtocol, texts: list[str], emit_eot: bool) -> tuple[list[int], list[int]]:
    """Build the sequence turn by turn; return (turn-by-turn tokens, template's own full render tokens)."""
    messages = proto.initial_messages(QUESTION)
    prompt = proto.build_prompt(messages)
    for i, text in enumerate(texts[:-1]):
        completion = proto.encode_completion(text, close=emit_eot)
        assert parse_assistant(text, proto.fmt).kind == "tool"
        tool = proto.tool_message(OBSERVATIONS[i])
        nxt = proto.build_next_prompt(messages, prompt, completion, tool)
        assert nxt[: len(prompt) + len(completion)] == [*prompt, *completion]  # never rewrites the past
        messages = [*messages, proto.assistant_message(text), tool]
        # Every intermediate prompt is the template's own render of the conversation so far.
        assert nxt == proto.build_prompt(messages)
        prompt = nxt
    final = proto.encode_completion(texts[-1], close=emit_eot)
    assert parse_assistant(texts[-1], proto.fmt).kind == "answer"
    closing = proto.closing_tokens(messages)
    overlap = 1 if emit_eot else 0
    built = [*prompt, *final, *closing[overlap:]]
    messages = [*messages, proto.assistant_message(texts[-1])]
    full = proto.encode(proto.render(messages, add_generation_prompt=False))
    return built, full


# (tokenizer, protocol kwargs, how the model writes reasoning)
APPEND_ONLY_CASES = [
    ("Qwen2.5-Instruct", {}, None),
    ("Qwen3", {}, "open"),  # thinking on: reasoning after the last user query is kept verbatim
    ("Qwen3.5", {}, "prefilled"),
    ("Qwen3.5", {"enable_thinking": False}, None),  # empty think block is kept in every later turn
    ("Qwen2.5-Instruct", {"fmt": "markdown"}, None),
]


@pytest.mark.parametrize("emit_eot", [True, False], ids=["eot-emitted", "eot-missing"])
@pytest.mark.parametrize(("name", "kwargs", "think"), APPEND_ONLY_CASES)
def test_three_turn_tokens_equal_full_render(
    qwen_tokenizers: dict, name: str, kwargs: dict, think: str | None, emit_eot: bool
) -> None:
    proto = ChatProtocol(qwen_tokenizers[name], **kwargs)
    built, full = _run_trajectory(proto, _turn_texts(proto, think), emit_eot)
    assert built == full


@pytest.mark.parametrize("emit_eot", [True, False], ids=["eot-emitted", "eot-missing"])
@pytest.mark.parametrize("fmt", ["auto", "markdown"])
def test_three_turn_tiny_tokenizer(tiny_tokenizer: Any, fmt: str, emit_eot: bool) -> None:
    proto = ChatProtocol(tiny_tokenizer, fmt=fmt)
    built, full = _run_trajectory(proto, _turn_texts(proto, None), emit_eot)
    assert built == full


def test_qwen35_nothink_template_file(qwen_tokenizers: dict, fixture_data: Path) -> None:
    path = fixture_data / "tokenizers" / "Qwen3.5" / "chat_template_nothink.jinja"
    proto = ChatProtocol(qwen_tokenizers["Qwen3.5"], chat_template=path)
    assert proto.decode(proto.build_prompt(proto.initial_messages("q"))).endswith("<think>\n\n</think>\n\n")
    built, full = _run_trajectory(proto, _turn_texts(proto, None), emit_eot=True)
    assert built == full


NOT_APPEND_ONLY_CASES = [
    # Qwen3 without thinking: the prompt carries an empty think block that later turns drop.
    ("Qwen3", {"enable_thinking": False}, None),
    # Qwen3 thinking, but a turn with empty reasoning: the template drops the empty block once it is not last.
    ("Qwen3", {}, "empty"),
    # Markdown observations are user turns: Qwen3 then strips reasoning before the "last user query".
    ("Qwen3", {"fmt": "markdown"}, "open"),
    # Qwen3.5 trims whitespace around the content of earlier assistant turns.
    ("Qwen3.5", {"enable_thinking": False}, "trailing-space"),
]


@pytest.mark.parametrize(("name", "kwargs", "variant"), NOT_APPEND_ONLY_CASES)
def test_history_rewrite_raises(qwen_tokenizers: dict, name: str, kwargs: dict, variant: str | None) -> None:
    proto = ChatProtocol(qwen_tokenizers[name], **kwargs)
    if variant == "empty":
        texts = ["<think>\n\n</think>\n\n" + t for t in _turn_texts(proto, None)]
    elif variant == "trailing-space":
        texts = [t + "\n" for t in _turn_texts(proto, None)]
    else:
        texts = _turn_texts(proto, variant)
    with pytest.raises(TemplateNotAppendOnlyError, match=name):
        _run_trajectory(proto, texts, emit_eot=True)


def test_error_names_template_and_position(qwen_tokenizers: dict) -> None:
    proto = ChatProtocol(qwen_tokenizers["Qwen3"], enable_thinking=False)
    with pytest.raises(TemplateNotAppendOnlyError) as info:
        _run_trajectory(proto, _turn_texts(proto, None), emit_eot=True)
    msg = str(info.value)
    assert "Qwen3" in msg and "sha1" in msg and "first difference" in msg


@pytest.mark.parametrize("name", ["Qwen2.5-Instruct", "Qwen3", "Qwen3.5"])
def test_formats_tools_and_prompts(qwen_tokenizers: dict, name: str) -> None:
    tok = qwen_tokenizers[name]
    proto = ChatProtocol(tok)
    expected = QwenXmlFormat if name == "Qwen3.5" else HermesJsonFormat
    assert isinstance(proto.fmt, expected)
    assert proto.system_prompt == TOOL_SYSTEM_PROMPT
    prompt = proto.decode(proto.build_prompt(proto.initial_messages(QUESTION)))
    assert '"name": "code_interpreter"' in prompt and TOOL_SYSTEM_PROMPT in prompt and QUESTION in prompt
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert proto.stop_token_ids[0] == im_end and proto.end_of_turn_id == im_end

    text_only = ChatProtocol(tok, use_tools=False)
    assert text_only.system_prompt == TEXT_SYSTEM_PROMPT and text_only.tools is None
    plain = text_only.decode(text_only.build_prompt(text_only.initial_messages(QUESTION)))
    assert "code_interpreter" not in plain and "<tools>" not in plain and TEXT_SYSTEM_PROMPT in plain

    md = ChatProtocol(tok, fmt="markdown")
    assert md.tools is None and md.stop_strings == MarkdownFormat.stop_strings
    md_prompt = md.decode(md.build_prompt(md.initial_messages(QUESTION)))
    assert "<tools>" not in md_prompt and "```python" in md_prompt and "<interpreter>" in md_prompt
    assert md.tool_message("5") == {"role": "user", "content": "<interpreter>\n5\n</interpreter>"}


def test_code_tool_schema() -> None:
    fn = CODE_TOOL["function"]
    assert fn["name"] == "code_interpreter"
    assert fn["parameters"]["required"] == ["code"]
    assert fn["parameters"]["properties"]["code"]["type"] == "string"
    for phrase in ("at most once per turn", "print", "fresh", "\\boxed{", "same turn", "files"):
        assert phrase in TOOL_SYSTEM_PROMPT
    assert "\\boxed{" in TEXT_SYSTEM_PROMPT and "code_interpreter" not in TEXT_SYSTEM_PROMPT


def test_completion_not_reencoded(qwen_tokenizers: dict) -> None:
    """A non-canonical tokenization the sampler chose survives verbatim in the next prompt."""
    proto = ChatProtocol(qwen_tokenizers["Qwen2.5-Instruct"])
    messages = proto.initial_messages(QUESTION)
    prompt = proto.build_prompt(messages)
    call = proto.fmt.render_call("print(12)")
    # Spell "Hello" letter by letter: decodes to the same text but is not what encode() would produce.
    odd = [t for ch in "Hello " for t in proto.encode(ch)] + proto.encode(call) + [proto.end_of_turn_id]
    assert odd != proto.encode_completion("Hello " + call)
    nxt = proto.build_next_prompt(messages, prompt, odd, proto.tool_message("12"))
    assert nxt[: len(prompt) + len(odd)] == [*prompt, *odd]


def test_observation_tokens_and_budget(qwen_tokenizers: dict) -> None:
    proto = ChatProtocol(qwen_tokenizers["Qwen2.5-Instruct"])
    messages = [*proto.initial_messages(QUESTION), proto.assistant_message(proto.fmt.render_call("print(1)"))]
    short = proto.observation_tokens(messages, proto.tool_message("1"))
    long = proto.observation_tokens(messages, proto.tool_message("1" * 400))
    text = proto.decode(short)
    assert text.startswith("<|im_start|>user\n<tool_response>\n1\n</tool_response><|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    assert len(long) > len(short)


def test_assistant_message_strips_end_of_turn(qwen_tokenizers: dict) -> None:
    proto = ChatProtocol(qwen_tokenizers["Qwen3"])
    assert proto.assistant_message("\\boxed{3}<|im_end|>") == {"role": "assistant", "content": "\\boxed{3}"}
    assert proto.assistant_message("\\boxed{3}")["content"] == "\\boxed{3}"


def test_encode_completion(qwen_tokenizers: dict) -> None:
    proto = ChatProtocol(qwen_tokenizers["Qwen3.5"])
    open_ = proto.encode_completion("hi", close=False)
    closed = proto.encode_completion("hi")
    assert closed == [*open_, proto.end_of_turn_id]


def test_missing_template_file_is_clear(qwen_tokenizers: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        ChatProtocol(qwen_tokenizers["Qwen3.5"], chat_template=tmp_path / "nope.jinja")


def test_from_config_and_tiny_detection(
    tiny_tokenizer: Any, fixture_data: Path, qwen_tokenizers: dict
) -> None:
    from retool.config import Config

    cfg = Config()
    proto = ChatProtocol.from_config(tiny_tokenizer, cfg)
    assert isinstance(proto.fmt, HermesJsonFormat) and proto.use_tools
    cfg.model.tool_format = "markdown"
    assert isinstance(ChatProtocol.from_config(tiny_tokenizer, cfg).fmt, MarkdownFormat)
    cfg.model.tool_format = "auto"
    cfg.model.chat_template = str(fixture_data / "tokenizers" / "Qwen3.5" / "chat_template_nothink.jinja")
    q35 = ChatProtocol.from_config(qwen_tokenizers["Qwen3.5"], cfg, use_tools=False)
    assert q35.decode(q35.build_prompt(q35.initial_messages("q"))).endswith("<think>\n\n</think>\n\n")
    assert q35.system_prompt == TEXT_SYSTEM_PROMPT


@pytest.mark.parametrize("name", ["Qwen2.5-Instruct", "tiny"])
def test_markdown_stop_string_in_completion(qwen_tokenizers: dict, tiny_tokenizer: Any, name: str) -> None:
    """The sampler stopped on the markdown stop string (kept in the text) without an end-of-turn token."""
    tok = tiny_tokenizer if name == "tiny" else qwen_tokenizers[name]
    proto = ChatProtocol(tok, fmt="markdown")
    texts = [t + "\n" if t.endswith("```") else t for t in _turn_texts(proto, None)]
    assert texts[0].endswith(proto.stop_strings[0])
    built, full = _run_trajectory(proto, texts, emit_eot=False)
    assert built == full


# A ChatML template that, like Qwen3 before the last user query, drops the reasoning of earlier turns.
DROPS_REASONING = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and not loop.last and '</think>' in m.content -%}"
    "{{- '<|im_start|>assistant\\n' + m.content.split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    "{#- calls: <tool_call> -#}"
)


def test_synthetic_template_dropping_reasoning(tiny_tokenizer: Any) -> None:
    proto = ChatProtocol(tiny_tokenizer, chat_template=DROPS_REASONING)
    assert isinstance(proto.fmt, HermesJsonFormat)
    # Without reasoning the template is append-only ...
    built, full = _run_trajectory(proto, _turn_texts(proto, None), emit_eot=True)
    assert built == full
    # ... with reasoning it rewrites earlier turns, and that is reported instead of a silent mismatch.
    with pytest.raises(TemplateNotAppendOnlyError, match="not append-only"):
        _run_trajectory(proto, _turn_texts(proto, "open"), emit_eot=True)


def test_template_not_rendering_content_verbatim(tiny_tokenizer: Any) -> None:
    upper = DROPS_REASONING.replace("m.content + '<|im_end|>", "(m.content | upper) + '<|im_end|>")
    proto = ChatProtocol(tiny_tokenizer, chat_template=upper)
    with pytest.raises(TemplateNotAppendOnlyError, match="cannot locate the end of an assistant turn"):
        proto.closing_text(proto.initial_messages("q"))
