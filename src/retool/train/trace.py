"""A code-interleaved SFT trace built turn by turn as a rollout builds it (``build_trajectory``): the token
bookkeeping every cold start that writes its own traces shares (the synthetic styles of
``retool.recipes.tiny.styles``, the annotated solutions of ``retool.train.annotated``, the Mathematics
recipe's and expert iteration's verified attempts).

Each trace is built with the same ``ChatProtocol`` calls the RL rollout uses (``build_prompt``,
``encode_completion``, ``build_next_prompt``), so the SFT policy sees exactly the token layout it will act
in; the trace type, its file and the trainer are ``retool.train.sft``'s (``cross_entropy`` on assistant
tokens only: weight 0 on prompt and observation tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from retool.protocol import ChatProtocol
from retool.protocol.chat import Message

# Runs trusted code; returns the observation text the model sees.
Observer = Callable[[str], str]


def answer_text(value: int | str) -> str:
    return f"\\boxed{{{value}}}"


def build_trajectory(
    protocol: ChatProtocol,
    question: str,
    turns: Sequence[tuple[str, str]],
    final_text: str,
    observe: Observer,
    max_observation_tokens: int = 64,
) -> tuple[list[int], list[float], list[Message]]:
    """Tokens, per-token weights and messages of one tool trajectory, built turn by turn as a rollout is.

    ``turns``: (assistant text ending in a call, the call's code), in order; each call's observation is
    ``observe(code)`` trimmed as the rollout trims it; ``final_text`` is the last (answer) turn. Weight 1
    on assistant tokens, 0 on the prompt, the observations and the template's closing tokens.
    """
    messages = protocol.initial_messages(question)
    tokens = protocol.build_prompt(messages)
    weights = [0.0] * len(tokens)
    for text, code in turns:
        completion = protocol.encode_completion(text)
        # Trimmed exactly as the rollout trims it (the traceback's tail survives).
        observation = protocol.fit_observation(observe(code), max_observation_tokens)
        tool_msg = protocol.tool_message(observation)
        next_prompt = protocol.build_next_prompt(messages, tokens, completion, tool_msg)
        weights += [1.0] * len(completion)
        # Observation tokens (and the template's closing tokens the sampler did not emit) carry weight 0.
        weights += [0.0] * (len(next_prompt) - len(tokens) - len(completion))
        tokens = next_prompt
        messages = [*messages, protocol.assistant_message(text), tool_msg]
    final = protocol.encode_completion(final_text)
    messages.append(protocol.assistant_message(final_text))
    return [*tokens, *final], [*weights, *([1.0] * len(final))], messages
