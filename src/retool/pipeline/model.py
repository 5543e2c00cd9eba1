"""The demo's tiny model: ``build_tiny_model`` fed with task text, plus the fixed prompt blocks as phrases.

The system prompt and the rendered tool schema are identical in every sequence; as ordinary BPE text
they cost ~300 tokens per sequence, several times the problem itself. Here each fixed block becomes one
added token (the text is unchanged; only its tokenisation is shorter), so the tiny model's compute goes
to the question, the code and the answer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from retool.backends.local.tinymodel import ModelSize, build_tiny_model, build_tokenizer
from retool.data.synthetic import Task
from retool.protocol import ChatProtocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_SYSTEM_OPEN = "<|im_start|>system\n"
_TURN_END = "<|im_end|>"


def protocol_for(
    tokenizer: PreTrainedTokenizerBase, use_tools: bool = True, system_prompt: str = "full"
) -> ChatProtocol:
    """The demo's ``retool.protocol.ChatProtocol``: the call format detected from the chat template
    (Hermes for the tiny model, markdown for templates without tools such as SmolLM2's)."""
    return ChatProtocol(tokenizer, fmt="auto", use_tools=use_tools, system_prompt=system_prompt)


def fixed_prompt_blocks(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The system blocks (prompt + tool schema) of both modes, exactly as the chat template renders them."""
    blocks = []
    for use_tools in (True, False):
        text = protocol_for(tokenizer, use_tools).render(
            protocol_for(tokenizer, use_tools).initial_messages("Q"), True
        )
        if not text.startswith(_SYSTEM_OPEN) or _TURN_END not in text:
            raise ValueError("tiny chat template does not render a ChatML system block")
        blocks.append(text[len(_SYSTEM_OPEN) : text.index(_TURN_END)])
    return blocks


_CODE_PLACEHOLDER = "print(12345)"


def call_phrases(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The fixed text around the code of one tool call, as the protocol's call format renders it.

    In the Hermes format that is ``<tool_call>\\n{"name": "code_interpreter", "arguments": {"code": "``
    and ``"}}\\n</tool_call>``: ~40 BPE tokens around every call, identical each time. As two phrase
    tokens the question's numbers and their copy in the code sit a few tokens apart, not dozens.
    """
    fmt = protocol_for(tokenizer, True).fmt
    text = fmt.render_call(_CODE_PLACEHOLDER)
    head, sep, tail = text.partition(_CODE_PLACEHOLDER)
    if not sep:
        raise ValueError(f"the {fmt.name} call format does not carry code verbatim")
    return [p for p in (head, tail) if p.strip()]


def task_texts(tasks: Sequence[Task]) -> list[str]:
    """What of a generated task the tiny tokenizer learns: its question, canonical code as the call JSON
    shows it, and answer."""
    return [f"{t.question}\n{json.dumps({'code': t.code})}\n\\boxed{{{t.answer}}}" for t in tasks]


def tokenizer_corpus(texts: Sequence[str]) -> list[str]:
    """``texts`` and the fixed text every conversation carries: ChatML role names and tool tags, so the
    headers the model reads every turn are short, and a traceback's frame lines."""
    corpus = list(texts)
    corpus += ["system\nuser\nassistant\ntool\n<tool_response>\n</tool_response>\n"] * 20
    corpus.append(
        "Traceback (most recent call last):\n  File \"<string>\", line 1, in <module>\nNameError: name 'x' is not defined"
    )
    return corpus


def build_demo_model(
    out_dir: str | Path, texts: Sequence[str], *, size: ModelSize = "demo", seed: int = 0
) -> Path:
    """Tokenizer trained on ``texts`` (a recipe's ``HeldOut.texts``: ``task_texts`` of its train tasks),
    fixed prompt blocks as phrases, random Qwen2 weights."""
    corpus = tokenizer_corpus(texts)
    probe = build_tokenizer(corpus[:200], vocab_size=512)
    phrases = fixed_prompt_blocks(probe) + call_phrases(probe)
    logger.info(
        "tiny model: %d corpus texts, %d fixed text blocks as phrase tokens", len(corpus), len(phrases)
    )
    return build_tiny_model(out_dir, corpus=corpus, size=size, seed=seed, phrase_tokens=phrases)
