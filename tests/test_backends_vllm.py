"""Plumbing of the vLLM sampler against a fake ``vllm`` module, in the project's own environment: adapter
hand-over when the weights changed, batched requests with per-sequence seeds, stop handling, result
mapping, the dtype and memory rules. The real engine (vLLM's CPU build) is exercised by tests/vllm_engine/,
run through tests/test_vllm_engine.py."""

from __future__ import annotations

import asyncio
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from retool.backends.interface.types import AdamParams, Datum, SamplingParams
from retool.backends.local.client import LocalTrainingClient


@pytest.fixture()
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    calls: dict[str, list[Any]] = {"LLM": [], "generate": [], "LoRARequest": []}

    class SamplingParamsV:
        def __init__(self, **kwargs: Any) -> None:
            self.__dict__.update(kwargs)

    class LoRARequest:
        def __init__(self, name: str, lora_id: int, path: str) -> None:
            self.name, self.lora_id, self.path = name, lora_id, path
            calls["LoRARequest"].append(self)

    class LLM:
        def __init__(self, **kwargs: Any) -> None:
            calls["LLM"].append(kwargs)

        def generate(
            self, prompts: list[dict], params: list[Any], lora_request: Any = None, use_tqdm: bool = True
        ):
            calls["generate"].append((prompts, params, lora_request))
            outs = []
            for p, sp in zip(prompts, params, strict=True):
                toks = [p["prompt_token_ids"][-1] + k for k in range(1, min(3, sp.max_tokens) + 1)]
                comp = types.SimpleNamespace(
                    token_ids=toks,
                    logprobs=[{t: types.SimpleNamespace(logprob=-0.5 * (k + 1))} for k, t in enumerate(toks)],
                    finish_reason="length" if len(toks) == sp.max_tokens else "stop",
                )
                outs.append(types.SimpleNamespace(outputs=[comp]))
            return outs

    vllm = types.ModuleType("vllm")
    vllm.LLM = LLM
    vllm.SamplingParams = SamplingParamsV
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = LoRARequest
    vllm.lora = lora
    lora.request = request
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.lora", lora)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    monkeypatch.setitem(sys.modules, "vllm.engine", None)  # EngineArgs unavailable: pass all kwargs
    return calls


def test_vllm_sampler_hands_over_adapters_and_batches(
    fake_vllm: dict[str, list[Any]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    from retool.backends.samplers.vllm import VllmSamplingClient, attach_vllm_sampler

    client = LocalTrainingClient(
        tiny_model_dir, lora={"rank": 4, "alpha": 8}, device="cpu", seed=0, checkpoint_dir=tmp_path
    )
    attach_vllm_sampler(client)
    [llm_kwargs] = fake_vllm["LLM"]
    assert llm_kwargs["enable_lora"] and llm_kwargs["model"] == str(tiny_model_dir)
    assert llm_kwargs["logprobs_mode"] == "raw_logprobs"
    assert llm_kwargs["dtype"] == "float32"  # the trainer's, never vLLM's "auto" (which downcasts to bf16)
    assert llm_kwargs["kv_cache_memory_bytes"] == 2**30  # CPU: bytes, not a share of host RAM
    assert "gpu_memory_utilization" not in llm_kwargs
    assert llm_kwargs["enable_prefix_caching"] and llm_kwargs["max_loras"] == 2

    sampler = client.sampling_client()
    assert isinstance(sampler, VllmSamplingClient)
    [req1] = fake_vllm["LoRARequest"]
    assert req1.lora_id == 1 and (Path(req1.path) / "adapter_model.safetensors").is_file()

    async def run() -> list:
        return await asyncio.gather(
            sampler.sample_async([5, 6], 2, SamplingParams(max_tokens=8, seed=1, stop=("</code>",))),
            sampler.sample_async([7], 1, SamplingParams(max_tokens=2, seed=2, temperature=0.5)),
        )

    a, b = asyncio.run(run())
    [(prompts, params, lora_request)] = fake_vllm["generate"]  # one batched call for both requests
    assert [p["prompt_token_ids"] for p in prompts] == [[5, 6], [5, 6], [7]]
    assert all(p.n == 1 for p in params)
    assert len({p.seed for p in params}) == 3  # each sequence its own seed
    assert params[0].stop == ["</code>"] and params[0].include_stop_str_in_output
    assert set(client.eos_ids) <= set(params[0].stop_token_ids)
    assert lora_request is req1
    assert a[0].tokens == [7, 8, 9] and a[0].logprobs == [-0.5, -1.0, -1.5] and a[0].stop_reason == "stop"
    assert b[0].tokens == [8, 9] and b[0].stop_reason == "length"

    client.sampling_client()  # the weights did not change: the same adapter keeps serving
    assert [r.lora_id for r in fake_vllm["LoRARequest"]] == [1]
    datum = Datum([5, 6], [6, 7], weights=[1.0, 1.0])
    client.forward_backward([datum], "cross_entropy")
    client.optim_step(AdamParams(lr=1e-2))
    client.sampling_client()  # the next RL step: a new adapter version
    assert [r.lora_id for r in fake_vllm["LoRARequest"]] == [1, 2]
    assert fake_vllm["LoRARequest"][1].path != req1.path
    assert sampler.pinned(1).lora_request is req1  # the previous version, served by request
    assert sampler.pinned(None).lora_request is None  # the base model
    with pytest.raises(ValueError, match="not kept"):
        sampler.pinned(7)


def test_vllm_sampler_refuses_full_finetuning(fake_vllm: dict[str, list[Any]], tiny_model_dir: Path) -> None:
    from retool.backends.samplers.vllm import attach_vllm_sampler

    client = LocalTrainingClient(tiny_model_dir, lora=None, device="cpu", seed=0)
    with pytest.raises(ValueError, match="full fine-tuning"):
        attach_vllm_sampler(client)


def test_an_engine_setting_this_vllm_cannot_take_is_an_error(
    fake_vllm: dict[str, list[Any]], tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing is dropped on the way to vLLM: an engine without ``logprobs_mode`` (read from its
    ``EngineArgs``, or refused by ``LLM`` itself) stops the run, naming the setting."""
    from retool.backends.remote.common import SdkOptionError
    from retool.backends.samplers.vllm import attach_vllm_sampler

    client = LocalTrainingClient(
        tiny_model_dir, lora={"rank": 4, "alpha": 8}, device="cpu", seed=0, checkpoint_dir=tmp_path
    )
    message = r"vllm \(version unknown\): the engine takes no logprobs_mode='raw_logprobs'"

    class OlderEngineArgs:  # an EngineArgs from before raw-logprob mode
        def __init__(
            self,
            model: str,
            enable_lora: bool,
            max_lora_rank: int,
            max_loras: int,
            dtype: str,
            gpu_memory_utilization: float,
            kv_cache_memory_bytes: int,
            enable_prefix_caching: bool,
            disable_log_stats: bool,
            max_model_len: int,
            seed: int,
        ) -> None: ...

    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    arg_utils.EngineArgs = OlderEngineArgs
    monkeypatch.setitem(sys.modules, "vllm.engine", types.ModuleType("vllm.engine"))
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", arg_utils)
    with pytest.raises(SdkOptionError, match=message):
        attach_vllm_sampler(client)
    assert fake_vllm["LLM"] == []  # refused before the engine was built

    def older_llm(**kwargs: Any) -> None:
        if "logprobs_mode" in kwargs:
            raise TypeError("LLM.__init__() got an unexpected keyword argument 'logprobs_mode'")

    monkeypatch.setitem(sys.modules, "vllm.engine", None)  # no EngineArgs to read: the engine refuses
    monkeypatch.setattr(sys.modules["vllm"], "LLM", older_llm)
    with pytest.raises(SdkOptionError, match=message):
        attach_vllm_sampler(client)


def test_engine_dtype_is_the_trainers_unless_set(caplog: pytest.LogCaptureFixture) -> None:
    import torch

    from retool.backends.samplers.vllm import engine_dtype

    assert engine_dtype(torch.float32) == "float32"
    assert engine_dtype(torch.bfloat16) == "bfloat16"
    assert engine_dtype(torch.float32, "float32") == "float32" and not caplog.records
    with caplog.at_level("WARNING"):
        assert engine_dtype(torch.float32, "bfloat16") == "bfloat16"  # bf16 serving of an fp32 master copy
    assert "offpolicy/kl_k3" in caplog.text  # the warning names where the mismatch shows
    with pytest.raises(ValueError, match="use 'trainer'"):
        engine_dtype(torch.float32, "auto")


def test_memory_is_bytes_on_cpu_and_a_share_on_a_gpu() -> None:
    from retool.backends.samplers.vllm import memory_settings

    assert memory_settings("cpu", 0.5, 0.9) == {"kv_cache_memory_bytes": 2**29}
    assert memory_settings("cuda", 0.5, 0.9) == {"gpu_memory_utilization": 0.9}
    with pytest.raises(ValueError, match="KV cache budget"):
        memory_settings("cpu", 0.0, 0.9)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        memory_settings("cuda", 1.0, 1.5)


def test_config_settings_reach_the_engine(
    fake_vllm: dict[str, list[Any]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    from retool.backends import make_training_client
    from retool.config import load_config

    config = load_config(
        "tiny",
        overrides=[
            f"model.name={tiny_model_dir}",
            f"train.run_dir={tmp_path}",
            "backend.engine=vllm",
            "backend.vllm_dtype=bfloat16",
            "backend.vllm_kv_cache_gib=0.25",
        ],
    )
    make_training_client(config)
    [llm_kwargs] = fake_vllm["LLM"]
    assert llm_kwargs["dtype"] == "bfloat16" and llm_kwargs["kv_cache_memory_bytes"] == 2**28
