"""PyTRIO adapter (``backend.kind = "pytrio"``) over the ``pytrio`` SDK (optional extra).

Owns what is PyTRIO-specific: configuring the SDK (server, credentials), masking, the tokenizer hand-off,
checkpoint names and the load-before-training rule. Exercised through the real SDK against a local stub
service in the tests; never against the live service here.

SDK facts this relies on (pytrio 0.2.9, read from its code):

- Configuration is process-wide and read once, at import (``pytrio/config/config.py``): environment
  (``PYTRIO_API_KEY``, ``PYTRIO_BASE_URL``, ``PYTRIO_ENV``) over the profile files (``~/.pytrio/config.toml``,
  or ``~/.pytrio/envs/<name>/config.toml`` for a named environment chosen by ``PYTRIO_ENV`` or
  ``trio env use``). Setting an environment variable after the import changes nothing, so the adapter
  re-applies the SDK's own lookup with ``pytrio.configure`` (home, env, key) and then ``backend.base_url``.
- ``ServiceClient()`` logs in and opens a session inside its constructor; ``create_lora_training_client``
  returns the client itself (rank 4-64); ``forward``/``forward_backward``/``optim_step``/``save_state``/
  ``sample`` return futures; ``save_weights_and_get_sampling_client()`` blocks and returns a sampler.
- Targets equal to ``-100`` are ignored; RL losses take ``target_tokens``, ``logprobs``, ``advantages``;
  other keys are silently dropped, so datum weights are folded into the advantages.
- Every batch's token ids are checked against ``len(get_tokenizer(model_id))``, and ``get_tokenizer``
  downloads from ModelScope when the tokenizer is not cached: the adapter hands the SDK client its own.
- ``load_state*`` works only before the first training call (forward, optimizer step, save, sampler):
  the checkpoint is bound when the service starts the trainer. The adapter refuses a later call with a
  clear error instead of the SDK's.
- Checkpoint names must match ``^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9_-])?$``.

Faults: what the SDK does, and so what the adapter guarantees (see ``retool.backends.remote.calls``):

- Training calls (``forward_backward``, ``optim_step``, ``save_state``, the sampler refresh's weight save)
  are *events* on one ordered queue per training run (``transport/actor/training_run/coordinator.py``).
  Each event gets a random ``event_id`` once (``protocol/actor/events/event.py``); the SDK re-sends the same
  envelope on connection errors, timeouts and HTTP 408/429/500/502/503/504 for
  ``training_retry_timeout_seconds`` (default 15 min; ``transport/retry.py``,
  ``transport/actor/http_base.py``), and the Actor deduplicates by that id: a repeat is answered 409
  ``event_exists`` and the SDK polls the original event (``transport/actor/event/submit.py``: "event ID
  is the idempotency key"). That layer is the one that re-sends training calls, and it is safe.
- The event id cannot be chosen by the caller, and once a submission fails for good the coordinator marks
  the whole run broken: every later event raises ``PyTrioError(code="training.run_broken")``. So this
  layer never re-sends a training call (no ``dedupes_request_ids``), and there is no event that discards an
  accumulated gradient (no ``zero_grad_async``): after a failed submission the adapter reports a permanent
  failure that says to resume from the last checkpoint. A failed *poll* of an accepted event leaves the
  run alive, but the event may have been applied: an unknown outcome, which the guard does not re-send
  for ``forward_backward`` / ``optim_step``.
- Errors are ``PyTrioError`` subclasses with ``status_code``, ``code`` and ``retryable``. A request that got
  no HTTP answer (connection refused or reset, read timeout) is reported with ``status_code = 0`` and
  ``retryable = True`` (``http_base.py`` wraps the httpx error ``from None``), and a sample whose first
  chunk never came as ``code = "actor.sampling.first_chunk_timeout"``: the adapter restates both as
  unknown outcomes (``sdk_outcome``), so the guard re-sends samples on them. Real statuses (429, 503 ...)
  pass through. ``Retry-After`` is not kept by the SDK (its own retries ignore it too).
- Sampling requests (``transport/actor/sampling_run/sample.py``) change no state; the SDK retries them for
  ``sampling_retry_timeout_seconds`` and the guard re-sends them after that or after its own timeout.
  Cancelling the SDK's future (the guard's timeout) cancels the request's task and frees its slot.
- The SDK's retries are configured process-wide with ``pytrio.configure(...)`` and read when a client is
  created; nothing sets them per call, and the adapter leaves them as the user's profile has them.

Reduction: the SDK sends ``total_samples``, ``total_active_tokens`` and ``total_advantage_tokens`` with
every chunk and the server picks the denominator (undocumented). The adapter starts from
``active_tokens`` and the startup self-check (``retool.backends.training.reduction``) replaces the assumption with
the measured one. Use one ``forward_backward`` per call's worth of datums: the normalisation is per call.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from retool.backends.interface.errors import BackendUnavailableError, sdk_label
from retool.backends.interface.types import ReductionMode
from retool.backends.remote.calls import PendingCall
from retool.backends.remote.common import RemoteTrainingClient, StateOrderError
from retool.backends.remote.sdk import call_kwargs, import_sdk, local_tokenizer, resolve
from retool.retry import Failure

if TYPE_CHECKING:
    from retool.config import Config

logger = logging.getLogger(__name__)

NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9_-])?$")

# PyTrioError codes of a training run the SDK will not accept events for any more.
DEAD_RUN_CODES = frozenset({"training.run_broken", "training.run_closed"})


def configure_sdk(sdk: ModuleType, base_url: str | None) -> None:
    """Re-read the SDK's configuration from the current environment, as its import did, then apply
    ``base_url`` (``backend.base_url`` wins over ``PYTRIO_BASE_URL`` and the profile's server)."""
    configure = getattr(sdk, "configure", None)
    if configure is None:
        raise BackendUnavailableError("pytrio backend: this pytrio has no configure(); install pytrio>=0.2.9")
    env = {k: (os.environ.get(k) or "").strip() or None for k in ("PYTRIO_ENV", "PYTRIO_API_KEY")}
    # home= reloads the profile files (and the selected environment) the way the SDK does at import.
    configure(home=str(Path.home()), env=env["PYTRIO_ENV"], api_key=env["PYTRIO_API_KEY"])
    url = base_url or (os.environ.get("PYTRIO_BASE_URL") or "").strip() or None
    if url:
        configure(base_url=url)


def credential_problem(sdk: ModuleType) -> str | None:
    """Why the SDK has no usable API key (``None`` when it has one), by the SDK's own lookup."""
    try:
        state = importlib.import_module(f"{getattr(sdk, '__name__', 'pytrio')}.config.config")
        auth_state, configuration = state.auth_state, state.configuration
    except (ImportError, AttributeError):  # another SDK layout: fall back to the documented sources
        if os.environ.get("PYTRIO_API_KEY") or (Path.home() / ".pytrio" / "config.toml").is_file():
            return None
        return "no credentials"
    if auth_state.config_error is not None:
        return str(auth_state.config_error)
    if not auth_state.api_key:
        where = configuration.config_path
        return f"no API key in PYTRIO_API_KEY or {where}"
    return None


class PytrioTrainingClient(RemoteTrainingClient):
    sdk_name = "pytrio"
    mask_targets = True
    default_reduction: ReductionMode = "active_tokens"
    server_loss_key = "loss_sum"

    @classmethod
    def from_config(cls, config: Config, sdk: ModuleType | None = None) -> PytrioTrainingClient:
        sdk = sdk or import_sdk("pytrio", "pytrio")
        configure_sdk(sdk, config.backend.base_url)
        problem = credential_problem(sdk)
        if problem is not None:
            raise BackendUnavailableError(
                f"pytrio backend: {problem}; set PYTRIO_API_KEY, run `trio login`, "
                "or select an environment that has a key (PYTRIO_ENV / `trio env use`)"
            )
        rank = config.lora.rank
        if not 4 <= rank <= 64:
            raise ValueError(f"pytrio supports LoRA rank 4-64, config has lora.rank={rank}")
        service = sdk.ServiceClient()  # the key the SDK resolved above
        training = call_kwargs(
            service.create_lora_training_client, sdk_label(sdk), **cls.lora_request(config)
        )
        return cls(
            sdk,
            training,
            base_model=config.model.name,
            tokenizer=local_tokenizer(config.model.name),
            max_context=config.model.max_context,
        )

    def share_tokenizer(self, tokenizer: object) -> None:
        # The SDK sizes the vocabulary it validates token ids against with self.get_tokenizer(); on the
        # instance, ours shadows the method that would load (and maybe download) another copy.
        if hasattr(self._client, "get_tokenizer"):
            self._client.get_tokenizer = lambda: tokenizer

    def prepare_training_call(self) -> None:
        # Load the tokenizer through our property: the SDK would otherwise load it inside forward and
        # fail with a download error; ours says what to do.
        _ = self.tokenizer

    def sdk_outcome(self, exc: BaseException) -> tuple[Failure, str] | None:
        """See the module docstring (Faults). Only ``PyTrioError``s are read; names, not imports, since
        the SDK is optional."""
        names = {cls.__name__ for cls in type(exc).__mro__}
        if "PyTrioError" not in names:
            return None
        code = str(getattr(exc, "code", "") or "")
        if "ActorEventSubmitError" in names or code in DEAD_RUN_CODES:
            return (
                Failure.PERMANENT,
                "the SDK re-sent this request under the same event id for its whole retry window "
                "(training_retry_timeout_seconds), gave up and stopped this training run, so no later "
                "call on it can succeed; resume from the last checkpoint",
            )
        status = getattr(exc, "status_code", 0)
        if isinstance(status, int) and status > 0:
            return None  # a real HTTP status: retool.retry reads it
        no_answer = bool(getattr(exc, "retryable", False)) or code.endswith("_timeout")
        if no_answer or names & {"ActorEventGetError", "EventPollingError"}:
            return Failure.UNKNOWN, "no answer from the service after the SDK's own retries"
        return None

    def _load_state_sync(self, pending: PendingCall, path: str) -> None:
        if self.started:
            raise StateOrderError(
                "pytrio: load_state must come before any training call on this client (the service binds "
                "a checkpoint only when it starts the trainer, at the first forward, optimizer step, save "
                "or sampler); build a new client and load the state first, as a resumed run does"
            )
        loader = getattr(self.sdk_client, "load_state_with_optimizer", None) or self.sdk_client.load_state
        try:
            resolve(pending.hold(loader(path)))
        except Exception as exc:
            if getattr(exc, "code", "") == "validation.already_initialized":
                raise StateOrderError(f"pytrio: {exc}") from exc
            raise
        logger.info("pytrio: loaded state (weights and optimizer) from %s", path)

    def check_state_name(self, name: str) -> None:
        if not NAME_RE.match(name):
            raise ValueError(f"pytrio checkpoint name {name!r} must match {NAME_RE.pattern}")
