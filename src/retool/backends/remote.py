"""Shared adapter logic for managed training services whose SDKs look like Tinker (``pytrio``, ``tinker``).

The SDKs are optional imports; nothing here talks to a network until a client is built. Every SDK call is
synchronous-then-``.result()`` and runs in a worker thread (``asyncio.to_thread``) so the event loop stays
free. Objects that an SDK returns as a *future of a client* (Tinker) are resolved with ``.result()``.

How our ``Datum`` maps onto the services' loss inputs:

- RL losses (``ppo``, ``importance_sampling``) take no per-token weights on the services, so the datum
  weight is folded into the advantage: ``A' = w * A``. For ``w >= 0`` this is exact for both losses
  (``-min(r wA, clip(r) wA) = -w min(rA, clip(r) A)``); negative weights are refused.
  Positions with ``w = 0`` get advantage 0 (Tinker) and additionally target ``-100`` (PyTRIO, which
  counts every target that is not ``-100`` as an active token).
- ``cross_entropy`` sends ``weights`` directly.
- PPO thresholds go to ``loss_fn_config`` as ``clip_low_threshold`` / ``clip_high_threshold`` (ratios).
- A per-backend ``reduction_scale(datums)`` multiplies every advantage / CE weight, so that the gradient
  the loop gets is the one its weights describe (mean over trained datums) whatever the server does with
  the sum. Tinker sums (scale 1); see ``pytrio_backend`` for PyTRIO's assumption.

Metrics (loss, ratio stats, clip fraction) are computed client-side from the per-token learner logprobs
the service returns (``loss_fn_outputs[i]["logprobs"]``), with the same loss code as the local backend;
the service's own metrics are passed through in ``extra`` under ``server/``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from retool.backends.base import SamplingClient, TrainingClient
from retool.backends.losses import LOSS_NAMES, clip_thresholds
from retool.backends.types import (
    AdamParams,
    Datum,
    ForwardBackwardResult,
    LossName,
    OptimStepResult,
    Sample,
    SamplingParams,
)

if TYPE_CHECKING:
    from retool.config import Config

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100


class BackendUnavailableError(RuntimeError):
    """The SDK of a managed backend is not installed or not configured (the message says how to fix it)."""


def import_sdk(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"backend '{module}' needs the '{module}' SDK, which is not installed: "
            f"pip install 'retool-rl[{extra}]' (or set backend.kind=local)"
        ) from exc


def resolve(obj: Any, expect: str | None = None) -> Any:
    """Resolve SDK futures: call ``.result()`` until the object is not a future (or has ``expect``)."""
    for _ in range(4):
        if expect is not None and hasattr(obj, expect):
            return obj
        result = getattr(obj, "result", None)
        if not callable(result):
            return obj
        obj = result()
    return obj


def call_kwargs(fn: Callable[..., Any], **kwargs: Any) -> Any:
    """Call ``fn`` with only the keyword arguments it declares (SDK versions differ in optional ones)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(**kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


_ALIASES = {"learning_rate": ("lr",), "grad_clip_norm": ("grad_clip",)}


def build_model(cls: Any, **kwargs: Any) -> Any:
    """Construct an SDK pydantic type with the fields it has: known aliases are renamed (``learning_rate``
    -> ``lr``), other unknown fields are dropped with a warning (SDK versions differ)."""
    fields = getattr(cls, "model_fields", None)
    if fields:
        out: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in fields:
                out[key] = value
                continue
            alias = next((a for a in _ALIASES.get(key, ()) if a in fields), None)
            if alias is not None:
                out[alias] = value
            elif value not in (None, 0, 0.0):
                logger.warning("%s has no field %r; %r not sent", getattr(cls, "__name__", cls), key, value)
        kwargs = out
    return cls(**kwargs)


def _to_list(value: Any) -> list[float]:
    if value is None:
        return []
    for attr in ("tolist", "to_list"):
        fn = getattr(value, attr, None)
        if callable(fn):
            return list(fn())
    data = getattr(value, "data", None)
    if data is not None:
        return list(data)
    return list(value)


def normalize_stop_reason(reason: Any) -> str:
    text = str(getattr(reason, "value", reason) or "").lower()
    return "length" if ("length" in text or "max" in text) else "stop"


def lora_flags(target_modules: Sequence[str]) -> dict[str, bool]:
    """Managed services train whole groups of layers; map module names to their switches."""
    names = {m.split(".")[-1] for m in target_modules}
    attn = bool(names & {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"})
    mlp = bool(names & {"gate_proj", "up_proj", "down_proj", "gate_up_proj"})
    unembed = "lm_head" in names
    if not (attn or mlp or unembed):
        attn = True
    return {"train_attn": attn, "train_mlp": mlp, "train_unembed": unembed}


def local_tokenizer(model_name: str) -> Any:
    """A local HF folder's tokenizer (so tests and offline runs never download one); else ``None``."""
    if Path(model_name).is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_name)
    return None


class RemoteSamplingClient(SamplingClient):
    """Wraps an SDK sampling client; returns our ``Sample`` objects."""

    def __init__(self, sdk: Any, client: Any, owner: RemoteTrainingClient) -> None:
        self._sdk = sdk
        self._client = client
        self._owner = owner

    def _params(self, params: SamplingParams) -> Any:
        stop: list[Any] | None = list(params.stop) if params.stop else None
        if stop:
            # A stop list replaces the default end-of-sequence stop on these services: keep EOS as well.
            extra = self._owner.eos_stop(string=isinstance(stop[0], str))
            stop += [s for s in extra if s not in stop]
        return build_model(
            self._sdk.types.SamplingParams if hasattr(self._sdk, "types") else self._sdk.SamplingParams,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            stop=stop,
        )

    def _sample_sync(self, prompt: list[int], num_samples: int, params: SamplingParams) -> list[Sample]:
        model_input = self._owner.model_input(prompt)
        response = resolve(
            self._client.sample(
                prompt=model_input, num_samples=num_samples, sampling_params=self._params(params)
            ),
            expect="sequences",
        )
        out: list[Sample] = []
        for seq in response.sequences:
            tokens = [int(t) for t in seq.tokens]
            logprobs = getattr(seq, "logprobs", None)
            if logprobs is None:
                raise RuntimeError("the service returned no sampling logprobs; RL losses need them")
            lps = [float(x) for x in _to_list(logprobs)]
            if len(lps) != len(tokens):
                raise RuntimeError(f"service returned {len(tokens)} tokens but {len(lps)} logprobs")
            out.append(Sample(tokens, lps, normalize_stop_reason(getattr(seq, "stop_reason", "stop"))))  # type: ignore[arg-type]
        return out

    async def sample_async(
        self, prompt_tokens: Sequence[int], num_samples: int, params: SamplingParams
    ) -> list[Sample]:
        prompt = [int(t) for t in prompt_tokens]
        if not prompt:
            raise ValueError("prompt_tokens is empty")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        room = params.max_tokens
        if self._owner.max_context:
            room = min(room, self._owner.max_context - len(prompt))
        if room < 1:
            return [Sample([], [], "length") for _ in range(num_samples)]
        if room < params.max_tokens:
            params = dataclasses.replace(params, max_tokens=room)
        return await asyncio.to_thread(self._sample_sync, prompt, num_samples, params)


class RemoteTrainingClient(TrainingClient):
    """Common adapter body; subclasses set ``sdk_name``, masking and the reduction assumption."""

    sdk_name = ""
    mask_targets = False  # PyTRIO: target -100 where the weight is 0

    def __init__(
        self,
        sdk: Any,
        training_client: Any,
        *,
        base_model: str,
        tokenizer: Any = None,
        max_context: int | None = None,
    ) -> None:
        self._sdk = sdk
        self.max_context = max_context  # the services do not cap max_tokens by the context: we do
        self._client = resolve(training_client, expect="forward_backward")
        self.base_model = base_model
        self._tokenizer = tokenizer
        self.step = 0

    # -- SDK helpers ---------------------------------------------------------------------------
    @classmethod
    def from_lora_service(cls, sdk: Any, service: Any, config: Config, **kwargs: Any) -> Any:
        """A LoRA training client of ``config.model.name`` created by the SDK's ``service``: the part of
        ``from_config`` the managed backends share (credentials and rank limits are their own)."""
        training = call_kwargs(
            service.create_lora_training_client,
            base_model=config.model.name,
            rank=config.lora.rank,
            seed=config.train.seed,
            **lora_flags(config.lora.target_modules),
        )
        return cls(
            sdk,
            resolve(training, expect="forward_backward"),
            base_model=config.model.name,
            tokenizer=local_tokenizer(config.model.name),
            max_context=config.model.max_context,
            **kwargs,
        )

    @property
    def types(self) -> Any:
        return getattr(self._sdk, "types", self._sdk)

    def _type(self, name: str) -> Any:
        return getattr(self._sdk, name, None) or getattr(self.types, name)

    @property
    def tokenizer(self) -> Any:  # type: ignore[override]
        if self._tokenizer is None:
            self._tokenizer = self._client.get_tokenizer()
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value: Any) -> None:
        self._tokenizer = value

    def model_input(self, tokens: list[int]) -> Any:
        return self._type("ModelInput").from_ints(tokens)

    def eos_stop(self, string: bool) -> list[Any]:
        tok = self._tokenizer
        if tok is None:
            return []
        value = getattr(tok, "eos_token" if string else "eos_token_id", None)
        return [value] if value is not None else []

    def tensor(self, values: list[float] | list[int], dtype: str) -> Any:
        cls = getattr(self.types, "TensorData", None)
        if cls is None:
            return values
        return cls(data=values, dtype=dtype, shape=[len(values)])

    def reduction_scale(self, datums: Sequence[Datum], loss_fn: str) -> float:
        """Factor applied to advantages / CE weights so the service's reduction yields the loop's sum."""
        return 1.0

    # -- conversion ----------------------------------------------------------------------------
    def to_sdk_datum(self, d: Datum, loss_fn: str, scale: float) -> Any:
        n = len(d)
        w = list(d.weights) if d.weights else [1.0] * n
        targets = [int(t) for t in d.target_tokens]
        if self.mask_targets:
            targets = [t if wi != 0 else IGNORE_INDEX for t, wi in zip(targets, w, strict=True)]
        inputs: dict[str, Any] = {"target_tokens": self.tensor(targets, "int64")}
        if loss_fn == "cross_entropy":
            inputs["weights"] = self.tensor([float(wi) * scale for wi in w], "float32")
        else:
            if any(wi < 0 for wi in w):
                raise ValueError(f"{self.sdk_name}: negative datum weights cannot be folded into advantages")
            adv = [
                float(a) * float(wi) * scale if wi != 0 else 0.0
                for a, wi in zip(d.advantages, w, strict=True)
            ]
            lps = [float(x) if wi != 0 else 0.0 for x, wi in zip(d.logprobs, w, strict=True)]
            inputs["logprobs"] = self.tensor(lps, "float32")
            inputs["advantages"] = self.tensor(adv, "float32")
        return self._type("Datum")(
            model_input=self.model_input([int(t) for t in d.input_tokens]), loss_fn_inputs=inputs
        )

    # -- training ------------------------------------------------------------------------------
    def _validate(self, datums: Sequence[Datum], loss_fn: str) -> None:
        if loss_fn not in LOSS_NAMES:
            raise ValueError(f"unknown loss_fn {loss_fn!r}; known: {', '.join(LOSS_NAMES)}")
        if not datums:
            raise ValueError("forward_backward needs at least one datum")
        for k, d in enumerate(datums):
            if len(d) == 0:
                raise ValueError(f"datum {k} is empty")
            if loss_fn != "cross_entropy" and (len(d.logprobs) != len(d) or len(d.advantages) != len(d)):
                raise ValueError(
                    f"datum {k}: loss {loss_fn!r} needs logprobs and advantages for every position"
                )

    def _metrics(
        self, datums: Sequence[Datum], loss_fn: str, loss_config: dict[str, float] | None, output: Any
    ) -> ForwardBackwardResult:
        import torch

        from retool.backends.losses import LossTally, token_loss

        outs = list(getattr(output, "loss_fn_outputs", None) or [])
        server = {
            f"server/{k}": float(v)
            for k, v in dict(getattr(output, "metrics", None) or {}).items()
            if isinstance(v, int | float)
        }
        if len(outs) != len(datums):
            logger.warning(
                "service returned %d loss outputs for %d datums; metrics from server only",
                len(outs),
                len(datums),
            )
            trained = sum(sum(1 for w in (d.weights or [1.0] * len(d)) if w != 0) for d in datums)
            loss = next((v for k, v in server.items() if k.endswith(("loss:sum", "loss_sum"))), math.nan)
            return ForwardBackwardResult(loss=loss, trained_tokens=trained, extra=server)
        tally = LossTally()
        for d, o in zip(datums, outs, strict=True):
            lp_values = o.get("logprobs") if isinstance(o, dict) else getattr(o, "logprobs", None)
            lp = torch.tensor([float(x) for x in _to_list(lp_values)], dtype=torch.float64)
            n = len(d)
            w = torch.tensor(d.weights if d.weights else [1.0] * n, dtype=torch.float64)
            old = torch.tensor(d.logprobs, dtype=torch.float64) if d.logprobs else None
            adv = torch.tensor(d.advantages, dtype=torch.float64) if d.advantages else None
            tally.add(token_loss(loss_fn, lp, w, old, adv, loss_config))
        return tally.result(server)

    def _forward_backward_sync(
        self, datums: Sequence[Datum], loss_fn: str, loss_config: dict[str, float] | None
    ) -> ForwardBackwardResult:
        self._validate(datums, loss_fn)
        lo, hi = clip_thresholds(loss_config)
        scale = self.reduction_scale(datums, loss_fn)
        data = [self.to_sdk_datum(d, loss_fn, scale) for d in datums]
        cfg = {"clip_low_threshold": lo, "clip_high_threshold": hi} if loss_fn == "ppo" else None
        kwargs: dict[str, Any] = {"loss_fn": loss_fn}
        if cfg is not None:
            kwargs["loss_fn_config"] = cfg
        output = resolve(self._client.forward_backward(data, **kwargs), expect="loss_fn_outputs")
        result = self._metrics(datums, loss_fn, loss_config, output)
        result.extra["reduction_scale"] = scale
        return result

    async def forward_backward_async(
        self, datums: Sequence[Datum], loss_fn: LossName, loss_config: dict[str, float] | None = None
    ) -> ForwardBackwardResult:
        return await asyncio.to_thread(self._forward_backward_sync, list(datums), loss_fn, loss_config)

    def _optim_step_sync(self, adam: AdamParams) -> OptimStepResult:
        params = build_model(
            self._type("AdamParams"),
            learning_rate=adam.lr,
            beta1=adam.beta1,
            beta2=adam.beta2,
            eps=adam.eps,
            weight_decay=adam.weight_decay,
            grad_clip_norm=adam.grad_clip_norm,
        )
        response = resolve(self._client.optim_step(params), expect="metrics")
        metrics = dict(getattr(response, "metrics", None) or {})
        grad_norm = next((float(v) for k, v in metrics.items() if "grad_norm" in k), math.nan)
        self.step += 1
        return OptimStepResult(grad_norm=grad_norm, lr=adam.lr)

    async def optim_step_async(self, adam: AdamParams) -> OptimStepResult:
        return await asyncio.to_thread(self._optim_step_sync, adam)

    # -- checkpoints and samplers --------------------------------------------------------------
    def check_state_name(self, name: str) -> None:
        """Hook for services that restrict checkpoint names."""

    def _save_state_sync(self, name: str) -> str:
        self.check_state_name(name)
        response = resolve(self._client.save_state(name), expect="path")
        path = getattr(response, "path", response)
        logger.info("%s: saved state %r at %s", self.sdk_name, name, path)
        return str(path)

    async def save_state_async(self, name: str) -> str:
        return await asyncio.to_thread(self._save_state_sync, name)

    def _load_state_sync(self, path: str) -> None:
        loader = getattr(self._client, "load_state_with_optimizer", None) or self._client.load_state
        resolve(loader(path))

    async def load_state_async(self, path: str) -> None:
        await asyncio.to_thread(self._load_state_sync, path)

    def _sampling_client_sync(self) -> SamplingClient:
        client = resolve(self._client.save_weights_and_get_sampling_client(), expect="sample")
        return RemoteSamplingClient(self._sdk, client, self)

    async def sampling_client_async(self) -> SamplingClient:
        """Saves the current weights as sampler weights on the service and returns a sampler over them."""
        return await asyncio.to_thread(self._sampling_client_sync)
