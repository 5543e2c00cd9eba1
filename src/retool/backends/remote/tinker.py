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

Faults: what the SDK does, and so what the adapter guarantees (see ``retool.backends.remote.calls``):

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
self-check confirms it on the live service. Masked positions get advantage 0 (and CE weight 0), and RL
datums carry an explicit 0/1 ``weights`` mask (``rl_weights``). A server whose forward pass reports no
loss metric (SkyRL) is checked by gradient norms on a scratch LoRA model (``scratch_sdk_client``), which
is unloaded afterwards.

Self-hosted Tinker-API servers (SkyRL 0.4.0's ``skyrl.tinker.api``, read from its code and run here):

- Resume: ``create_training_client_from_state_with_optimizer`` sends ``LoadWeightsRequest`` without
  ``model_id`` (tinker 0.38 lets the server derive it from ``session_id`` / ``model_seq_id``); SkyRL
  requires ``model_id`` and answers 422. SkyRL does accept ``load_weights`` as a model's first request,
  so on a 422 the adapter creates a fresh LoRA model with the run's settings and loads the checkpoint
  into it (``TrainingClient.load_state_with_optimizer``, deprecated in the SDK but still sent as the same
  ``LoadWeightsRequest``, now with ``model_id``). If that fails too, the error names the SDK, the server
  and what each attempt answered.
- Close: tinker 0.38 has no call that releases a model, and SkyRL has no ``/sessions/{id}/finish``
  (404), so a finished client's LoRA adapter would stay allocated until SkyRL's stale-session cleanup
  (``--session-timeout-sec``, 300 s by default) and the next clients would get ``400 Maximum number of
  LoRA adapters (N) reached``. SkyRL (and the Tinker API it copies) has ``POST /api/v1/unload_model``;
  closing sends it for every model this adapter created, through the SDK's own HTTP client (its
  credentials and base URL), and a 404 there (a server without it) is logged, not raised. A 404 on the
  session finish is a warning naming the missing endpoint; closing never fails a run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import warnings
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from retool.backends.interface.errors import BackendUnavailableError, sdk_label
from retool.backends.interface.types import ReductionMode
from retool.backends.remote.calls import PendingCall
from retool.backends.remote.common import RemoteTrainingClient
from retool.backends.remote.sdk import check_sdk_kwargs, import_sdk, local_tokenizer, resolve
from retool.retry import Failure, status_code_of

if TYPE_CHECKING:
    from retool.config import Config

logger = logging.getLogger(__name__)

# How long closing waits for the service to finish the session (the SDK retries a gone service for long).
CLOSE_TIMEOUT_S = 10.0
UNLOAD_ROUTE = "/api/v1/unload_model"


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
    rl_weights = True
    default_reduction: ReductionMode = "sum"
    server_loss_key = "loss:sum"

    def __init__(
        self,
        sdk: ModuleType,
        training_client: Any,
        *,
        service: Any = None,
        lora_request: dict[str, str | int | bool] | None = None,
        base_url: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(sdk, training_client, **kwargs)
        self._service = service
        self._lora_request = lora_request  # what a fresh model for a resume (or the gradient check) takes
        self._base_url = base_url
        self._created: list[Any] = []  # SDK training clients whose models closing unloads

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
        adapter: TinkerTrainingClient

        def create() -> Any:
            client = resolve(service.create_lora_training_client(**request), expect="forward_backward")
            adapter._created.append(client)
            return client

        adapter = cls(
            sdk,
            create,
            service=service,
            lora_request=request,
            base_url=base_url,
            base_model=config.model.name,
            tokenizer=local_tokenizer(config.model.name),
            max_context=config.model.max_context,
        )
        return adapter

    @property
    def server_label(self) -> str:
        return f"the server at {self._base_url or os.environ.get('TINKER_BASE_URL') or 'the default URL'}"

    # -- releasing models ------------------------------------------------------------------------
    def _unload(self, client: Any) -> None:
        """``POST /api/v1/unload_model`` for ``client``'s model through the SDK's own HTTP client (best
        effort: the SDK has no call for it; see the module docstring)."""
        model_id = getattr(client, "model_id", None)
        holder = getattr(client, "holder", None)
        if model_id is None or holder is None:
            return
        try:
            from tinker.lib.client_connection_pool_type import (
                ClientConnectionPoolType,
            )  # deferred: tinker is optional
        except ImportError:  # another SDK layout: no way to reach the route
            return

        async def post() -> object:
            with holder.aclient(ClientConnectionPoolType.TRAIN) as http:
                return await http.post(
                    UNLOAD_ROUTE, body={"model_id": model_id, "type": "unload_model"}, cast_to=object
                )

        try:
            holder.run_coroutine_threadsafe(post()).result(timeout=CLOSE_TIMEOUT_S)
            logger.info("tinker: unloaded model %s on %s", model_id, self.server_label)
        except Exception as exc:  # releasing is best effort: the service frees idle models itself
            if status_code_of(exc) == 404:
                logger.info(
                    "tinker: %s has no %s; model %s stays until it expires",
                    self.server_label,
                    UNLOAD_ROUTE,
                    model_id,
                )
            else:
                logger.warning("tinker: unloading model %s failed: %s", model_id, exc)

    def scratch_sdk_client(self) -> Any:
        if self._service is None or self._lora_request is None:
            raise NotImplementedError
        return resolve(
            self._service.create_lora_training_client(**self._lora_request), expect="forward_backward"
        )

    def release_sdk_client(self, client: Any) -> None:
        self._unload(client)

    async def close_async(self) -> None:
        """Unload this adapter's models where the server offers it, then finish the Tinker session: the
        SDK otherwise heartbeats it from a background thread until the process exits. Bounded, since a
        service that is gone would be retried for a long time; never raises."""
        created, self._created = self._created, []
        for client in created:
            await asyncio.to_thread(self._unload, client)
        service, self._service = self._service, None
        if service is None or not hasattr(service, "close"):
            return
        future = service.close("success")
        try:
            await asyncio.wait_for(future, timeout=CLOSE_TIMEOUT_S)
        except Exception as exc:  # closing is best effort: the run's results are already saved
            if status_code_of(exc) == 404:
                logger.warning(
                    "tinker: %s has no session-finish endpoint (404 on /api/v1/sessions/<id>/finish); the "
                    "session ends when its heartbeats stop",
                    self.server_label,
                )
            else:
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
        try:
            future = pending.hold(self._service.create_training_client_from_state_with_optimizer(path))
            client = resolve(future, expect="forward_backward")
        except Exception as exc:
            if status_code_of(exc) != 422:
                raise
            client = self._load_into_new_model(pending, path, exc)
        self._created.append(client)
        self._client = client
        self._factory = None
        self.started = False
        logger.info("tinker: training client %s loaded from %s", getattr(self._client, "model_id", "?"), path)

    def _load_into_new_model(self, pending: PendingCall, path: str, refused: Exception) -> Any:
        """The resume a server accepts when it refuses ``create_training_client_from_state_with_optimizer``
        (422: SkyRL requires the ``model_id`` that call leaves out): a fresh model with the run's LoRA
        settings, and the checkpoint loaded as its first request."""
        if self._lora_request is None:
            raise refused
        logger.warning(
            "tinker: %s refused create_training_client_from_state_with_optimizer (422: %s); loading %s into "
            "a new model instead",
            self.server_label,
            _short(refused),
            path,
        )
        client = None
        try:
            client = resolve(
                self._service.create_lora_training_client(**self._lora_request), expect="load_state"
            )
            with (
                warnings.catch_warnings()
            ):  # the SDK deprecates load_state*; it is the call this server takes
                warnings.simplefilter("ignore", FutureWarning)
                resolve(pending.hold(client.load_state_with_optimizer(path)))
        except Exception as exc:
            if client is not None:
                self._unload(client)
            raise BackendUnavailableError(
                f"{self.sdk_label}: {self.server_label} cannot resume from {path}: "
                f"create_training_client_from_state_with_optimizer was refused ({_short(refused)}) and "
                f"loading the checkpoint into a new model failed too ({type(exc).__name__}: {_short(exc)}). "
                f"Server version: {self._server_version()}. Use an SDK and server that agree on "
                "LoadWeightsRequest, or start the run afresh"
            ) from exc
        return client

    def _server_version(self) -> str:
        """What the server says about its version, for error messages (Tinker-API servers mostly say
        nothing: SkyRL's healthz answers ``{"status": "ok"}``)."""
        if not self._base_url:
            return "not known (no backend.base_url)"
        try:
            import httpx  # deferred: only for this message

            answer = httpx.get(f"{self._base_url.rstrip('/')}/api/v1/healthz", timeout=5)
            body = answer.text.strip()[:200]
            server = answer.headers.get("server", "?")
        except Exception as exc:  # the message must still come out
            return f"not known ({type(exc).__name__} on /api/v1/healthz)"
        return f"not reported (/api/v1/healthz answers {body!r}, server header {server!r})"


def _short(exc: BaseException, limit: int = 300) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "..."
