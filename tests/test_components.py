"""``build_components``: every command's parts come from the config, in one place."""

from __future__ import annotations

from typing import Any

import pytest

import retool.components
from retool.components import Components, build_components
from retool.config import load_config


class _TemplatedTokenizer:
    name_or_path = "fake"
    chat_template = "{{ messages }}"


CLOSED: list[str] = []


class _Backend:
    tokenizer = _TemplatedTokenizer()

    def close(self) -> None:
        CLOSED.append(type(self).__name__)

    async def close_async(self) -> None:
        self.close()


def test_protocol_and_verifier_follow_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The protocol and verifier take every knob of ``model`` and ``reward``; text-only builds no executor."""
    seen: list[Any] = []
    monkeypatch.setattr(retool.components, "make_training_client", lambda c: seen.append(c) or _Backend())
    cfg = load_config(
        None,
        [
            "model.tool_format='hermes'",
            "model.enable_thinking=false",
            "model.chat_template='{{ custom }}'",
            "reward.verify_workers=1",
            "reward.verify_timeout=2.5",
            "reward.tail_chars=77",
        ],
    )
    with build_components(cfg, tools=False) as parts:
        protocol, verifier = parts.protocol, parts.verifier
        assert (protocol.fmt.name, protocol.enable_thinking, protocol.chat_template, protocol.use_tools) == (
            "hermes",
            False,
            "{{ custom }}",
            False,
        )
        assert (verifier.workers, verifier.timeout, verifier.tail_chars) == (1, 2.5, 77)
        assert parts.executor is None and seen == [cfg]
        tools = parts.for_mode(True)
        assert tools.protocol.use_tools and tools.protocol.fmt is protocol.fmt
        assert tools.protocol.chat_template == protocol.chat_template
        assert parts.for_mode(False).protocol is protocol


def test_a_failed_build_closes_what_it_built(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoTemplate(_Backend):
        tokenizer = object()  # no chat template: the protocol refuses

    monkeypatch.setattr(retool.components, "make_training_client", lambda c: NoTemplate())
    CLOSED.clear()
    with pytest.raises(ValueError, match="no chat template"):
        build_components(load_config(None), tools=False)
    assert CLOSED == ["NoTemplate"]


def test_sampler_refresh_and_mode_views() -> None:
    class Client(_Backend):
        refreshes = 0

        async def sampling_client_async(self) -> str:
            self.refreshes += 1
            return f"sampler-{self.refreshes}"

    import asyncio

    parts = Components(backend=Client(), protocol=_Protocol(), verifier=object(), executor="EXECUTOR")  # type: ignore[arg-type]
    assert asyncio.run(parts.refresh_sampler()) == "sampler-1" == parts.sampler
    text = parts.for_mode(False)
    assert text.executor is None and text.protocol.use_tools is False and text.sampler == "sampler-1"
    assert parts.executor == "EXECUTOR" and parts.protocol.use_tools is True


class _Protocol:
    def __init__(self, use_tools: bool = True) -> None:
        self.use_tools = use_tools

    def with_tools(self, use_tools: bool) -> _Protocol:
        return self if use_tools == self.use_tools else _Protocol(use_tools)
