"""Tinker adapter (``backend.kind = "tinker"``) over the ``tinker`` SDK (optional extra).

Owns what is Tinker-specific: credentials and server, futures of clients, resume from a checkpoint.
Exercised through the real SDK against a local stub service in the tests; never against the live service
here.

SDK facts this relies on (tinker 0.38.0, read from its code):

- ``ServiceClient(base_url=..., api_key=...)`` is lazy: the session starts with the first client it
  creates. Credentials: ``TINKER_API_KEY``, else ``TINKER_CREDENTIAL_CMD``, else the default key stored
  by ``tinker auth login`` in ``~/.tinker/credentials.json`` (``tinker/lib/_auth_token_provider.py``);
  the adapter asks that same resolver before starting anything. Keys start with ``tml-``.
- ``create_lora_training_client``, ``create_training_client_from_state_with_optimizer`` and
  ``save_weights_and_get_sampling_client`` return *futures of clients* that subclass the client classes
  (``BackcompatTrainingClientFuture``); using the wrapper as the client goes through deprecated
  forwarders that warn (``FutureWarning``) and are due for removal, so the adapter always calls
  ``.result()`` first.
- ``TrainingClient.load_state*`` is deprecated (``FutureWarning``): a resume builds a new training client
  from the checkpoint instead. The adapter creates its training client on first use, so a resumed run
  never creates (and pays for) a fresh LoRA model it would throw away.
- ``forward``/``forward_backward(data, loss_fn, loss_fn_config)`` return futures; the SDK sends them as
  protobuf. Unknown ``loss_fn_inputs`` keys are forwarded to the service unchecked, so only
  ``target_tokens``, ``logprobs``, ``advantages`` (and ``weights`` for cross-entropy) are sent.
- ``SampledSequence`` has ``tokens``, optional ``logprobs`` and ``stop_reason`` ("length" / "stop"), no
  text; ``stop=None`` keeps EOS as a stop while an explicit list replaces it (so the adapter appends EOS to
  any stop list). Paths look like ``tinker://<run>/weights/<name>``.

Faults: what the SDK does, and so what the adapter guarantees (see ``retool.backends.remote``):

- Every training request carries ``seq_id``, reserved once per call from the training client's counter
  (``lib/public_interfaces/training_client.py``: ``seq_id=request_id + 1``); the service orders a model's
  requests by it. The SDK re-sends ``forward_backward`` / ``optim_step`` with that same ``seq_id`` in two
  layers: the HTTP client's retries (``_base_client.py``: up to ``DEFAULT_MAX_RETRIES = 10``, 0.5-10 s
  backoff, ``Retry-After`` honoured, on connection errors, timeouts, 408/409/429/5xx; the same
  ``X-Idempotency-Key`` on each) and ``InternalClientHolder.execute_with_retries`` (the same request again
  for up to 5 minutes). A re-send is safe only because the service applies a ``seq_id`` once; the SDK's
  design relies on that, we cannot check it from the SDK's code, and the stub service here models it.
- Neither layer can be switched off through a public setting (``ServiceClient`` ignores unknown keyword
  arguments, the holder builds its HTTP clients with the default ``max_retries``, ``execute_with_retries``
  has no switch), and they are the safe re-senders: a call from here would reserve a *new* ``seq_id``,
  which the service cannot tell from a new micro-batch. So this layer never re-sends a training call
  (no ``dedupes_request_ids``), and there is no API that discards an accumulated gradient (no
  ``zero_grad_async``): an outcome still unknown once the SDK gives up stops the step.
- Errors: ``APIStatusError`` subclasses with ``status_code`` and ``response`` (``RateLimitError`` 429,
  ``InternalServerError`` 5xx ...), ``APIConnectionError`` / ``APITimeoutError`` without a response, all
  read correctly by ``retool.retry.classify``. A result the service lost (``RetryableException``, HTTP
  410 on the future) and a request it failed (``RequestFailedError``, ``category`` server or unknown) are
  restated as unknown outcomes (``sdk_outcome``); ``category`` user is permanent.
- Sampling: the SDK re-sends a sample in ``execute_with_retries`` (same ``seq_id``) and again through its
  ``RetryHandler`` (a new one); on 429 it backs off and re-sends without limit, and it polls a result
  future without limit, so a sample can wait for ever: the guard's ``retry.sample_timeout`` bounds it, and
  cancelling the SDK's future stops the SDK's task (and tells the service to stop the work, when the
  service enables that).

Reduction: Tinker documents a SUM over tokens and datums with no normalisation (its loss metric is
``loss:sum``), the local backend's semantics, so weights are folded into advantages unscaled; the startup
self-check confirms it on the live service. Masked positions get advantage 0 (and CE weight 0).
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from retool.backends.reduction import ReductionMode
from retool.backends.remote import (
    BackendUnavailableError,
    PendingCall,
    RemoteTrainingClient,
    check_sdk_kwargs,
    import_sdk,
    local_tokenizer,
    resolve,
    sdk_label,
)
from retool.retry import Failure

if TYPE_CHECKING:
    from retool.config import Config

logger = logging.getLogger(__name__)

# How long closing waits for the service to finish the session (the SDK retries a gone service for long).
CLOSE_TIMEOUT_S = 10.0


def credential_problem() -> str | None:
    """Why the SDK would find no credential (``None`` when it would), by the SDK's own resolver."""
    try:
        from tinker.lib._auth_token_provider import (
            resolve_auth_provider,
        )  # deferred: the tinker SDK is optional
    except ImportError:  # another SDK layout: check the documented sources ourselves
        stored = Path.home() / ".tinker" / "credentials.json"
        if os.environ.get("TINKER_API_KEY") or os.environ.get("TINKER_CREDENTIAL_CMD") or stored.is_file():
            return None
        return "no credentials (TINKER_API_KEY, TINKER_CREDENTIAL_CMD or `tinker auth login`)"
    try:
        resolve_auth_provider(None, enforce_cmd=False)  # reads the environment and the stored key only
    except Exception as exc:  # TinkerError: missing key, or a key without the tml- prefix
        return str(exc)
    return None


class TinkerTrainingClient(RemoteTrainingClient):
    sdk_name = "tinker"
    mask_targets = False
    default_reduction: ReductionMode = "sum"
    server_loss_key = "loss:sum"

    def __init__(self, sdk: ModuleType, training_client: Any, *, service: Any = None, **kwargs: Any) -> None:
        super().__init__(sdk, training_client, **kwargs)
        self._service = service

    @classmethod
    def from_config(cls, config: Config, sdk: ModuleType | None = None) -> TinkerTrainingClient:
        sdk = sdk or import_sdk("tinker", "tinker")
        problem = credential_problem()
        if problem is not None:
            raise BackendUnavailableError(f"tinker backend: {problem}")
        base_url = config.backend.base_url
        service = sdk.ServiceClient(base_url=base_url) if base_url else sdk.ServiceClient()
        request = cls.lora_request(config)
        # Checked now, not at the deferred creation: a setting this SDK cannot take fails before any work.
        check_sdk_kwargs(service.create_lora_training_client, sdk_label(sdk), **request)
        return cls(
            sdk,
            lambda: service.create_lora_training_client(**request),
            service=service,
            base_model=config.model.name,
            tokenizer=local_tokenizer(config.model.name),
            max_context=config.model.max_context,
        )

    async def close_async(self) -> None:
        """Finish the Tinker session: the SDK otherwise heartbeats it from a background thread until the
        process exits. Bounded, since a service that is gone would be retried for a long time."""
        service, self._service = self._service, None
        if service is None or not hasattr(service, "close"):
            return
        future = service.close("success")
        try:
            await asyncio.wait_for(future, timeout=CLOSE_TIMEOUT_S)
        except Exception as exc:  # closing is best effort: the run's results are already saved
            logger.warning("tinker: finishing the session failed: %s", exc)

    def sdk_outcome(self, exc: BaseException) -> tuple[Failure, str] | None:
        """See the module docstring (Faults); names, not imports, since the SDK is optional."""
        names = {cls.__name__ for cls in type(exc).__mro__}
        if "RetryableException" in names:
            return Failure.UNKNOWN, "the service lost the request's result"
        if "RequestFailedError" in names:
            category = str(getattr(exc, "category", "") or "").lower()
            if category == "user":
                return Failure.PERMANENT, "the service refused the request"
            return Failure.UNKNOWN, f"the service failed the request (category {category or '?'})"
        return None

    def _load_state_sync(self, pending: PendingCall, path: str) -> None:
        if self._service is None:
            raise BackendUnavailableError(
                "tinker: load_state builds a new training client from the checkpoint and needs the "
                "ServiceClient; build the adapter with TinkerTrainingClient.from_config"
            )
        if self._client is not None:
            logger.warning("tinker: replacing the current training client by one loaded from %s", path)
        future = pending.hold(self._service.create_training_client_from_state_with_optimizer(path))
        self._client = resolve(future, expect="forward_backward")
        self._factory = None
        self.started = False
        logger.info("tinker: training client %s loaded from %s", getattr(self._client, "model_id", "?"), path)
