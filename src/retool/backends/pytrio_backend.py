"""PyTRIO adapter (``backend.kind = "pytrio"``) over the ``pytrio`` SDK (optional extra; not run live here).

SDK facts this relies on (pytrio 0.2.9, read from the wheel; see shared notes ``training-apis.md``):
``ServiceClient(api_key=None)`` logs in inside its constructor; ``create_lora_training_client`` returns the
client itself (rank 4-64); ``save_weights_and_get_sampling_client()`` blocks and returns a sampler;
``forward_backward`` / ``optim_step`` / ``save_state`` / ``sample`` return ``APIFuture`` (``.result()``);
targets equal to ``-100`` are ignored; RL losses take ``target_tokens``, ``logprobs``, ``advantages`` (other
keys are silently dropped, so per-token weights are folded into the advantages); checkpoint names must
match ``^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9_-])?$``; ``load_state`` works only before the first
training call. Credentials: ``PYTRIO_API_KEY`` or ``~/.pytrio/config.toml`` (``trio login``);
``PYTRIO_BASE_URL`` selects the server.

Reduction (an ASSUMPTION, not verified against the live service): the server normalises the summed
token loss by the batch-wide number of active tokens (targets that are not ``-100``), which is what its
``loss_mean = loss_sum / token_count`` metrics suggest. Our loop's weights already describe the mean over
trained datums, so the adapter multiplies every advantage (CE: weight) by that count to undo the division
(``reduction="tokens"``). If the server turns out to divide by the number of samples instead, use
``reduction="samples"``; ``"none"`` sends the weights unchanged. When the service reports both
``loss_sum`` and ``loss_mean``, their ratio is logged as ``server/denominator`` so a run can check the
assumption (it should equal ``reduction_scale``). Use one ``forward_backward`` per ``optim_step``: the
normalisation is per call.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from retool.backends.remote import (
    BackendUnavailableError,
    RemoteTrainingClient,
    call_kwargs,
    import_sdk,
)
from retool.backends.types import Datum, ForwardBackwardResult

if TYPE_CHECKING:
    from retool.config import Config

logger = logging.getLogger(__name__)

NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9_-])?$")
Reduction = Literal["tokens", "samples", "none"]


class PytrioTrainingClient(RemoteTrainingClient):
    sdk_name = "pytrio"
    mask_targets = True

    def __init__(
        self,
        sdk: Any,
        training_client: Any,
        *,
        base_model: str,
        tokenizer: Any = None,
        max_context: int | None = None,
        reduction: Reduction = "tokens",
    ) -> None:
        super().__init__(
            sdk, training_client, base_model=base_model, tokenizer=tokenizer, max_context=max_context
        )
        if reduction not in ("tokens", "samples", "none"):
            raise ValueError(f"unknown pytrio reduction {reduction!r}; use tokens, samples or none")
        self.reduction = reduction

    @classmethod
    def from_config(cls, config: Config, sdk: Any = None) -> PytrioTrainingClient:
        sdk = sdk or import_sdk("pytrio", "pytrio")
        api_key = os.environ.get("PYTRIO_API_KEY")
        if not api_key and not (Path.home() / ".pytrio" / "config.toml").is_file():
            raise BackendUnavailableError(
                "pytrio backend: no credentials; set PYTRIO_API_KEY or run `trio login`"
            )
        if config.backend.base_url:
            # The SDK reads its server from the environment; this process-wide setting is intentional.
            os.environ["PYTRIO_BASE_URL"] = config.backend.base_url
        rank = config.lora.rank
        if not 4 <= rank <= 64:
            raise ValueError(f"pytrio supports LoRA rank 4-64, config has lora.rank={rank}")
        return cls.from_lora_service(sdk, call_kwargs(sdk.ServiceClient, api_key=api_key), config)

    def reduction_scale(self, datums: Sequence[Datum], loss_fn: str) -> float:
        if self.reduction == "none":
            return 1.0
        if self.reduction == "samples":
            return float(len(datums))
        active = sum(sum(1 for w in (d.weights or [1.0] * len(d)) if w != 0) for d in datums)
        return float(max(active, 1))

    def _forward_backward_sync(
        self, datums: Sequence[Datum], loss_fn: str, loss_config: dict[str, float] | None
    ) -> ForwardBackwardResult:
        result = super()._forward_backward_sync(datums, loss_fn, loss_config)
        s = next((v for k, v in result.extra.items() if k.endswith(("loss:sum", "loss_sum"))), None)
        m = next((v for k, v in result.extra.items() if k.endswith(("loss:mean", "loss_mean"))), None)
        if s is not None and m:
            result.extra["server/denominator"] = s / m
        return result

    def check_state_name(self, name: str) -> None:
        if not NAME_RE.match(name):
            raise ValueError(f"pytrio checkpoint name {name!r} must match {NAME_RE.pattern}")
