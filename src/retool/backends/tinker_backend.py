"""Tinker adapter (``backend.kind = "tinker"``) over the ``tinker`` SDK (optional extra; not run live here).

SDK facts this relies on (tinker 0.38; see shared notes ``training-apis.md``): creating a training client,
``create_sampling_client`` and ``save_weights_and_get_sampling_client`` may return *futures of clients*
(resolved here with ``.result()``); ``forward_backward(data, loss_fn, loss_fn_config)`` returns a future;
``SampledSequence`` has ``tokens``, optional ``logprobs`` and ``stop_reason`` ("length" / "stop"), no text;
``stop=None`` keeps EOS as a stop while an explicit list replaces it (so the adapter appends EOS to any
stop list); unknown ``loss_fn_inputs`` keys raise, so only ``target_tokens``, ``logprobs``, ``advantages``
(and ``weights`` for cross-entropy) are sent. Paths look like ``tinker://<run>/weights/<name>``.
Credentials: ``TINKER_API_KEY`` (``TINKER_BASE_URL`` or ``backend.base_url`` selects the server).

Reduction: Tinker SUMS the per-token loss over tokens and datums with no normalisation, exactly the
local backend's semantics, so weights are folded into advantages unscaled (``reduction_scale = 1``).
Masked positions get advantage 0 (and CE weight 0).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from retool.backends.remote import BackendUnavailableError, RemoteTrainingClient, import_sdk

if TYPE_CHECKING:
    from retool.config import Config

logger = logging.getLogger(__name__)


class TinkerTrainingClient(RemoteTrainingClient):
    sdk_name = "tinker"
    mask_targets = False

    @classmethod
    def from_config(cls, config: Config, sdk: Any = None) -> TinkerTrainingClient:
        sdk = sdk or import_sdk("tinker", "tinker")
        if not os.environ.get("TINKER_API_KEY"):
            raise BackendUnavailableError("tinker backend: no credentials; set TINKER_API_KEY")
        service_kwargs: dict[str, Any] = {}
        if config.backend.base_url:
            service_kwargs["base_url"] = config.backend.base_url
        return cls.from_lora_service(sdk, sdk.ServiceClient(**service_kwargs), config)
