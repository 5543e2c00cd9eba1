"""Optional vLLM sampler for the local backend on a GPU (``backend.sampler = "vllm"``).

The trainer keeps the weights (HF + PEFT); vLLM holds a frozen copy of the base model and receives the
trainer's LoRA adapter at the start of every RL step: ``refresh()`` writes the current adapter to
``<checkpoint_dir>/vllm_adapters/v<N>`` (PEFT format) and later requests carry a new ``LoRARequest`` for it,
so vLLM samples from the current policy without reloading the base model. Full fine-tuning is not
supported here (use the built-in sampler).

Requests go through the same gather-and-batch queue as the built-in sampler; each sequence is its own
vLLM prompt with ``n=1`` and its own seed, so seeded results do not depend on batch composition.
Logprobs: the engine is created with ``logprobs_mode="raw_logprobs"`` where the installed vLLM supports
it, so the returned logprobs are the model's raw ones (ratio ~1 up to bf16 / kernel differences).
Stop strings are kept in the output (``include_stop_str_in_output``), matching the local sampler.

Not tested in this repository's CI (no GPU, no vLLM there); ``bench/gpu_smoke.sh`` exercises it when
vLLM is installed.
"""

from __future__ import annotations

import inspect
import logging
import shutil
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from retool.backends.generation import GenRequest
from retool.backends.local import LocalSamplingClient
from retool.backends.remote import SdkOptionError, sdk_label
from retool.backends.types import Sample

if TYPE_CHECKING:
    from retool.backends.local import LocalTrainingClient

logger = logging.getLogger(__name__)


class VllmOptions(TypedDict, total=False):
    """``VllmSamplingClient``'s keyword options (``attach_vllm_sampler`` passes them on)."""

    gpu_memory_utilization: float
    gather_ms: float
    keep_adapters: int


class VllmSamplingClient(LocalSamplingClient):
    """Samples with a vLLM engine that loads the trainer's LoRA adapter each refresh."""

    def __init__(
        self,
        owner: LocalTrainingClient,
        *,
        gpu_memory_utilization: float = 0.35,
        gather_ms: float = 5.0,
        keep_adapters: int = 2,
    ) -> None:
        try:
            import vllm  # deferred: vllm is optional (the vllm extra)
        except ImportError as exc:
            raise RuntimeError("backend.sampler=vllm needs vLLM: pip install 'retool-rl[vllm]'") from exc
        if owner.lora is None:
            raise ValueError("the vLLM sampler hands LoRA adapters over; full fine-tuning needs sampler=hf")
        if owner.gguf_file:
            raise ValueError("the vLLM sampler needs an HF model folder or Hub id, not a GGUF file")
        super().__init__(owner, gather_ms=gather_ms)
        self.batch_limit = max(owner.sample_batch_size, 256)  # vLLM schedules large batches itself
        self._vllm = vllm
        kwargs: dict[str, object] = {
            "model": owner.model_path,
            "enable_lora": True,
            "max_lora_rank": max(8, owner.lora.rank),
            "max_loras": 2,
            "dtype": "bfloat16" if str(owner.dtype).endswith("bfloat16") else "auto",
            "gpu_memory_utilization": gpu_memory_utilization,
            "max_model_len": owner.max_context,
            "seed": owner.seed,
            "logprobs_mode": "raw_logprobs",
        }
        # Every setting reaches the engine or the run stops: without raw_logprobs, for one, the sampled
        # logprobs would be post-processing ones and every importance ratio off.
        accepted = _accepted_engine_args(vllm)
        unknown = sorted(set(kwargs) - accepted) if accepted is not None else []
        if unknown:
            raise _unsupported(vllm, kwargs, unknown)
        try:
            self.llm = vllm.LLM(**kwargs)
        except TypeError as exc:  # no EngineArgs to read beforehand: the engine names what it refuses
            refused = [k for k in kwargs if f"'{k}'" in str(exc)]
            if not refused:
                raise
            raise _unsupported(vllm, kwargs, refused) from exc
        self._adapter_dir = Path(owner.checkpoint_dir) / "vllm_adapters"
        self._version = 0
        self._lora_request: Any = None
        self._keep = keep_adapters

    def refresh(self) -> None:
        """Hand the trainer's current adapter to vLLM (runs on the trainer's worker thread)."""
        from vllm.lora.request import LoRARequest  # deferred: vllm is optional (the vllm extra)

        self._version += 1
        folder = self._adapter_dir / f"v{self._version}"
        folder.mkdir(parents=True, exist_ok=True)
        self._owner.model.save_pretrained(folder)
        # A new name and id per version: vLLM caches adapters by id, so reusing one would serve stale weights.
        self._lora_request = LoRARequest(f"policy-v{self._version}", self._version, str(folder))
        old = self._adapter_dir / f"v{self._version - self._keep}"
        if self._version > self._keep and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        logger.debug("vLLM sampler now at adapter v%d", self._version)

    def _params(self, req: GenRequest) -> Any:
        p = req.params
        strings = [s for s in p.stop if isinstance(s, str)]
        ids = [int(s) for s in p.stop if not isinstance(s, str)]
        ids += sorted(self._owner.eos_ids)
        return self._vllm.SamplingParams(
            n=1,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else -1,
            max_tokens=max(1, min(p.max_tokens, self._owner.max_context - len(req.prompt))),
            seed=req.seed % (2**31),
            stop=strings or None,
            stop_token_ids=ids,
            include_stop_str_in_output=True,
            logprobs=0,  # the chosen token's logprob only
            detokenize=True,
        )

    def _run_batch(self, requests: list[GenRequest]) -> list[Sample]:
        if self._lora_request is None:
            self.refresh()
        prompts = [{"prompt_token_ids": r.prompt} for r in requests]
        params = [self._params(r) for r in requests]
        outputs = self.llm.generate(prompts, params, lora_request=self._lora_request, use_tqdm=False)
        samples: list[Sample] = []
        for req, out in zip(requests, outputs, strict=True):
            if req.params.max_tokens == 0:
                samples.append(Sample([], [], "length"))
                continue
            comp = out.outputs[0]
            tokens = list(comp.token_ids)
            lps = [float(step[tok].logprob) for tok, step in zip(tokens, comp.logprobs or [], strict=False)]
            if len(lps) != len(tokens):
                raise RuntimeError("vLLM returned fewer logprobs than tokens")
            reason = "length" if comp.finish_reason == "length" else "stop"
            samples.append(Sample(tokens, lps, reason))  # type: ignore[arg-type]
        return samples


def _unsupported(vllm: object, kwargs: dict[str, object], names: list[str]) -> SdkOptionError:
    settings = ", ".join(f"{k}={kwargs[k]!r}" for k in names)
    return SdkOptionError(
        f"{sdk_label(vllm)}: the engine takes no {settings}; this vLLM cannot apply that setting. Upgrade it "
        "(pip install 'retool-rl[vllm]') or use backend.sampler = 'hf'"
    )


def _accepted_engine_args(vllm: ModuleType) -> set[str] | None:
    try:
        from vllm.engine.arg_utils import EngineArgs  # deferred: vllm is optional (the vllm extra)

        names = set(inspect.signature(EngineArgs).parameters)
        return names | {"model"}
    except Exception:  # older/newer layouts: pass everything and let vLLM complain
        return None


def attach_vllm_sampler(client: LocalTrainingClient, **kwargs: Unpack[VllmOptions]) -> VllmSamplingClient:
    """Make ``client.sampling_client()`` return a vLLM sampler refreshed from the trainer each call."""
    sampler = VllmSamplingClient(client, **kwargs)
    client.set_sampler(sampler)
    return sampler
