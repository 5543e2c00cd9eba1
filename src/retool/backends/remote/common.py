"""Shared adapter logic for managed training services whose SDKs look like Tinker (``pytrio``, ``tinker``).

Owns what the two adapters have in common: turning our ``Datum`` into the services' loss inputs, scaling
them for the service's loss normalisation, resolving SDK futures, metrics, tokenizer hand-off, sampling,
and checkpoints, and how SDK calls are run and their failures reported for the retry guard (below). The
SDKs are optional imports; nothing here talks to a network until a client is built. Every SDK call is
synchronous-then-``.result()`` and runs on its own worker thread so the event loop stays free.

SDK futures are always resolved with ``.result()``: Tinker's futures *of clients* subclass the client
classes (``BackcompatTrainingClientFuture``), so using one as the client works only through deprecated
forwarders; we never stop at the wrapper.

How our ``Datum`` maps onto the services' loss inputs:

- RL losses (``ppo``, ``importance_sampling``) take no per-token weights on the services, so the datum
  weight is folded into the advantage: ``A' = w * A``. For ``w >= 0`` this is exact for both losses
  (``-min(r wA, clip(r) wA) = -w min(rA, clip(r) A)``); negative weights are refused.
  Positions with ``w = 0`` get advantage 0 (Tinker) and additionally target ``-100`` (PyTRIO, which
  counts every target that is not ``-100`` as an active token). Adapters with ``rl_weights`` (Tinker)
  also send explicit ``weights``: a 0/1 mask, 0 on prompt and observation tokens, so a service that
  counts weights (SkyRL divides each datum's loss by the sum of its weights, all ones when none are
  sent) never counts those tokens; a service that ignores them (Tinker documents none for RL losses,
  ``retool serve`` drops them) sees the same loss as before, the advantages being 0 there.
- ``cross_entropy`` sends ``weights`` directly.
- PPO thresholds go to ``loss_fn_config`` as ``clip_low_threshold`` / ``clip_high_threshold`` (ratios).
- Only these keys are sent: the real SDKs forward any other key to the service without checking it.
- Every advantage / CE weight is multiplied by the denominator the service divides by (see
  ``retool.backends.training.reduction``), so the gradient the loop gets is the one its weights describe (the mean
  over trained datums) whatever the service does with the sum. The adapter starts from the SDK's
  documented or assumed mode and adopts the one the startup self-check measures. Under a per-sequence
  mean (``sequence_mean``) each datum gets its own factor (its weight sum times the step's datum count),
  which holds only if the whole optimizer step is one ``forward_backward`` call: the adapter then says
  ``one_call_per_step`` (``retool.train.step.train_step`` reads it) and refuses a second call before
  ``optim_step``.

Metrics (loss, ratio stats, clip fraction) are computed client-side from the per-token learner logprobs
the service returns (``loss_fn_outputs[i]["logprobs"]``), with the same loss code as the local backend;
the service's own metrics are passed through in ``extra`` under ``server/``, and ``server/loss_ratio``
(service loss / local loss, 1 while the normalisation is right) is reported for every call whose loss is
not mostly cancellation.

Faults (timeouts, retries, idempotency). The trainer wraps these adapters in
``retool.backends.remote.guarded.GuardedTrainingClient``, which bounds every call by a per-call timeout and
retries transient failures by ``retool.retry``'s rule. What the adapters contribute:

- Every SDK call runs on a daemon thread of its own (``retool.retry.to_thread_with_timeout``), never in
  the event loop's shared pool: when the guard's timeout gives up on a call, the blocked thread can neither
  exhaust a pool nor hold up the interpreter's exit. The adapter then cancels the SDK's future, so the SDK
  stops its own retries and polling and frees what the call held (a PyTRIO sample slot, which a hung
  request otherwise keeps until the SDK's one-hour first-chunk timeout; a Tinker request turn).
- SDK exceptions propagate unchanged where ``retool.retry.classify`` reads them right (HTTP status,
  ``response`` with ``Retry-After``, ``APIConnectionError`` ...). Where it cannot, they are restated as
  ``RemoteCallError`` (chained with ``from``, keeping status and ``Retry-After``) with the outcome the
  guard must assume: each SDK's own rules (``sdk_outcome``: PyTRIO reports "no HTTP answer" as status 0;
  a PyTRIO training run is dead after one failed event submission), and for ``forward_backward`` /
  ``optim_step`` never "not sent": both SDKs re-send those calls themselves before they give up, so a final
  429 says nothing about the earlier attempts.
- Idempotency: neither service lets *this* layer re-send a training call safely. Both SDKs re-send it
  under an idempotency id of their own (PyTRIO: the event id; Tinker: the per-client ``seq_id``) that a
  new call from here cannot reuse, and neither service can discard an accumulated gradient. So the
  adapters declare no request dedupe (``dedupes_request_ids = False``) and no ``zero_grad_async``, and the
  guard applies its third rule: only the SDK re-sends ``forward_backward`` / ``optim_step``; an outcome
  still unknown after that stops the step (``optim_step`` refuses the doubtful gradient) and the run
  resumes from its last checkpoint. Sampling, checkpoints and sampler refreshes are re-sent by the guard.
  The SDK facts behind this are in ``retool.backends.remote.pytrio`` and ``retool.backends.remote.tinker``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import importlib
import importlib.metadata
import inspect
import logging
import math
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar, TypeVarTuple

import torch

from retool.backends.interface.clients import SamplingClient, TrainingClient
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
from retool.backends.training.losses import LOSS_NAMES, LossTally, clip_thresholds, tis_cap, token_loss
from retool.backends.training.reduction import (
    IGNORE_INDEX,
    REDUCTION_MODES,
    BatchTotals,
    LossProbe,
    ReductionMode,
    ReductionReport,
    UnweightableLossError,
    WireDatum,
    batch_totals,
    datum_scales,
    sequence_mean,
    verify_reduction,
)
from retool.retry import Failure, classify, retry_after_of, status_code_of, to_thread_with_timeout

# The losses this adapter folds the training loop's weights into and mirrors locally for its metrics.
REMOTE_LOSSES = ("ppo", "importance_sampling", "cross_entropy")

if TYPE_CHECKING:
    from retool.config import Config

logger = logging.getLogger(__name__)

T = TypeVar("T")
Args = TypeVarTuple("Args")

__all__ = [
    "IGNORE_INDEX",
    "BackendUnavailableError",
    "RemoteCallError",
    "RemoteSamplingClient",
    "RemoteTrainingClient",
    "SdkOptionError",
    "StateOrderError",
    "resolve",
]


class StateOrderError(RuntimeError):
    """``load_state`` was called after training started on a service that loads state only at start."""


class RemoteCallError(RuntimeError):
    """An SDK failure restated for the retry guard: ``outcome`` is what ``retool.retry.classify`` must
    assume (the SDK's own exception, with the details, is the ``__cause__``)."""

    def __init__(
        self,
        message: str,
        *,
        outcome: Failure,
        status_code: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.status_code = status_code
        self.retry_after = retry_after


def cancel_future(obj: object) -> None:
    """Best effort: stop the SDK's work on a call nobody waits for any more.

    Tinker's futures hand out their ``concurrent.futures.Future`` through ``.future()`` (cancelling it
    cancels the SDK's task: its retries, its polling, its request turn); PyTRIO's have ``.cancel()``.
    Methods are looked up on the type so Tinker's future-of-client wrappers never forward to the client.
    """
    kind = type(obj)
    try:
        if callable(getattr(kind, "future", None)):
            inner = getattr(obj, "future")()  # noqa: B009 - looked up on the type above
            if isinstance(inner, concurrent.futures.Future):
                inner.cancel()
                return
        if callable(getattr(kind, "cancel", None)):
            getattr(obj, "cancel")()  # noqa: B009 - looked up on the type above
    except Exception:  # a courtesy to the SDK: the call's outcome is already "unknown" to the caller
        logger.debug("could not cancel an abandoned SDK future %r", obj, exc_info=True)


class PendingCall:
    """The SDK future of one call in flight, cancelled if the caller stops waiting (the guard's timeout).

    The worker thread ``hold``s the future as soon as the SDK returns it; ``abandon`` comes from the event
    loop. Whichever comes second cancels, so a future handed over after the timeout is cancelled too.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._future: object = None
        self._abandoned = False

    def hold(self, future: T) -> T:
        with self._lock:
            self._future = future
            abandoned = self._abandoned
        if abandoned:
            cancel_future(future)
        return future

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            future = self._future
        if future is not None:
            cancel_future(future)


def import_sdk(module: str, extra: str) -> ModuleType:
    # pytrio replaces sys.excepthook when imported; the CLI's own error reporting must survive that.
    hook = sys.excepthook
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"backend '{module}' needs the '{module}' SDK, which is not installed: "
            f"pip install 'retool-rl[{extra}]' (or set backend.kind=local)"
        ) from exc
    finally:
        sys.excepthook = hook


def resolve(obj: object, expect: str | None = None) -> Any:
    """Wait for an SDK future: call ``.result()`` until the object has none, then check it has ``expect``.

    Never stops early because the object already looks like the client: Tinker's future-of-client
    wrappers subclass the client, and every call through them is a deprecated forwarder.
    """
    for _ in range(4):
        result = getattr(obj, "result", None)
        if not callable(result):
            break
        obj = result()
    if expect is not None and not hasattr(obj, expect):
        raise TypeError(f"SDK returned {type(obj).__name__}, expected an object with .{expect}")
    return obj


def check_sdk_kwargs(fn: Callable[..., object], sdk: str, **kwargs: object) -> None:
    """Refuse a keyword ``fn`` does not declare: each one carries a setting, and dropping it would train
    with another one than the config says. ``SdkOptionError`` names them and the SDK version ``sdk``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a C function): the call itself will say
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [f"{k}={v!r}" for k, v in kwargs.items() if k not in params]
    if unknown:
        raise SdkOptionError(
            f"{sdk}: {getattr(fn, '__qualname__', fn)} takes no {', '.join(unknown)}; this SDK version "
            "cannot apply that setting. Upgrade the SDK, or change the config so it is not needed"
        )


def call_kwargs(fn: Callable[..., T], sdk: str, **kwargs: object) -> T:
    """``fn(**kwargs)`` after ``check_sdk_kwargs``: no keyword is ever dropped on the way."""
    check_sdk_kwargs(fn, sdk, **kwargs)
    return fn(**kwargs)


_ALIASES = {"learning_rate": ("lr",), "grad_clip_norm": ("grad_clip",)}


def build_model(cls: Callable[..., T], sdk: str, **kwargs: object) -> T:
    """Construct an SDK pydantic type: known aliases are renamed (``learning_rate`` -> ``lr``) where the
    version has the other name; a field it lacks is an ``SdkOptionError`` naming it and the SDK version
    ``sdk``, unless its value is ``None`` (not set: nothing is lost)."""
    fields = getattr(cls, "model_fields", None)
    if not fields:
        return cls(**kwargs)
    out: dict[str, object] = {}
    missing: list[str] = []
    for key, value in kwargs.items():
        name = key if key in fields else next((a for a in _ALIASES.get(key, ()) if a in fields), None)
        if name is not None:
            out[name] = value
        elif value is not None:
            missing.append(f"{key}={value!r}")
    if missing:
        raise SdkOptionError(
            f"{sdk}: {getattr(cls, '__name__', cls)} has no field for {', '.join(missing)}; this SDK "
            "version cannot apply that setting. Upgrade the SDK, or change the config so it is not needed"
        )
    return cls(**out)


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


def grad_norm_of(response: object) -> float:
    """The gradient norm an ``optim_step`` answer reports (``grad_norm:mean``, SkyRL's
    ``skyrl.ai/grad_norm``, ...), NaN when it reports none."""
    metrics = dict(getattr(response, "metrics", None) or {})
    return next((float(v) for k, v in metrics.items() if "grad_norm" in k), math.nan)


def normalize_stop_reason(reason: object) -> str:
    text = str(getattr(reason, "value", reason) or "").lower()
    return "length" if ("length" in text or "max" in text) else "stop"


# The layer groups the managed services train LoRA on, each as one switch; a group's modules under the
# names models use (separate or fused projections).
_LORA_GROUPS: dict[str, tuple[frozenset[str], ...]] = {
    "train_attn": (frozenset({"q_proj", "k_proj", "v_proj", "o_proj"}), frozenset({"qkv_proj", "o_proj"})),
    "train_mlp": (frozenset({"gate_proj", "up_proj", "down_proj"}), frozenset({"gate_up_proj", "down_proj"})),
    "train_unembed": (frozenset({"lm_head"}),),
}


def lora_flags(target_modules: Sequence[str]) -> dict[str, bool]:
    """The services' switches for ``lora.target_modules``. They train whole groups of layers, so a list
    that names part of a group, or a module in none, cannot be sent as it is: ``SdkOptionError``."""
    names = {m.split(".")[-1] for m in target_modules}
    known = set().union(*(s for sets in _LORA_GROUPS.values() for s in sets))
    flags = {flag: bool(names & set().union(*sets)) for flag, sets in _LORA_GROUPS.items()}
    partial = [
        flag for flag, sets in _LORA_GROUPS.items() if flags[flag] and not any(s <= names for s in sets)
    ]
    if names - known or partial or not any(flags.values()):
        groups = "; ".join(f"{flag}: {' + '.join(sorted(sets[0]))}" for flag, sets in _LORA_GROUPS.items())
        raise SdkOptionError(
            f"lora.target_modules = {sorted(names)} cannot be trained on a managed service, which trains "
            f"whole layer groups ({groups}); name every module of the groups to train"
            + (f" (not a group's: {sorted(names - known)})" if names - known else "")
        )
    return flags


def local_tokenizer(model_name: str) -> Any:
    """The model's tokenizer if it is on this machine (a local folder, or the Hugging Face cache), else
    ``None``. Never downloads: the SDKs would fetch it themselves, and offline runs must not try."""
    from transformers import AutoTokenizer  # deferred: transformers (~3 s) only when a client is built

    if Path(model_name).is_dir():
        return AutoTokenizer.from_pretrained(model_name)
    try:
        return AutoTokenizer.from_pretrained(model_name, local_files_only=True)
    except Exception:  # not cached (OSError), or not a Hub id at all (ValueError, HFValidationError)
        return None


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
            lps = [float(x) for x in _to_list(getattr(seq, "logprobs", None))]
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


class RemoteTrainingClient(TrainingClient):
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
        self.reduction_verified = False  # set by ``check_reduction_async``
        mode = reduction or self.default_reduction
        if mode not in REDUCTION_MODES:
            raise ValueError(f"unknown reduction {mode!r}; use one of {', '.join(REDUCTION_MODES)}")
        self._default_mode: ReductionMode = mode
        self._modes: dict[str, ReductionMode] = {}
        self._window = 0  # datums sent by forward_backward since the last optim_step
        if tokenizer is not None:
            self.tokenizer = tokenizer

    # -- running SDK calls ---------------------------------------------------------------------
    async def call_sdk(
        self, what: str, fn: Callable[[PendingCall, *Args], T], *args: *Args, idempotent: bool = True
    ) -> T:
        """Run the blocking SDK call ``fn(pending, *args)`` on its own daemon thread.

        No timeout here: the guard's per-call timeout cancels this await, and then the SDK's future that
        ``fn`` handed to ``pending`` is cancelled. Failures are re-raised as ``restate`` says.
        """
        pending = PendingCall()
        try:
            return await to_thread_with_timeout(
                fn, pending, *args, timeout=None, what=f"{self.sdk_name} {what}"
            )
        except asyncio.CancelledError:
            pending.abandon()
            raise
        except Exception as exc:
            restated = self.restate(exc, what, idempotent=idempotent)
            if restated is exc:
                raise
            raise restated from exc

    def sdk_outcome(self, exc: BaseException) -> tuple[Failure, str] | None:
        """Hook: the outcome of a failed call where this SDK's exception misleads ``classify``, and why;
        ``None`` to let ``classify`` read it."""
        return None

    def restate(self, exc: Exception, what: str, *, idempotent: bool) -> Exception:
        """``exc`` as the retry guard must read it: unchanged when ``classify`` reads it right, else a
        ``RemoteCallError`` stating the outcome (see the module docstring)."""
        told = self.sdk_outcome(exc)
        outcome, why = told if told is not None else (classify(exc), "")
        if not idempotent and self.sdk_resends_training_calls and outcome is Failure.NOT_SENT:
            # The last attempt was refused, but the SDK re-sent the call before: an earlier attempt may
            # have been applied, and a call from here would carry a new idempotency id.
            outcome = Failure.UNKNOWN
            why = "the SDK re-sent it before giving up, so an earlier attempt may have been applied"
        if told is None and outcome is classify(exc):
            return exc
        status = status_code_of(exc)
        return RemoteCallError(
            f"{self.sdk_name} {what}: {why} ({type(exc).__name__}: {exc})",
            outcome=outcome,
            status_code=status if status and status > 0 else None,
            retry_after=retry_after_of(exc),
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

    # -- reduction -----------------------------------------------------------------------------
    def reduction_for(self, loss_fn: str) -> ReductionMode:
        """The denominator this adapter assumes the service divides ``loss_fn`` by."""
        return self._modes.get(loss_fn, self._default_mode)

    def set_reduction(self, loss_fn: str, mode: ReductionMode) -> None:
        if mode not in REDUCTION_MODES:
            raise ValueError(f"unknown reduction {mode!r}; use one of {', '.join(REDUCTION_MODES)}")
        self._modes[loss_fn] = mode

    async def check_reduction_async(
        self, loss_fn: str, loss_config: dict[str, float] | None = None
    ) -> list[ReductionReport]:
        """Verify (once per client) how the service normalises ``loss_fn`` and adopt it, or raise
        ``ReductionCheckError`` (``retool.backends.training.reduction``)."""
        if self.reduction_verified:
            return []
        reports = await asyncio.to_thread(verify_reduction, self, loss_fn, loss_config)
        self.reduction_verified = True
        return reports

    @property
    def one_call_per_step(self) -> bool:
        """True when an optimizer step must be one ``forward_backward`` call: under ``sequence_mean`` the
        service divides the step's gradient by the number of datums it accumulated, which each datum's
        scale must know when it is sent."""
        return "sequence_mean" in (self._default_mode, *self._modes.values())

    def reduction_scales(self, wire: Sequence[WireDatum], totals: BatchTotals, loss_fn: str) -> list[float]:
        """Factor per datum applied to advantages / CE weights so the service's reduction yields the loop's
        sum (``retool.backends.training.reduction.datum_scales``)."""
        mode = self.reduction_for(loss_fn)
        if mode == "sequence_mean" and loss_fn == "cross_entropy":
            raise UnweightableLossError(
                f"{self.sdk_name}: the service reduces the loss per sequence, where a cross-entropy datum's "
                "weights cancel: its gradient cannot be weighted back to the loop's sum. Train an RL loss "
                "on this service, or cross-entropy on the local backend"
            )
        return datum_scales(wire, totals, mode)

    # -- conversion ----------------------------------------------------------------------------
    def to_wire(self, d: Datum, loss_fn: str) -> WireDatum:
        """What the service will see for ``d`` (masking and weight folding done, reduction not yet)."""
        n = len(d)
        w = list(d.weights) if d.weights else [1.0] * n
        targets = [int(t) for t in d.target_tokens]
        if self.mask_targets:
            targets = [t if wi != 0 else IGNORE_INDEX for t, wi in zip(targets, w, strict=True)]
        inputs = [int(t) for t in d.input_tokens]
        if loss_fn == "cross_entropy":
            return WireDatum(inputs, targets, weights=[float(wi) for wi in w])
        if any(wi < 0 for wi in w):
            raise ValueError(f"{self.sdk_name}: negative datum weights cannot be folded into advantages")
        adv = [float(a) * float(wi) if wi != 0 else 0.0 for a, wi in zip(d.advantages, w, strict=True)]
        lps = [float(x) if wi != 0 else 0.0 for x, wi in zip(d.logprobs, w, strict=True)]
        mask = [1.0 if wi != 0 else 0.0 for wi in w] if self.rl_weights else None
        return WireDatum(inputs, targets, weights=mask, logprobs=lps, advantages=adv)

    def to_sdk_datum(self, w: WireDatum, scale: float) -> Any:
        inputs: dict[str, object] = {"target_tokens": self.tensor(w.targets, "int64")}
        rl = w.logprobs is not None and w.advantages is not None
        if w.weights is not None:  # CE weights carry the scale; an RL mask stays 0/1
            inputs["weights"] = self.tensor([x if rl else x * scale for x in w.weights], "float32")
        if w.logprobs is not None and w.advantages is not None:
            inputs["logprobs"] = self.tensor(w.logprobs, "float32")
            inputs["advantages"] = self.tensor([a * scale for a in w.advantages], "float32")
        return self._type("Datum")(model_input=self.model_input(w.input_tokens), loss_fn_inputs=inputs)

    # -- training ------------------------------------------------------------------------------
    def _validate(self, datums: Sequence[Datum], loss_fn: str) -> None:
        if loss_fn not in REMOTE_LOSSES:
            raise ValueError(
                f"unknown loss_fn {loss_fn!r} for a remote service; known: {', '.join(REMOTE_LOSSES)} "
                f"({', '.join(n for n in LOSS_NAMES if n not in REMOTE_LOSSES)}: the local backend only)"
            )
        if not datums:
            raise ValueError("forward_backward needs at least one datum")
        for k, d in enumerate(datums):
            if len(d) == 0:
                raise ValueError(f"datum {k} is empty")
            if loss_fn != "cross_entropy" and (len(d.logprobs) != len(d) or len(d.advantages) != len(d)):
                raise ValueError(
                    f"datum {k}: loss {loss_fn!r} needs logprobs and advantages for every position"
                )

    def _server_metrics(self, output: object) -> dict[str, float]:
        return {
            f"server/{k}": float(v)
            for k, v in dict(getattr(output, "metrics", None) or {}).items()
            if isinstance(v, int | float)
        }

    def _learner_logprobs(self, output: object, n: int) -> list[list[float]] | None:
        outs = list(getattr(output, "loss_fn_outputs", None) or [])
        if len(outs) != n:
            return None
        lps = []
        for o in outs:
            value = o.get("logprobs") if isinstance(o, dict) else getattr(o, "logprobs", None)
            lps.append([float(x) for x in _to_list(value)])
        return lps

    def _metrics(
        self,
        datums: Sequence[Datum],
        loss_fn: str,
        loss_config: dict[str, float] | None,
        learner: list[list[float]] | None,
        server: dict[str, float],
    ) -> ForwardBackwardResult:
        if learner is None:
            logger.warning(
                "service returned no per-datum logprobs for %d datums; metrics from server only", len(datums)
            )
            trained = sum(sum(1 for w in (d.weights or [1.0] * len(d)) if w != 0) for d in datums)
            loss = server.get(f"server/{self.server_loss_key}", math.nan)
            return ForwardBackwardResult(loss=loss, trained_tokens=trained, extra=server)
        tally = LossTally()
        magnitude = 0.0  # sum of |per-token loss|: how much of the total could be cancellation
        for d, values in zip(datums, learner, strict=True):
            lp = torch.tensor(values, dtype=torch.float64)
            n = len(d)
            w = torch.tensor(d.weights if d.weights else [1.0] * n, dtype=torch.float64)
            old = torch.tensor(d.logprobs, dtype=torch.float64) if d.logprobs else None
            adv = torch.tensor(d.advantages, dtype=torch.float64) if d.advantages else None
            tl = token_loss(loss_fn, lp, w, old, adv, loss_config)
            tally.add(tl)
            magnitude += float(tl.loss.abs().sum())
        result = tally.result(server)
        reported = server.get(f"server/{self.server_loss_key}")
        # The service's loss over ours: 1 while the adapter's normalisation is the service's. Skipped when
        # the loss is mostly cancellation (on-policy RL with centred advantages sums to ~0): noise.
        if reported is not None and abs(result.loss) > 1e-3 * magnitude > 0:
            result.extra["server/loss_ratio"] = reported / result.loss
        return result

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
        self._validate(datums, loss_fn)
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
        server = self._server_metrics(output)
        learner = self._learner_logprobs(output, len(datums))
        result = self._metrics(datums, loss_fn, loss_config, learner, server)
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

    def probe_loss(
        self, datums: Sequence[Datum], loss_fn: str, loss_config: dict[str, float] | None = None
    ) -> LossProbe:
        """A forward pass (no gradient) with unscaled weights: the service's loss and ours, for the
        reduction self-check."""
        output, wire, totals, _ = self._submit(datums, loss_fn, loss_config, forward_only=True, scale=1.0)
        learner = self._learner_logprobs(output, len(datums))
        metrics = self._server_metrics(output)
        if learner is None:
            raise RuntimeError(
                f"{self.sdk_name}: the forward pass returned no per-datum logprobs (metrics: "
                f"{sorted(metrics) or 'none'}); cannot tell how the service normalises the loss"
            )
        server = metrics.get(f"server/{self.server_loss_key}")
        per_datum = [
            self._metrics([d], loss_fn, loss_config, [lps], {}).loss
            for d, lps in zip(datums, learner, strict=True)
        ]
        # Only an adapter that sends RL weights knows the per-datum weight sums a per-sequence service
        # divides by (PyTRIO's SDK drops them), so only it may adopt ``sequence_mean``.
        sequence = sequence_mean(per_datum, wire) if self.rl_weights else None
        return LossProbe(sum(per_datum), server, totals, learner, sequence)

    def scratch_sdk_client(self) -> Any:
        """Hook: a new SDK training client (a LoRA model of its own) for the gradient check, or
        ``NotImplementedError`` where the adapter cannot make one."""
        raise NotImplementedError

    def release_sdk_client(self, client: Any) -> None:
        """Hook: free a model made by ``scratch_sdk_client`` (best effort)."""

    def probe_gradient_norms(
        self, forward: Datum, build: Callable[[list[float]], list[list[Datum]]], loss_fn: str
    ) -> list[float]:
        """The gradient check's measurements (``retool.backends.training.reduction.verify_by_gradients``), on a
        scratch model: the adapter's own model and optimizer state are never touched."""
        try:
            scratch = self.scratch_sdk_client()
        except NotImplementedError:
            raise RuntimeError(
                f"{self.sdk_name}: the service reports no loss metric and this adapter cannot create a scratch "
                "model to measure gradients on; cannot tell how the service normalises the loss"
            ) from None
        try:
            output, *_ = self._submit(
                [forward], "cross_entropy", None, forward_only=True, scale=1.0, client=scratch
            )
            learner = self._learner_logprobs(output, 1)
            if learner is None:
                raise RuntimeError(f"{self.sdk_name}: the scratch model's forward pass returned no logprobs")
            adam = build_model(self._type("AdamParams"), self.sdk_label, learning_rate=0.0, weight_decay=0.0)
            norms = []
            for batch in build(learner[0]):
                self._submit(batch, loss_fn, None, forward_only=False, scale=1.0, client=scratch)
                norms.append(grad_norm_of(resolve(scratch.optim_step(adam), expect="metrics")))
            return norms
        finally:
            self.release_sdk_client(scratch)

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
