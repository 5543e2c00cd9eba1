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

Reduction: Tinker documents a SUM over tokens and datums with no normalisation (its loss metric is
``loss:sum``), the local backend's semantics, so weights are folded into advantages unscaled; the startup
self-check confirms it on the live service. Masked positions get advantage 0 (and CE weight 0).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from retool.backends.reduction import ReductionMode
from retool.backends.remote import (
    BackendUnavailableError,
    RemoteTrainingClient,
    call_kwargs,
    import_sdk,
    local_tokenizer,
    resolve,
)

if TYPE_CHECKING:
    from retool.config import Config

logger = logging.getLogger(__name__)


def credential_problem() -> str | None:
    """Why the SDK would find no credential (``None`` when it would), by the SDK's own resolver."""
    try:
        from tinker.lib._auth_token_provider import resolve_auth_provider
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

    def __init__(self, sdk: Any, training_client: Any, *, service: Any = None, **kwargs: Any) -> None:
        super().__init__(sdk, training_client, **kwargs)
        self._service = service

    @classmethod
    def from_config(cls, config: Config, sdk: Any = None) -> TinkerTrainingClient:
        sdk = sdk or import_sdk("tinker", "tinker")
        problem = credential_problem()
        if problem is not None:
            raise BackendUnavailableError(f"tinker backend: {problem}")
        base_url = config.backend.base_url
        service = sdk.ServiceClient(base_url=base_url) if base_url else sdk.ServiceClient()
        request = cls.lora_request(config)
        return cls(
            sdk,
            lambda: call_kwargs(service.create_lora_training_client, **request),
            service=service,
            base_model=config.model.name,
            tokenizer=local_tokenizer(config.model.name),
            max_context=config.model.max_context,
        )

    def _load_state_sync(self, path: str) -> None:
        if self._service is None:
            raise BackendUnavailableError(
                "tinker: load_state builds a new training client from the checkpoint and needs the "
                "ServiceClient; build the adapter with TinkerTrainingClient.from_config"
            )
        if self._client is not None:
            logger.warning("tinker: replacing the current training client by one loaded from %s", path)
        self._client = resolve(
            self._service.create_training_client_from_state_with_optimizer(path), expect="forward_backward"
        )
        self._factory = None
        self.started = False
        logger.info("tinker: training client %s loaded from %s", getattr(self._client, "model_id", "?"), path)
