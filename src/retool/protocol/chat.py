"""Binding a tokenizer's chat template to the tool protocol, with exact token continuity (chapter 8.4.3).

Owns ``ChatProtocol``: prompts, messages, and the placeholder method that builds the next turn's prompt
as ``previous prompt + sampled completion tokens + the template's end-of-assistant tokens the sampler did
not emit + observation tokens + next assistant header``. Sampled tokens are never re-encoded.

How the pieces are located:
- the end-of-assistant ("closing") text comes from rendering the conversation with a one-character
  placeholder assistant message twice (``x`` and ``y``): everything after the single differing
  character is the closing, whatever the template puts before the content (e.g. an empty think block);
- the observation is what the template renders after ``history + actual assistant turn + closing``
  once the tool message is added.

Append-only check: the template's own render of the *actual* conversation (the assistant content is the
decoded completion, used for checking only) must begin with exactly the text of the tokens we already
have. Templates that rewrite earlier turns -- Qwen3 drops an empty ``<think></think>`` from non-final
turns and strips reasoning before the last user query, Qwen3.5 trims whitespace -- fail loudly with
``TemplateNotAppendOnlyError`` instead of silently training on a sequence the sampler never saw.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from retool.config import Config, ModelConfig
from retool.protocol.formats import ToolFormat, get_format
from retool.protocol.prompts import CODE_TOOL, system_prompt_text
from retool.protocol.sanitize import sanitize_tool_content

logger = logging.getLogger(__name__)

Message = dict[str, Any]
PLACEHOLDERS = ("x", "y")
CUT_MARKER = "[... {n} characters cut ...]\n"


class TemplateNotAppendOnlyError(ValueError):
    """The chat template re-renders earlier history, so turn-by-turn tokens cannot match its output."""


def _suffix_prefix_overlap(seq: Sequence[int], closing: Sequence[int]) -> int:
    """Largest k such that the last k tokens of ``seq`` equal the first k tokens of ``closing``."""
    for k in range(min(len(seq), len(closing)), 0, -1):
        if list(seq[-k:]) == list(closing[:k]):
            return k
    return 0


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the common prefix, by bisection on slice equality (C-speed compares, not a char loop)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _context(text: str, at: int, width: int = 60) -> str:
    return repr(text[max(0, at - width) : at + width])


class ChatProtocol:
    """A tokenizer + tool-call format + system prompt, and the token bookkeeping of a multi-turn rollout.

    ``enable_thinking`` (None = the template's default) is passed to templates that read it (Qwen3,
    Qwen3.5). ``chat_template`` overrides the tokenizer's template (template text or a path to a
    ``.jinja`` file, e.g. Qwen3.5's ``chat_template_nothink.jinja``). ``system_prompt`` picks the wording
    of the system prompt: ``full`` (the chapter's) or ``compact`` (the same rules, shorter). ``examples``:
    worked conversations (few-shot turns) placed between the system prompt and the question
    (``with_examples``: a cold start that samples the model's own attempts under a prompt it will not be
    trained with).
    """

    def __init__(
        self,
        tokenizer: Any,
        fmt: str | ToolFormat = "auto",
        use_tools: bool = True,
        *,
        enable_thinking: bool | None = None,
        chat_template: str | os.PathLike[str] | None = None,
        system_prompt: str = "full",
        examples: Sequence[Message] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt_style = system_prompt
        self.examples: tuple[Message, ...] = tuple(examples)
        self.chat_template = _load_template(chat_template)
        template_text = self.chat_template or getattr(tokenizer, "chat_template", None)
        if not template_text:
            raise ValueError(
                f"tokenizer {self._model_name(tokenizer)} has no chat template; pass chat_template="
            )
        self.fmt: ToolFormat = get_format(fmt, _TemplateView(template_text) if fmt == "auto" else None)
        self.use_tools = use_tools
        self.enable_thinking = enable_thinking
        system_prompt_text(use_tools, True, system_prompt)  # an unknown style fails here, not mid-rollout
        # The markdown format has no native tools: registering the schema would make the template teach
        # its own (different) call syntax.
        self.tools: list[dict[str, Any]] | None = (
            [CODE_TOOL] if use_tools and self.fmt.uses_native_tools else None
        )
        digest = hashlib.sha1(str(template_text).encode()).hexdigest()[:12]
        self.template_name = f"{self._model_name(tokenizer)} (chat template sha1 {digest})"
        self._end_of_turn_id: int | None = None
        self._closing_cache: dict[tuple[str, ...], str] = {}

    @classmethod
    def from_config(
        cls, tokenizer: Any, config: Config | ModelConfig, use_tools: bool = True
    ) -> ChatProtocol:
        """Build from a ``retool.config.Config`` (its ``model`` section: tool_format, enable_thinking,
        chat_template)."""
        model = config.model if isinstance(config, Config) else config
        return cls(
            tokenizer,
            fmt=model.tool_format,
            use_tools=use_tools,
            enable_thinking=model.enable_thinking,
            chat_template=model.chat_template,
            system_prompt=model.system_prompt,
        )

    def with_tools(self, use_tools: bool) -> ChatProtocol:
        """The same tokenizer, template, format and thinking setting, with the tool on or off (the two
        eval modes of one model differ only in this)."""
        if use_tools == self.use_tools:
            return self
        return ChatProtocol(
            self.tokenizer,
            self.fmt,
            use_tools,
            enable_thinking=self.enable_thinking,
            chat_template=self.chat_template,
            system_prompt=self.prompt_style,
            examples=self.examples,
        )

    def with_examples(self, examples: Sequence[Message]) -> ChatProtocol:
        """The same protocol with ``examples`` (few-shot turns) before every question; ``()``: none."""
        return ChatProtocol(
            self.tokenizer,
            self.fmt,
            self.use_tools,
            enable_thinking=self.enable_thinking,
            chat_template=self.chat_template,
            system_prompt=self.prompt_style,
            examples=examples,
        )

    @staticmethod
    def _model_name(tokenizer: object) -> str:
        return repr(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)

    # -- messages ----------------------------------------------------------------------------------
    @property
    def system_prompt(self) -> str:
        return system_prompt_text(self.use_tools, self.fmt.uses_native_tools, self.prompt_style)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self.fmt.stop_strings if self.use_tools else ()

    def initial_messages(self, question: str) -> list[Message]:
        return [
            {"role": "system", "content": self.system_prompt},
            *self.examples,
            {"role": "user", "content": question},
        ]

    def assistant_message(self, text: str) -> Message:
        """The assistant turn as a message; a trailing end-of-turn token string the sampler emitted is dropped."""
        enders = [s for s in (self._token_str(i) for i in self.stop_token_ids) if s]
        stripped = True
        while stripped:
            stripped = False
            for s in enders:
                if text.endswith(s):
                    text, stripped = text[: -len(s)], True
        return {"role": "assistant", "content": text}

    def tool_message(self, content: str) -> Message:
        """The observation message (sanitised). Markdown format: a user message wrapped in <interpreter>."""
        safe = sanitize_tool_content(content, self.tokenizer, extra=self.fmt.observation_guards)
        if self.fmt.uses_native_tools:
            return {"role": "tool", "content": safe}
        return {"role": "user", "content": f"<interpreter>\n{safe}\n</interpreter>"}

    # -- rendering ---------------------------------------------------------------------------------
    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {}
        if self.enable_thinking is not None:
            kwargs["enable_thinking"] = self.enable_thinking
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        text = self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        if not isinstance(text, str):  # transformers returns a list for batched input only
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(
            list(tokens), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def build_prompt(self, messages: Sequence[Message]) -> list[int]:
        """Tokens of ``messages`` with the next assistant header appended (tools registered iff use_tools)."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    # -- end of turn -------------------------------------------------------------------------------
    def _token_str(self, token_id: int) -> str | None:
        tok = self.tokenizer.convert_ids_to_tokens(int(token_id))
        return tok if isinstance(tok, str) else None

    def closing_text(self, messages_before_assistant: Sequence[Message]) -> str:
        """What the template writes after an assistant turn's content (placeholder method).

        Cached per sequence of roles: the closing does not depend on message contents in any sane
        template, and this saves two renders per turn.
        """
        key = tuple(str(m.get("role")) for m in messages_before_assistant)
        cached = self._closing_cache.get(key)
        if cached is not None:
            return cached
        closing = self._closing_text_uncached(messages_before_assistant)
        if len(self._closing_cache) >= 256:
            self._closing_cache.clear()
        self._closing_cache[key] = closing
        return closing

    def _closing_text_uncached(self, messages_before_assistant: Sequence[Message]) -> str:
        renders = [
            self.render(
                [*messages_before_assistant, {"role": "assistant", "content": p}], add_generation_prompt=False
            )
            for p in PLACEHOLDERS
        ]
        a, b = renders
        i = _common_prefix_len(a, b)
        if len(a) != len(b) or i >= len(a) or a[i + 1 :] != b[i + 1 :] or a[i] != PLACEHOLDERS[0]:
            raise TemplateNotAppendOnlyError(
                f"cannot locate the end of an assistant turn in the chat template of {self.template_name}: "
                "the assistant content is not rendered verbatim"
            )
        return a[i + 1 :]

    def closing_tokens(self, messages_before_assistant: Sequence[Message]) -> list[int]:
        return self.encode(self.closing_text(messages_before_assistant))

    @property
    def end_of_turn_id(self) -> int:
        """The token that ends an assistant turn (``<|im_end|>`` for ChatML), from the template itself."""
        if self._end_of_turn_id is None:
            closing = self.closing_tokens(self.initial_messages("1+1?"))
            special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
            if closing and closing[0] in special:
                self._end_of_turn_id = closing[0]
            elif getattr(self.tokenizer, "eos_token_id", None) is not None:
                self._end_of_turn_id = int(self.tokenizer.eos_token_id)
            else:
                raise ValueError(f"cannot tell the end-of-turn token of {self.template_name}")
        return self._end_of_turn_id

    @property
    def stop_token_ids(self) -> list[int]:
        ids = [self.end_of_turn_id]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None and int(eos) not in ids:
            ids.append(int(eos))
        return ids

    # -- continuity ----------------------------------------------------------------------------------
    def build_next_prompt(
        self,
        messages_before_assistant: Sequence[Message],
        previous_prompt_tokens: Sequence[int],
        completion_tokens: Sequence[int],
        tool_message: Message,
    ) -> list[int]:
        """Next turn's prompt: previous prompt + completion + missing closing + observation + header.

        ``messages_before_assistant`` are the messages ``previous_prompt_tokens`` was built from.
        Raises ``TemplateNotAppendOnlyError`` when the template's render of the real conversation does
        not begin with the tokens we already have.
        """
        closing = self.closing_tokens(messages_before_assistant)
        overlap = _suffix_prefix_overlap(completion_tokens, closing)
        head = [*previous_prompt_tokens, *completion_tokens, *closing[overlap:]]
        # Decoded only to *check* the template; the sequence itself keeps the sampled tokens.
        content = self.decode(list(completion_tokens)[: len(completion_tokens) - overlap])
        assistant = self.assistant_message(content)
        full_text = self.render(
            [*messages_before_assistant, assistant, tool_message], add_generation_prompt=True
        )
        head_text = self.decode(head)
        if not full_text.startswith(head_text):
            at = _common_prefix_len(full_text, head_text)
            raise TemplateNotAppendOnlyError(
                f"the chat template of {self.template_name} is not append-only: adding the tool observation "
                f"re-renders earlier history (first difference at char {at}: template has {_context(full_text, at)}, "
                f"the running token sequence has {_context(head_text, at)}). Turn-by-turn tokens would not match "
                "what the template produces. Qwen3-style templates rewrite reasoning of earlier turns; try "
                "another enable_thinking setting or a template that keeps history verbatim."
            )
        return [*head, *self._tail_tokens(closing[overlap:], full_text[len(head_text) :])]

    def _tail_tokens(self, closing_rest: list[int], observation_text: str) -> list[int]:
        """Encode the observation so that it tokenizes as it would inside the whole render."""
        obs = self.encode(observation_text)
        if closing_rest:
            joint = self.encode(self.decode(closing_rest) + observation_text)
            if joint != [*closing_rest, *obs]:
                if joint[: len(closing_rest)] != closing_rest:
                    raise TemplateNotAppendOnlyError(
                        f"the end-of-turn tokens of {self.template_name} merge with the observation's tokens"
                    )
                obs = joint[len(closing_rest) :]
        return obs

    def observation_tokens(
        self, messages_with_assistant: Sequence[Message], tool_message: Message
    ) -> list[int]:
        """Tokens the observation adds after the finished assistant turn (wrapper + content + next header)."""
        base = self.render(messages_with_assistant, add_generation_prompt=False)
        full = self.render([*messages_with_assistant, tool_message], add_generation_prompt=True)
        if not full.startswith(base):
            at = _common_prefix_len(full, base)
            raise TemplateNotAppendOnlyError(
                f"the chat template of {self.template_name} is not append-only: adding the tool observation "
                f"re-renders earlier history (first difference at char {at}: {_context(full, at)} vs {_context(base, at)})"
            )
        return self.encode(full[len(base) :])

    def fit_observation(self, text: str, max_tokens: int) -> str:
        """Sanitised ``text`` cut from the front to at most ``max_tokens`` tokens, the cut marked.

        The tail is kept because a traceback's last line and a final printed result are at the end.
        Cost: a few encodes of about ``max_tokens`` tokens, whatever the length of ``text``.
        """
        if max_tokens <= 0:
            return ""
        text = sanitize_tool_content(text, self.tokenizer, extra=self.fmt.observation_guards)
        n = len(text)

        def candidate(start: int) -> str:
            return CUT_MARKER.format(n=start) + text[start:]

        def fits(start: int) -> bool:
            return len(self.encode(candidate(start))) <= max_tokens

        # Encode only a tail window big enough to hold more than the budget (a token covers few chars).
        window = min(n, max(4096, 32 * max_tokens))
        offsets = self._offsets(text[n - window :])
        while offsets is not None and len(offsets) <= max_tokens and window < n:
            window = min(n, window * 4)
            offsets = self._offsets(text[n - window :])
        if offsets is None:  # slow tokenizer: no offsets
            if len(self.encode(text)) <= max_tokens:
                return text
        elif window == n and len(offsets) <= max_tokens:
            return text
        if not fits(n):
            return self._bare_tail(text, max_tokens)  # even the marker alone is too long
        start = None
        if offsets is not None:
            keep = max_tokens - len(self.encode(CUT_MARKER.format(n=n)))
            # Cut at the token boundary that leaves `keep` tokens; the cut may re-tokenize a little
            # differently, so step a token at a time until it fits.
            for k in range(keep, max(0, keep - 8), -1):
                cut = n - window + int(offsets[len(offsets) - k][0])
                if 0 < cut < n and fits(cut):
                    start = cut
                    break
        if start is None:  # smallest fitting start by bisection (hi always fits)
            lo, hi = 1, n
            while lo < hi:
                mid = (lo + hi) // 2
                if fits(mid):
                    hi = mid
                else:
                    lo = mid + 1
            start = lo
        # Start at a line boundary when one is close, so the kept tail reads cleanly.
        nl = text.find("\n", start, start + 100)
        if 0 <= nl < n - 1 and fits(nl + 1):
            start = nl + 1
        return candidate(start)

    def _bare_tail(self, text: str, max_tokens: int) -> str:
        lo, hi = max(0, len(text) - 16 * max_tokens - 64), len(text)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.encode(text[mid:])) <= max_tokens:
                hi = mid
            else:
                lo = mid + 1
        return text[lo:]

    def _offsets(self, text: str) -> list[tuple[int, int]] | None:
        """Char offsets of ``text``'s tokens (fast tokenizers), or None when unavailable."""
        try:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            return list(enc["offset_mapping"])
        except (NotImplementedError, TypeError, ValueError, KeyError):
            return None

    def encode_completion(self, text: str, close: bool = True) -> list[int]:
        """Tokens a model would emit for ``text`` (plus the end-of-turn token if ``close``); for SFT."""
        tokens = self.encode(text)
        return [*tokens, self.end_of_turn_id] if close else tokens


class _TemplateView:
    """Lets ``detect_format`` read an overriding template as if it were the tokenizer's."""

    def __init__(self, chat_template: str) -> None:
        self.chat_template = chat_template


def _load_template(chat_template: str | os.PathLike[str] | None) -> str | None:
    if chat_template is None:
        return None
    looks_like_path = (
        isinstance(chat_template, str)
        and "{" not in chat_template
        and (chat_template.endswith(".jinja") or Path(chat_template).is_file())
    )
    if isinstance(chat_template, os.PathLike) or looks_like_path:
        path = Path(chat_template)
        if not path.is_file():
            raise ValueError(f"chat template file not found: {path}")
        return path.read_text()
    return str(chat_template)
