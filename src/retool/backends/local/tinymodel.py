"""Build a tiny chat model locally: a byte-level BPE tokenizer trained on given text, a ChatML chat
template with Hermes-style tool calls (written here), and a randomly initialised Qwen2 causal LM.

The result is an ordinary Hugging Face folder that every command accepts as ``--model``. Nothing is
downloaded. Tests use ``size="test"`` (well under a second to build); the demo uses ``size="demo"``; tests of external
engines use ``size="engine"`` (head size 32, the smallest vLLM's CPU build runs).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

# ChatML with Hermes JSON tool calls, in the shape of Qwen2.5's template so that the same protocol code
# drives it. Shorter tool preamble than Qwen's: the tiny model's context is small.
TINY_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}{%- set system = 'You are a helpful assistant.' -%}{%- set rest = messages -%}{%- endif -%}"
    "{{- '<|im_start|>system\\n' + system -}}"
    "{%- if tools -%}"
    "{{- '\\n\\n# Tools\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    '{{- \'\\n</tools>\\nCall a tool with a JSON object {"name": <name>, "arguments": <json>} between tool_call tags.\' -}}'
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- for message in rest -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- if loop.first or rest[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or rest[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "{{- '<|im_start|>assistant' -}}"
    "{%- if message['content'] -%}{{- '\\n' + message['content'] -}}{%- endif -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set call = call['function'] if call['function'] is defined else call -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' + (call['arguments'] | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added (non-special) tokens, as in Qwen: the model emits them as single tokens.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

ModelSize = Literal["test", "demo", "engine"]
_SIZES: dict[str, dict[str, int]] = {
    "test": {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 512,
    },
    # Two layers: the smallest depth that forms induction (copy) heads, and they form within ~1k SFT steps;
    # a third layer delayed copying past the demo's time budget in measurements. Eight heads of 16
    # dimensions with their own keys and values: copying multi-digit numbers (question -> code,
    # interpreter output -> answer) is learned more reliably than with 4 query heads sharing 2 key/value
    # heads (measured on held-out hard problems after 1500 SFT steps, seed 1: 59% of tool answers right
    # against 10%; at about the same cost per step).
    "demo": {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "intermediate_size": 384,
        "vocab_size": 512,
    },
    # The smallest model external engines run: vLLM's CPU attention takes head sizes 32-512 only (the demo's
    # 16 is refused), so tests of the vLLM sampler use four heads of 32.
    "engine": {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
        "vocab_size": 512,
    },
}


def _default_corpus() -> list[str]:
    digits = " ".join(str(i) for i in range(1000))
    return [
        "Solve the problem. Use the code_interpreter tool when computation helps. \\boxed{42}",
        "print(sum(range(10)))\nimport sympy\nfrom math import gcd\nfor i in range(5):\n    print(i * i)",
        '{"name": "code_interpreter", "arguments": {"code": "print(2**10)"}}',
        "Traceback (most recent call last):\n  File \"<string>\", line 1\nNameError: name 'x' is not defined",
        digits,
    ]


def build_tokenizer(
    corpus: Iterable[str] | None = None, vocab_size: int = 2048, phrase_tokens: Iterable[str] = ()
):
    """Train a byte-level BPE tokenizer on ``corpus`` and wrap it as a transformers fast tokenizer.

    ``phrase_tokens`` become single added (non-special) tokens, e.g. the fixed system prompts: a tiny
    model's context and compute then go to the problem, not to a paragraph it sees in every sequence.
    """
    # deferred: tokenizers and transformers (~3 s), to build the model only
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(corpus) if corpus is not None else _default_corpus()
    tok = Tokenizer(models.BPE())
    # Digits are single tokens so the model can copy numbers digit by digit (question -> code -> box).
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + ADDED_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    phrases = [p for p in phrase_tokens if p]
    if phrases:
        tok.add_tokens([AddedToken(p, normalized=False) for p in phrases])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=4096,
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def build_tiny_model(
    out_dir: str | Path,
    corpus: Iterable[str] | None = None,
    size: ModelSize = "test",
    seed: int = 0,
    max_position_embeddings: int = 4096,
    phrase_tokens: Iterable[str] = (),
) -> Path:
    """Write tokenizer + randomly initialised Qwen2 model to ``out_dir``; return the folder."""
    import torch  # deferred: torch and transformers (~3 s), to build the model only
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dims: dict[str, Any] = dict(_SIZES[size])
    tokenizer = build_tokenizer(corpus, vocab_size=dims.pop("vocab_size"), phrase_tokens=phrase_tokens)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        **dims,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "retool_tiny.json").write_text(json.dumps({"size": size, "seed": seed}) + "\n")
    return out
