"""The sampler's lean decode forward (``retool.backends.engine.decode_step``): the same tokens and logprobs as the
transformers forward, on the tiny Qwen2 model and on a grouped-query Llama; and the layouts it declines."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from retool.backends.engine.decode_step import lean_decoder
from retool.backends.interface.types import Sample, SamplingParams
from retool.backends.local.client import LocalTrainingClient
from retool.backends.local.tinymodel import build_tokenizer


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gqa_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama with grouped-query attention (4 query heads on 2 key/value heads), like SmolLM2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("gqa_llama")
    tokenizer = build_tokenizer(vocab_size=300)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _sample_all(client: LocalTrainingClient, lean: bool) -> list[Sample]:
    """Prompts of different lengths decoded together (left padding, rows leaving at different steps),
    then each prompt's continuation again with the prefix cache holding its first part."""
    client.engine.lean_decode = lean
    client.prefix_cache.clear()
    texts = ["Compute 2 + 2.", "What is 17 times 23? Use the tool, then box it.", "Hi", "print(2**10)"]
    prompts = [client.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    params = [SamplingParams(max_tokens=6 + 5 * k, temperature=1.0, seed=11 + k) for k in range(len(texts))]

    async def together(prompts: list[list[int]]) -> list[Sample]:
        sampler = await client.sampling_client_async()
        jobs = [sampler.sample_async(p, 2, q) for p, q in zip(prompts, params, strict=True)]
        return [s for batch in await asyncio.gather(*jobs) for s in batch]

    first = asyncio.run(together(prompts))
    longer = [p + s.tokens for p, s in zip(prompts, first[::2], strict=True)]
    return first + asyncio.run(together(longer))


@pytest.mark.parametrize("which", ["qwen2", "gqa_llama"])
def test_lean_steps_sample_what_the_transformers_forward_samples(
    which: str, tiny_model_dir: Path, gqa_llama_dir: Path
) -> None:
    folder = tiny_model_dir if which == "qwen2" else gqa_llama_dir
    client = LocalTrainingClient(folder, lora=None, device="cpu", seed=0, sample_batch_size=16)
    try:
        assert lean_decoder(client.sampling_model()) is not None
        lean, plain = _sample_all(client, lean=True), _sample_all(client, lean=False)
        assert client.engine._lean is None  # the second run went through transformers' forward
        assert sum(len(s.tokens) for s in lean) > 40
        for a, b in zip(lean, plain, strict=True):
            assert a.tokens == b.tokens
            assert a.stop_reason == b.stop_reason
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)  # float rounding: rows with holes
    finally:
        client.close()


def test_layouts_it_does_not_know_decode_through_the_model(tiny_model_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    sdpa = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert lean_decoder(sdpa) is not None
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    assert lean_decoder(eager) is None
    wrapped = get_peft_model(sdpa, LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    assert lean_decoder(wrapped) is None
    assert lean_decoder(torch.nn.Linear(2, 2)) is None
