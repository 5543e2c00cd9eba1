"""The remote clients both SDK adapters (``pytrio``, ``tinker``) are built on: ``RemoteTrainingClient``
(training calls, checkpoints, tokenizer hand-off, the sampler it hands out) and ``RemoteSamplingClient``
(sampling, our ``Sample`` objects). The SDKs are optional imports; nothing here talks to a network until a
client is built. Every SDK call is synchronous-then-``.result()`` and runs on its own worker thread so the
event loop stays free.

What the clients are made of, each in a module of its own:

- ``sdk``: importing an SDK, resolving its futures, refusing what its version cannot take, reading its
  answers;
- ``calls``: how an SDK call runs and how its failure reaches the retry guard (timeouts, retries,
  idempotency: read there);
- ``wire``: our ``Datum`` turned into the services' loss inputs (masking, weight folding, scaling);
- ``metrics``: the loss and metrics computed here from the learner logprobs the service returns;
- ``service_reduction``: the mode of the service's loss normalisation an adapter assumes, the scales it
  gives datums for it, and the probes of the startup self-check.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar, TypeVarTuple

from retool.backends.interface.clients import SamplingClient
from retool.backends.interface.errors import BackendUnavailableError, SdkOptionError, sdk_label
from retool.backends.interface.types import (
    AdamParams,
    Datum,
    ForwardBackwardResult,
    LossName,
    OptimStepResult,
    Sample,
    SamplingParams,
)
from retool.backends.remote.calls import PendingCall, RemoteCallError, restate_failure, run_sdk_call
from retool.backends.remote.metrics import learner_logprobs, local_metrics, server_metrics
from retool.backends.remote.sdk import (
    build_model,
    grad_norm_of,
    import_sdk,
    local_tokenizer,
    lora_flags,
    normalize_stop_reason,
    resolve,
    to_list,
)
from retool.backends.remote.service_reduction import ServiceReduction
from retool.backends.remote.wire import loss_fn_inputs, to_wire, validate_datums
from retool.backends.training.losses import clip_thresholds, tis_cap
from retool.backends.training.reduction import (
    IGNORE_INDEX,
    BatchTotals,
    ReductionMode,
    WireDatum,
    batch_totals,
)
from retool.retry import Failure

if TYPE_CHECKING:
    from retool.config import Config

logger = logging.getLogger(__name__)

T = TypeVar("T")
Args = TypeVarTuple("Args")

# The clients, and what tests import from here by its old path (moved to the modules above; code in src
# imports them from where they live).
__all__ = [
    "IGNORE_INDEX",
    "BackendUnavailableError",
    "RemoteCallError",
    "RemoteSamplingClient",
    "RemoteTrainingClient",
    "SdkOptionError",
    "StateOrderError",
    "build_model",
    "import_sdk",
    "local_tokenizer",
    "lora_flags",
    "resolve",
]


class StateOrderError(RuntimeError):
    """``load_state`` was called after training started on a service that loads state only at start."""


class RemoteSamplingClient(SamplingClient):
    """Wraps an SDK sampling client; returns our ``Sample`` objects."""

    def __init__(self, sdk: ModuleType, client: Any, owner: RemoteTrainingClient) -> None:
        self._sdk = sdk
        self._client = client
        self._owner = owner

    def _params(self, params: SamplingParams) -> Any:
        stop: list[str | int] | None = list(params.stop) if params.stop else None
        if stop:
            # A stop list replaces the default end-of-sequence stop on these services: keep EOS as well.
            extra = self._owner.eos_stop(string=isinstance(stop[0], str))
            stop += [s for s in extra if s not in stop]
        return build_model(
            self._owner._type("SamplingParams"),
            self._owner.sdk_label,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            stop=stop,
        )

    def _sample_sync(
        self, pending: PendingCall, prompt: list[int], num_samples: int, params: SamplingParams
    ) -> list[Sample]:
        model_input = self._owner.model_input(prompt)
        future = self._client.sample(
            prompt=model_input, num_samples=num_samples, sampling_params=self._params(params)
        )
        response = resolve(pending.hold(future), expect="sequences")
        out: list[Sample] = []
        for seq in response.sequences:
            tokens = [int(t) for t in seq.tokens]
            # Tinker answers None when it has no logprobs, PyTRIO an empty list.
            lps = [float(x) for x in to_list(getattr(seq, "logprobs", None))]
            if tokens and not lps:
                raise RuntimeError(
                    f"{self._owner.sdk_name}: the service returned no sampling logprobs; RL losses need them"
                )
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
        return await self._owner.call_sdk("sample", self._sample_sync, prompt, num_samples, params)


class RemoteTrainingClient(ServiceReduction):
    """Common adapter body; subclasses set the SDK's name, masking, loss metric and reduction default.

    ``training_client`` is the SDK's training client, or a future of one, or a zero-argument callable
    that creates it on first use (so a resume can build the client from the checkpoint instead).
    """

    sdk_name = ""
    mask_targets = False  # PyTRIO: target -100 where the weight is 0
    rl_weights = False  # send a 0/1 weight mask with RL datums (and so can adopt ``sequence_mean``)
    default_reduction: ReductionMode = "sum"
    server_loss_key = ""  # the service's name for the (normalised) loss in ``ForwardBackwardOutput.metrics``
    # The retry guard's idempotency declarations (``retool.backends.remote.guarded``): no request id this layer
    # sends is deduplicated by either service, and neither can discard an accumulated gradient (so no
    # ``zero_grad_async`` either). The guard's rule for that case applies; see the module docstring.
    dedupes_request_ids = False
    # Both SDKs re-send forward_backward / optim_step on transient failures before they raise, under an
    # idempotency id of their own: a failure they report for those calls never proves "not sent".
    sdk_resends_training_calls = True

    def __init__(
        self,
        sdk: ModuleType,
        training_client: Any,
        *,
        base_model: str,
        tokenizer: Any = None,
        max_context: int | None = None,
        reduction: ReductionMode | None = None,
    ) -> None:
        self._sdk = sdk
        self.max_context = max_context  # the services do not cap max_tokens by the context: we do
        self._factory: Callable[[], Any] | None = None
        self._client: Any = None
        if callable(training_client) and not hasattr(training_client, "forward_backward"):
            self._factory = training_client
        else:
            self._client = resolve(training_client, expect="forward_backward")
        self.base_model = base_model
        self._tokenizer: Any = None
        self.step = 0
        self.started = False  # any call that makes the service start (or change) the trainer's state
        self._init_reduction(reduction or self.default_reduction)
        self._window = 0  # datums sent by forward_backward since the last optim_step
        if tokenizer is not None:
            self.tokenizer = tokenizer

    # -- running SDK calls ---------------------------------------------------------------------
    async def call_sdk(
        self, what: str, fn: Callable[[PendingCall, *Args], T], *args: *Args, idempotent: bool = True
    ) -> T:
        """Run the blocking SDK call ``fn(pending, *args)`` on its own daemon thread
        (``retool.backends.remote.calls.run_sdk_call``); failures are re-raised as ``restate`` says."""
        return await run_sdk_call(
            f"{self.sdk_name} {what}",
            fn,
            *args,
            restate=lambda exc: self.restate(exc, what, idempotent=idempotent),
        )

    def sdk_outcome(self, exc: BaseException) -> tuple[Failure, str] | None:
        """Hook: the outcome of a failed call where this SDK's exception misleads ``classify``, and why;
        ``None`` to let ``classify`` read it."""
        return None

    def restate(self, exc: Exception, what: str, *, idempotent: bool) -> Exception:
        """``exc`` as the retry guard must read it: unchanged when ``classify`` reads it right, else a
        ``RemoteCallError`` stating the outcome (``retool.backends.remote.calls``)."""
        return restate_failure(
            exc,
            f"{self.sdk_name} {what}",
            self.sdk_outcome(exc),
            sdk_resent=not idempotent and self.sdk_resends_training_calls,
        )

    # -- SDK helpers ---------------------------------------------------------------------------
    @classmethod
    def lora_request(cls, config: Config) -> dict[str, str | int | bool]:
        """The arguments of ``create_lora_training_client`` for ``config`` (both SDKs take these)."""
        return {
            "base_model": config.model.name,
            "rank": config.lora.rank,
            "seed": config.train.seed,
            **lora_flags(config.lora.target_modules),
        }

    @property
    def sdk_client(self) -> Any:
        """The SDK's training client, created now if creation was deferred."""
        if self._client is None:
            assert self._factory is not None
            self._client = resolve(self._factory(), expect="forward_backward")
            self._factory = None
            if self._tokenizer is not None:
                self.share_tokenizer(self._tokenizer)
        return self._client

    @property
    def sdk_label(self) -> str:
        """The SDK and its installed version, for messages (``"tinker 0.38.0"``)."""
        return sdk_label(self._sdk)

    @property
    def types(self) -> Any:
        return getattr(self._sdk, "types", self._sdk)

    def _type(self, name: str) -> Any:
        return getattr(self._sdk, name, None) or getattr(self.types, name)

    @property
    def held_tokenizer(self) -> Any:
        """The tokenizer this adapter already has, or ``None`` (never loads one)."""
        return self._tokenizer

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self.tokenizer = self.load_sdk_tokenizer()
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value: Any) -> None:
        self._tokenizer = value
        if value is not None and self._client is not None:
            self.share_tokenizer(value)

    def load_sdk_tokenizer(self) -> Any:
        """Ask the SDK for the model's tokenizer (it may download it); a clear error if it cannot."""
        logger.warning(
            "%s: no local tokenizer for %r; asking the SDK for it (it downloads it if it is not cached)",
            self.sdk_name,
            self.base_model,
        )
        try:
            return self.sdk_client.get_tokenizer()
        except Exception as exc:
            raise BackendUnavailableError(
                f"{self.sdk_name}: could not load the tokenizer of {self.base_model!r} through the SDK "
                f"({type(exc).__name__}: {exc}). Make it available offline: put the tokenizer files in the "
                "Hugging Face cache (or a local folder named by model.name)."
            ) from exc

    def share_tokenizer(self, tokenizer: object) -> None:
        """Hook: give the SDK client our tokenizer where it would otherwise load its own."""

    def model_input(self, tokens: list[int]) -> Any:
        return self._type("ModelInput").from_ints(tokens)

    def eos_stop(self, string: bool) -> list[str | int]:
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

    # -- conversion ----------------------------------------------------------------------------
    def to_wire(self, d: Datum, loss_fn: str) -> WireDatum:
        """What the service will see for ``d`` (masking and weight folding done, reduction not yet)."""
        return to_wire(
            d, loss_fn, mask_targets=self.mask_targets, rl_weights=self.rl_weights, sdk_name=self.sdk_name
        )

    def to_sdk_datum(self, w: WireDatum, scale: float) -> Any:
        inputs = loss_fn_inputs(w, scale, self.tensor)
        return self._type("Datum")(model_input=self.model_input(w.input_tokens), loss_fn_inputs=inputs)

    # -- training ------------------------------------------------------------------------------
    def _submit(
        self,
        datums: Sequence[Datum],
        loss_fn: str,
        loss_config: dict[str, float] | None,
        *,
        forward_only: bool,
        scale: float | None = None,
        pending: PendingCall | None = None,
        client: Any = None,
    ) -> tuple[Any, list[WireDatum], BatchTotals, list[float]]:
        """Send one forward(-backward) call; ``scale`` overrides the reduction scale (the probe sends 1);
        ``client`` another SDK training client than the adapter's (the gradient check's scratch model)."""
        validate_datums(datums, loss_fn)
        lo, hi = clip_thresholds(loss_config)
        if tis_cap(loss_config) > 0:
            # The service computes the loss itself; the TIS weight needs the trainer's logprobs before the
            # call, which would take a second forward pass per micro-batch.
            raise ValueError(
                f"{self.sdk_name}: truncated importance sampling (loss.tis_cap) needs the loss computed "
                "locally; the service computes it server-side. Set loss.tis_cap = 0 on this backend"
            )
        wire = [self.to_wire(d, loss_fn) for d in datums]
        totals = batch_totals(wire, loss_fn)
        scales = [scale] * len(wire) if scale is not None else self.reduction_scales(wire, totals, loss_fn)
        data = [self.to_sdk_datum(w, s) for w, s in zip(wire, scales, strict=True)]
        kwargs: dict[str, object] = {"loss_fn": loss_fn}
        if loss_fn == "ppo":
            kwargs["loss_fn_config"] = {"clip_low_threshold": lo, "clip_high_threshold": hi}
        self.prepare_training_call()
        if client is None:
            client = self.sdk_client
            self.started = True
        call = client.forward if forward_only else client.forward_backward
        future = call(data, **kwargs)
        if pending is not None:
            pending.hold(future)
        return resolve(future, expect="loss_fn_outputs"), wire, totals, scales

    def prepare_training_call(self) -> None:
        """Hook run before every forward pass (PyTRIO makes sure the SDK has our tokenizer)."""

    def _forward_backward_sync(
        self,
        pending: PendingCall,
        datums: Sequence[Datum],
        loss_fn: str,
        loss_config: dict[str, float] | None,
    ) -> ForwardBackwardResult:
        if self.reduction_for(loss_fn) == "sequence_mean" and self._window:
            raise RuntimeError(
                f"{self.sdk_name}: a second forward_backward ({len(datums)} datums) before optim_step, after "
                f"{self._window} datums: the service reduces per sequence and divides the step's gradient by "
                "the number of datums it accumulated, which the first call's weights could not know. Send "
                "the whole optimizer step in one call (retool's train_step does, by one_call_per_step)"
            )
        output, _wire, _totals, scales = self._submit(
            datums, loss_fn, loss_config, forward_only=False, pending=pending
        )
        self._window += len(datums)
        server = server_metrics(output)
        learner = learner_logprobs(output, len(datums))
        result = local_metrics(datums, loss_fn, loss_config, learner, server, self.server_loss_key)
        result.extra["reduction_scale"] = sum(scales) / len(scales)
        return result

    async def forward_backward_async(
        self, datums: Sequence[Datum], loss_fn: LossName, loss_config: dict[str, float] | None = None
    ) -> ForwardBackwardResult:
        return await self.call_sdk(
            "forward_backward",
            self._forward_backward_sync,
            list(datums),
            loss_fn,
            loss_config,
            idempotent=False,
        )

    def _optim_step_sync(self, pending: PendingCall, adam: AdamParams) -> OptimStepResult:
        params = build_model(
            self._type("AdamParams"),
            self.sdk_label,
            learning_rate=adam.lr,
            beta1=adam.beta1,
            beta2=adam.beta2,
            eps=adam.eps,
            weight_decay=adam.weight_decay,
            grad_clip_norm=adam.grad_clip_norm,
        )
        self.started = True
        response = resolve(pending.hold(self.sdk_client.optim_step(params)), expect="metrics")
        self._window = 0
        self.step += 1
        return OptimStepResult(grad_norm=grad_norm_of(response), lr=adam.lr)

    async def optim_step_async(self, adam: AdamParams) -> OptimStepResult:
        return await self.call_sdk("optim_step", self._optim_step_sync, adam, idempotent=False)

    # -- checkpoints and samplers --------------------------------------------------------------
    def check_state_name(self, name: str) -> None:
        """Hook for services that restrict checkpoint names."""

    def _save_state_sync(self, pending: PendingCall, name: str) -> str:
        self.check_state_name(name)
        self.started = True
        response = resolve(pending.hold(self.sdk_client.save_state(name)), expect="path")
        path = response.path
        logger.info("%s: saved state %r at %s", self.sdk_name, name, path)
        return str(path)

    async def save_state_async(self, name: str) -> str:
        return await self.call_sdk("save_state", self._save_state_sync, name)

    def _load_state_sync(self, pending: PendingCall, path: str) -> None:
        """Weights and optimizer state from ``path``; each service has its own way (subclasses)."""
        raise NotImplementedError

    async def load_state_async(self, path: str) -> None:
        await self.call_sdk("load_state", self._load_state_sync, path)

    def _sampling_client_sync(self, pending: PendingCall) -> SamplingClient:
        self.started = True
        future = pending.hold(self.sdk_client.save_weights_and_get_sampling_client())
        return RemoteSamplingClient(self._sdk, resolve(future, expect="sample"), self)

    async def sampling_client_async(self) -> SamplingClient:
        """Saves the current weights as sampler weights on the service and returns a sampler over them."""
        return await self.call_sdk("sampling_client", self._sampling_client_sync)
