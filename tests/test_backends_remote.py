"""The PyTRIO and Tinker adapters through the real SDK packages, against local stub services.

Every test here runs the installed ``pytrio`` / ``tinker`` SDK unmodified (request objects, futures,
serialisation, configuration, credential lookup) against ``sdk_stubs`` servers on 127.0.0.1, and reads
what the SDK actually put on the wire. Fake modules remain only where no server is involved (a missing
SDK, ``build_model``'s field mapping).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import inspect
import json
import logging
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import pytrio
import pytrio.client.training
import tinker

from retool.backends import make_training_client
from retool.backends.interface.clients import TrainingClient
from retool.backends.interface.types import AdamParams, Datum, SamplingParams
from retool.backends.remote.common import (
    BackendUnavailableError,
    RemoteTrainingClient,
    SdkOptionError,
    StateOrderError,
)
from retool.backends.remote.guarded import GuardedTrainingClient
from retool.backends.training.reduction import (
    ReductionCheckError,
    batch_totals,
    probe_datums,
)
from retool.config import Config, load_config
from retool.retry import RetryPolicy
from sdk_stubs import (
    PYTRIO_KEY,
    TINKER_KEY,
    PytrioStub,
    StubServer,
    TinkerStub,
    learner_lp,
    sampled_tokens,
)

KINDS = ("pytrio", "tinker")
PPO = {"clip_low": 0.8, "clip_high": 1.28}

# -- fixtures -----------------------------------------------------------------------------------------


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty HOME and no SDK variables; quick SDK retries so a wrong address fails fast."""
    folder = tmp_path / "home"
    folder.mkdir()
    monkeypatch.setenv("HOME", str(folder))
    for var in (
        "PYTRIO_API_KEY",
        "PYTRIO_BASE_URL",
        "PYTRIO_ENV",
        "TINKER_API_KEY",
        "TINKER_BASE_URL",
        "TINKER_CREDENTIAL_CMD",
        "TINKER_PROJECT_ID",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    pytrio.configure_observability(enabled=False)
    pytrio.configure(
        retry_max_attempts=1,
        control_retry_timeout_seconds=2,
        training_retry_timeout_seconds=2,
        sampling_retry_timeout_seconds=2,
    )
    return folder


def make_stub(kind: str, reduction: str | None = None) -> StubServer:
    if kind == "pytrio":
        return PytrioStub(reduction or "active_tokens")
    return TinkerStub(reduction or "sum")


def make_cfg(kind: str, tok: Path | str, *extra: str, base_url: str | None = None) -> Config:
    overrides = [f'backend.kind="{kind}"', f'model.name="{tok}"', "lora.rank=16", "train.seed=7", *extra]
    if base_url:
        overrides.append(f'backend.base_url="{base_url}"')
    return load_config(None, overrides)


def set_key(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    if kind == "pytrio":
        monkeypatch.setenv("PYTRIO_API_KEY", PYTRIO_KEY)
    else:
        monkeypatch.setenv("TINKER_API_KEY", TINKER_KEY)


def shutdown(client: Any) -> None:
    """End the SDK's session while the stub still answers (the SDKs close sessions on exit/GC)."""
    runtime = getattr(client._client, "_runtime", None)  # pytrio
    if runtime is not None:
        runtime.shutdown()
    service = getattr(client, "_service", None)  # tinker
    if service is not None and service._session_holder is not None:
        service.close("success").result(timeout=10)


@dataclass
class Remote:
    kind: str
    client: Any
    stub: Any

    def calls(self, forward_only: bool | None = None) -> list[Any]:
        return [c for c in self.stub.calls if forward_only is None or c.forward_only == forward_only]


@pytest.fixture(params=KINDS)
def remote(
    request: pytest.FixtureRequest, home: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Remote]:
    kind = request.param
    set_key(monkeypatch, kind)
    with make_stub(kind) as stub:
        client = make_training_client(make_cfg(kind, tok_dir, base_url=stub.url))
        yield Remote(kind, client, stub)
        shutdown(client)
        assert stub.errors == []


def _datums() -> list[Datum]:
    """Prompt positions weight 0; two trajectories with opposite advantages; loop weights 1/n_tok/n_datums;
    sampler logprobs 0.3 off the learner's either way so PPO clips some tokens."""
    out = []
    for adv, toks in ((1.0, [5, 6, 7, 8, 9]), (-0.5, [5, 6, 13, 14])):
        n = len(toks) - 1
        n_prompt = 2
        n_tr = n - n_prompt
        w = [0.0] * n_prompt + [1.0 / n_tr / 2] * n_tr
        old = [0.0] * n_prompt + [
            learner_lp(t) + (0.3 if j % 2 == 0 else -0.3) for j, t in enumerate(toks[1 + n_prompt :])
        ]
        out.append(Datum(toks[:-1], toks[1:], old, [0.0] * n_prompt + [adv] * n_tr, w))
    return out


def _mixed_datums() -> list[Datum]:
    """``_datums`` plus one with a trained position whose advantage is 0: active, not an advantage token."""
    extra = Datum([3, 4, 5], [4, 5, 6], [0.0, -0.4, -0.5], [0.0, 0.0, 1.0], [0.0, 1.0, 1.0])
    return [*_datums(), extra]


# -- creation, server, futures ------------------------------------------------------------------------


def test_client_is_the_real_sdk_client_on_the_configured_server(remote: Remote) -> None:
    client = remote.client
    sdk_client = client.sdk_client
    # A future of a client is resolved: the Tinker wrapper subclasses the client, we must not stop there.
    expected = pytrio.TrainingClient if remote.kind == "pytrio" else tinker.TrainingClient
    assert type(sdk_client) is expected
    assert isinstance(client, RemoteTrainingClient)
    if remote.kind == "pytrio":
        body = remote.stub.bodies("/training-runs")[0]
        assert (body["lora_rank"], body["seed"]) == (16, 7)
        assert body["train_attn"] and not body["train_mlp"] and not body["train_unembed"]
    else:
        body = remote.stub.bodies("/create_model")[0]
        assert body["lora_config"]["rank"] == 16 and body["lora_config"]["seed"] == 7
        assert body["lora_config"]["train_attn"] and not body["lora_config"]["train_mlp"]
    assert client.held_tokenizer is not None and len(client.held_tokenizer) == 300


@pytest.mark.filterwarnings("error::FutureWarning")
def test_a_stubbed_tinker_session_raises_no_future_warning(
    home: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_key(monkeypatch, "tinker")
    with TinkerStub() as stub, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        client = make_training_client(make_cfg("tinker", tok_dir, base_url=stub.url))
        asyncio.run(client.check_reduction_async("ppo", PPO))
        client.forward_backward(_datums(), "ppo", PPO)
        client.optim_step(AdamParams())
        path = client.save_state("step-1")
        client.sampling_client().sample([1, 2, 3], 2, SamplingParams(max_tokens=3))
        resumed = make_training_client(make_cfg("tinker", tok_dir, base_url=stub.url))
        resumed.load_state(path)
        resumed.forward_backward(_datums(), "ppo", PPO)
        shutdown(resumed)
        shutdown(client)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    assert stub.errors == []


def test_pytrio_base_url_is_honoured_after_the_sdk_was_imported(
    home: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_key(monkeypatch, "pytrio")
    # pytrio read its environment when this test module imported it; changing it now does nothing to
    # the SDK unless the adapter re-applies it. backend.base_url wins over the variable.
    monkeypatch.setenv("PYTRIO_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    with PytrioStub() as stub:
        client = make_training_client(make_cfg("pytrio", tok_dir, base_url=stub.url))
        assert [r.path for r in stub.requests][:2] == ["/api/openapi/v1/api-key/verify", "/api/sdk/bootstrap"]
        shutdown(client)
    with PytrioStub() as stub:
        monkeypatch.setenv("PYTRIO_BASE_URL", stub.url)  # no backend.base_url: the variable, read now
        client = make_training_client(make_cfg("pytrio", tok_dir))
        assert stub.bodies("/training-runs")
        shutdown(client)


def test_tinker_base_url_is_honoured(home: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    set_key(monkeypatch, "tinker")
    monkeypatch.setenv("TINKER_BASE_URL", "http://127.0.0.1:9")
    with TinkerStub() as stub:
        client = make_training_client(make_cfg("tinker", tok_dir, base_url=stub.url))
        assert stub.requests == []  # the Tinker session starts with the first client it creates
        client.forward_backward(_datums(), "ppo", PPO)
        assert stub.bodies("/create_model") and stub.calls
        shutdown(client)


# -- what reaches the wire ----------------------------------------------------------------------------


def test_forward_backward_masks_folds_weights_and_matches_the_loop_loss(remote: Remote) -> None:
    datums = _datums()
    res = remote.client.forward_backward(datums, "ppo", PPO)
    [call] = remote.calls()
    assert call.loss_fn == "ppo" and not call.forward_only
    assert call.config == pytest.approx({"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})
    n_active = sum(1 for d in datums for w in d.weights if w)
    scale = float(n_active) if remote.kind == "pytrio" else 1.0
    assert res.extra["reduction_scale"] == scale
    for d, sent in zip(datums, call.data, strict=True):
        assert sent.tokens == d.input_tokens
        for j, w in enumerate(d.weights):
            if w == 0:
                assert sent.advantages[j] == 0.0
                assert sent.targets[j] == (-100 if remote.kind == "pytrio" else d.target_tokens[j])
            else:
                assert sent.targets[j] == d.target_tokens[j]
                assert sent.advantages[j] == pytest.approx(d.advantages[j] * w * scale, rel=1e-6)
    # The service's normalised objective, computed from what was sent, is the loop's weighted sum.
    assert call.reported_loss == pytest.approx(res.loss, rel=1e-5)
    assert res.extra["server/loss_ratio"] == pytest.approx(1.0, rel=1e-5)
    assert res.trained_tokens == n_active
    assert res.ratio_min < 1 < res.ratio_max and 0 < res.clip_fraction < 1
    # The real metric names: PyTRIO loss_sum / loss_mean / token_count, Tinker loss:sum.
    if remote.kind == "pytrio":
        assert {"server/loss_sum", "server/loss_mean", "server/token_count"} <= set(res.extra)
        assert res.extra["server/token_count"] == n_active
    else:
        assert "server/loss:sum" in res.extra


def test_only_the_loss_inputs_the_services_know_are_sent(remote: Remote) -> None:
    remote.client.forward_backward(_datums(), "importance_sampling")
    remote.client.forward_backward([Datum([1, 2, 3], [2, 3, 4], weights=[0.0, 0.5, 0.5])], "cross_entropy")
    # The real SDKs forward any key unchecked; read the keys off the wire.
    if remote.kind == "pytrio":
        events = [b for b in remote.stub.bodies("/v1/events") if b["type"] == "trainer.forward_backward"]
        keys = [set(d) - {"model_input", "target_ids"} for e in events for d in e["payload"]["data"]]
        assert keys == [{"logprobs", "advantages"}] * 2 + [{"weights"}]
    else:
        msgs = remote.stub.bodies("/api/v1/forward_backward")
        keys = [set(d.loss_fn_inputs) for m in msgs for d in m.data]
        # RL datums carry an explicit 0/1 weight mask: no service can count their prompt tokens.
        assert keys == [{"target_tokens", "logprobs", "advantages", "weights"}] * 2 + [
            {"target_tokens", "weights"}
        ]
        masks = [d.weights for d in remote.calls()[0].data]
        assert masks == [[0.0 if w == 0 else 1.0 for w in d.weights] for d in _datums()]


def test_cross_entropy_sends_scaled_weights(remote: Remote) -> None:
    datums = [Datum([1, 2, 3], [2, 3, 4], weights=[0.0, 0.5, 0.5])]
    res = remote.client.forward_backward(datums, "cross_entropy")
    [call] = remote.calls()
    scale = 2.0 if remote.kind == "pytrio" else 1.0
    assert call.data[0].weights == pytest.approx([0.0, 0.5 * scale, 0.5 * scale])
    assert res.loss == pytest.approx(-(0.5 * learner_lp(3) + 0.5 * learner_lp(4)), rel=1e-6)
    assert call.reported_loss == pytest.approx(res.loss, rel=1e-5)


def test_negative_weights_and_bad_losses_are_refused_before_sending(remote: Remote) -> None:
    d = Datum([1, 2], [2, 3], [-1.0, -1.0], [1.0, 1.0], [1.0, -1.0])
    with pytest.raises(ValueError, match="negative"):
        remote.client.forward_backward([d], "ppo")
    with pytest.raises(ValueError, match="unknown loss_fn"):
        remote.client.forward_backward([d], "dro")
    with pytest.raises(ValueError, match="needs logprobs"):
        remote.client.forward_backward([Datum([1], [2])], "importance_sampling")
    assert remote.calls() == []


def test_optim_step_sends_every_adam_field(remote: Remote) -> None:
    res = remote.client.optim_step(
        AdamParams(lr=4e-5, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0)
    )
    if remote.kind == "pytrio":
        [event] = [b for b in remote.stub.bodies("/v1/events") if b["type"] == "trainer.optimize_step"]
        sent = event["payload"]["adam_params"]
    else:
        sent = remote.stub.bodies("/api/v1/optim_step")[0]["adam_params"]
    assert sent["learning_rate"] == 4e-5 and sent["beta2"] == 0.95 and sent["eps"] == 1e-8
    assert sent["weight_decay"] == 0.01 and sent["grad_clip_norm"] == 1.0  # the fakes had no clip field
    assert res.grad_norm == 0.75 and remote.client.step == 1


def test_build_model_renames_aliases_and_refuses_a_field_the_sdk_lacks() -> None:
    from retool.backends.remote.common import SdkOptionError, build_model

    class LrAdam:  # an SDK version with other field names: no server involved, so a local class
        model_fields: ClassVar[dict[str, Any]] = {"lr": 1e-4, "beta1": 0.9}

        def __init__(self, **kwargs: Any) -> None:
            self.__dict__.update(kwargs)

    p = build_model(LrAdam, "sdk 1.0", learning_rate=3e-5, beta1=0.8, grad_clip_norm=None)
    assert p.__dict__ == {"lr": 3e-5, "beta1": 0.8}  # an unset (None) field loses nothing
    for value in (1.0, 0.0):  # 0.0 too: whether "no clipping" is this SDK's default is not ours to guess
        with pytest.raises(
            SdkOptionError, match=rf"sdk 1\.0: LrAdam has no field for grad_clip_norm={value}"
        ):
            build_model(LrAdam, "sdk 1.0", learning_rate=3e-5, grad_clip_norm=value)


def _older_sdk(monkeypatch: pytest.MonkeyPatch, kind: str, without: str) -> str:
    """The installed SDK's real ``create_lora_training_client``, as a version that lacks ``without``
    would declare it; returns the SDK's name and version as messages give them."""
    sdk = pytrio if kind == "pytrio" else tinker
    real = sdk.ServiceClient.create_lora_training_client
    params = [p for p in inspect.signature(real).parameters.values() if p.name != without]

    def older(self: Any, *args: Any, **kwargs: Any) -> Any:
        return real(self, *args, **kwargs)

    older.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    older.__qualname__ = real.__qualname__
    monkeypatch.setattr(sdk.ServiceClient, "create_lora_training_client", older)
    return f"{kind} {importlib.metadata.version(kind)}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("option", "value"), [("seed", "7"), ("rank", "16"), ("train_unembed", "False")])
def test_a_setting_the_installed_sdk_cannot_take_is_an_error_naming_it_and_the_version(
    kind: str, option: str, value: str, home: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_key(monkeypatch, kind)
    label = _older_sdk(monkeypatch, kind, without=option)
    with make_stub(kind) as stub:
        with pytest.raises(SdkOptionError) as caught:
            make_training_client(make_cfg(kind, tok_dir, base_url=stub.url))
        message = str(caught.value)
        assert message.startswith(f"{label}: ServiceClient.create_lora_training_client takes no ")
        assert f"{option}={value}" in message
        assert stub.bodies("/training-runs" if kind == "pytrio" else "/create_model") == []


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "modules", [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "embed_tokens"], ["gate_proj"]]
)
def test_lora_targets_a_service_cannot_train_exactly_are_refused(
    kind: str, modules: list[str], home: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_key(monkeypatch, kind)
    targets = "lora.target_modules=[" + ", ".join(f'"{m}"' for m in modules) + "]"
    with make_stub(kind) as stub:
        with pytest.raises(SdkOptionError, match=r"lora\.target_modules = .* whole layer groups"):
            make_training_client(make_cfg(kind, tok_dir, targets, base_url=stub.url))
        assert stub.bodies("/training-runs" if kind == "pytrio" else "/create_model") == []


def test_whole_lora_groups_map_to_the_services_switches() -> None:
    from retool.backends.remote.common import lora_flags

    attn_mlp = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert lora_flags(attn_mlp) == {"train_attn": True, "train_mlp": True, "train_unembed": False}
    assert lora_flags(["model.layers.0.self_attn.qkv_proj", "o_proj", "lm_head"]) == {
        "train_attn": True,
        "train_mlp": False,
        "train_unembed": True,
    }


# -- sampling -----------------------------------------------------------------------------------------


def _sample_params(stub: StubServer, kind: str) -> list[dict[str, Any]]:
    if kind == "pytrio":
        return [b["sampling_params"] for b in stub.bodies("/sample")]
    return [b["sampling_params"] for b in stub.bodies("/api/v1/asample")]


def test_sampling_and_stop_handling(remote: Remote) -> None:
    client, stub = remote.client, remote.stub
    sampler = client.sampling_client()
    out = sampler.sample(
        [1, 2, 3], 2, SamplingParams(max_tokens=16, temperature=0.7, seed=3, stop=("</code>",))
    )
    params = _sample_params(stub, remote.kind)[-1]
    assert params["max_tokens"] == 16 and params["temperature"] == 0.7 and params["seed"] == 3
    assert params["stop"] == ["</code>", "<|im_end|>"]  # an explicit stop list keeps EOS
    assert [s.stop_reason for s in out] == ["stop", "length"]
    assert out[0].tokens == sampled_tokens([1, 2, 3], 0, 16)
    assert out[0].logprobs == pytest.approx([learner_lp(t) for t in out[0].tokens], rel=1e-6)
    sampler.sample([1], 1, SamplingParams(max_tokens=4))
    assert _sample_params(stub, remote.kind)[-1].get("stop") is None  # None keeps the service's EOS
    sampler.sample([1], 1, SamplingParams(max_tokens=4, stop=(7,)))
    params = _sample_params(stub, remote.kind)[-1]
    # PyTRIO's SDK moves token-id stops to their own field; Tinker sends them as they are.
    assert params.get("stop_token_ids" if remote.kind == "pytrio" else "stop") == [7, 2]
    sampler.sample([1] * 8190, 1, SamplingParams(max_tokens=100))  # capped by model.max_context = 8192
    assert _sample_params(stub, remote.kind)[-1]["max_tokens"] == 2
    n_sent = len(_sample_params(stub, remote.kind))
    full = sampler.sample([1] * 8192, 2, SamplingParams(max_tokens=100))
    assert [s.stop_reason for s in full] == ["length", "length"]
    assert len(_sample_params(stub, remote.kind)) == n_sent


def test_missing_sampling_logprobs_is_a_clear_error(remote: Remote) -> None:
    remote.stub.sample_logprobs = False  # PyTRIO then answers [], Tinker None
    sampler = remote.client.sampling_client()
    with pytest.raises(RuntimeError, match="no sampling logprobs"):
        sampler.sample([1, 2], 1, SamplingParams(max_tokens=3))


# -- checkpoints and resume ---------------------------------------------------------------------------


def test_pytrio_resume_loads_before_training_and_refuses_after(
    home: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_key(monkeypatch, "pytrio")
    with PytrioStub() as stub:
        cfg = make_cfg("pytrio", tok_dir, base_url=stub.url)
        client = make_training_client(cfg)
        client.forward_backward(_datums(), "ppo", PPO)
        path = client.save_state("step-10")
        assert path == "pytrio-stub://tr-1/save_state/step-10"
        with pytest.raises(ValueError, match="must match"):
            client.save_state("bad name/with slash")
        n_events = len(stub.bodies("/v1/events"))
        with pytest.raises(StateOrderError, match="before any training call"):
            client.load_state(path)
        assert len(stub.bodies("/v1/events")) == n_events and not stub.bodies("/training-runs/tr-1")

        resumed = make_training_client(cfg)
        resumed.load_state(path)
        [patch] = [r.body for r in stub.requests if r.method == "PATCH"]
        assert patch == {"source_checkpoint_uri": path, "restore_optimizer": True}
        [init] = [b for b in stub.bodies("/v1/events") if b["type"] == "trainer.init_run"][-1:]
        assert init["payload"]["checkpoint_uri"] == path and init["payload"]["load_optimizer"] is True
        resumed.forward_backward(_datums(), "ppo", PPO)
        assert stub.runs["tr-2"].events == ["trainer.init_run", "trainer.forward_backward"]

        # The SDK's own refusal (training started behind the adapter's back) is reported the same way.
        other = make_training_client(cfg)
        other.sdk_client.save_state("direct").result()
        with pytest.raises(StateOrderError, match="load_state"):
            other.load_state(path)
        for c in (client, resumed, other):
            shutdown(c)
        assert stub.errors == []


def test_tinker_resume_builds_the_client_from_the_checkpoint(
    home: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_key(monkeypatch, "tinker")
    with TinkerStub() as stub:
        cfg = make_cfg("tinker", tok_dir, base_url=stub.url)
        client = make_training_client(cfg)
        client.forward_backward(_datums(), "ppo", PPO)
        path = client.save_state("step-10")
        assert path == "tinker://sess-1:train:0/weights/step-10"
        resumed = make_training_client(cfg)
        resumed.load_state(path)
        # No fresh LoRA model was created for the resumed client: it was built from the checkpoint.
        assert len(stub.bodies("/create_model")) == 1
        [load] = stub.bodies("/api/v1/load_weights")
        assert load["path"] == path and load["optimizer"] is True
        resumed.forward_backward(_datums(), "ppo", PPO)
        sent = stub.bodies("/api/v1/forward_backward")[-1]
        assert sent.model_id == resumed.sdk_client.model_id != client.sdk_client.model_id
        shutdown(resumed)
        shutdown(client)
        assert stub.errors == []


# -- tokenizer ----------------------------------------------------------------------------------------


def test_pytrio_validates_against_the_adapters_tokenizer_without_loading_its_own(
    home: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_key(monkeypatch, "pytrio")

    def no_download(model_id: str) -> Any:
        raise AssertionError(f"the SDK loaded the tokenizer of {model_id} itself")

    monkeypatch.setattr(pytrio.client.training, "get_tokenizer", no_download)
    with PytrioStub() as stub:
        client = make_training_client(make_cfg("pytrio", tok_dir, base_url=stub.url))
        client.forward_backward(_datums(), "ppo", PPO)
        # The SDK checks ids against the vocabulary it was given: ours has 300 ids.
        with pytest.raises(Exception, match="outside the tokenizer vocabulary"):
            client.forward_backward([Datum([1, 300], [2, 3], weights=[1.0, 1.0])], "cross_entropy")
        shutdown(client)


def test_pytrio_says_what_to_do_when_the_sdk_cannot_load_the_tokenizer(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_key(monkeypatch, "pytrio")

    def offline(model_id: str) -> Any:
        raise OSError(f"cannot download {model_id}: offline")

    monkeypatch.setattr(pytrio.client.training, "get_tokenizer", offline)
    monkeypatch.setattr("retool.backends.remote.pytrio.local_tokenizer", lambda name: None)
    with PytrioStub() as stub:
        client = make_training_client(make_cfg("pytrio", "Qwen/Qwen3-4B", base_url=stub.url))
        assert client.held_tokenizer is None
        with pytest.raises(BackendUnavailableError, match=r"tokenizer of 'Qwen/Qwen3-4B'.*offline"):
            client.forward_backward(_datums(), "ppo", PPO)
        assert stub.calls == []
        shutdown(client)


def test_local_tokenizer_never_downloads(monkeypatch: pytest.MonkeyPatch, tok_dir: Path) -> None:
    from transformers import AutoTokenizer

    from retool.backends.remote.common import local_tokenizer

    seen: list[dict[str, Any]] = []

    def from_pretrained(name: str, **kwargs: Any) -> Any:
        seen.append(kwargs)
        raise OSError("not in the cache")

    assert len(local_tokenizer(str(tok_dir))) == 300
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_pretrained)
    assert local_tokenizer("Qwen/Qwen3-4B") is None
    assert seen == [{"local_files_only": True}]


# -- credentials --------------------------------------------------------------------------------------


def test_importing_an_sdk_keeps_the_excepthook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from retool.backends.remote.common import import_sdk

    # pytrio installs its own sys.excepthook when imported; a module that does the same stands in for it
    # (pytrio itself is already imported by this test module).
    (tmp_path / "hooking_sdk.py").write_text("import sys\nsys.excepthook = lambda *a: None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = sys.excepthook
    import_sdk("hooking_sdk", "hooking")
    assert sys.excepthook is before


def test_missing_sdk_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for kind in KINDS:
        monkeypatch.setitem(sys.modules, kind, None)  # import fails as if not installed
        with pytest.raises(BackendUnavailableError, match=f"retool-rl\\[{kind}\\]"):
            make_training_client(load_config(None, [f'backend.kind="{kind}"']))


@pytest.mark.parametrize("kind", KINDS)
def test_no_credentials_contacts_nothing(kind: str, home: Path, tok_dir: Path) -> None:
    with make_stub(kind) as stub:
        var = "PYTRIO_API_KEY" if kind == "pytrio" else "TINKER_API_KEY"
        with pytest.raises(BackendUnavailableError, match=var):
            make_training_client(make_cfg(kind, tok_dir, base_url=stub.url))
        assert stub.requests == []


def test_pytrio_named_environment_supplies_key_and_server(
    home: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with PytrioStub() as stub:
        env = home / ".pytrio" / "envs" / "staging"
        env.mkdir(parents=True)
        (env / "config.toml").write_text(f'api_key = "{PYTRIO_KEY}"\nbase_url = "{stub.url}"\n')
        monkeypatch.setenv("PYTRIO_ENV", "staging")
        client = make_training_client(make_cfg("pytrio", tok_dir))
        assert stub.requests[0].headers["x-api-key"] == PYTRIO_KEY
        shutdown(client)


def test_pytrio_default_profile_supplies_the_key(home: Path, tok_dir: Path) -> None:
    with PytrioStub() as stub:
        (home / ".pytrio").mkdir()
        (home / ".pytrio" / "config.toml").write_text(f'api_key = "{PYTRIO_KEY}"\n')
        client = make_training_client(make_cfg("pytrio", tok_dir, base_url=stub.url))
        assert stub.bodies("/training-runs")
        shutdown(client)


def test_tinker_stored_credentials_supply_the_key(home: Path, tok_dir: Path) -> None:
    from tinker.lib.credentials import JsonCredentialStore, ManualKey, default_credentials_path

    store = JsonCredentialStore(default_credentials_path())  # ~/.tinker/credentials.json in our HOME
    store.add_key("k1", ManualKey(key=TINKER_KEY, name="test"))
    store.set_default("k1")
    with TinkerStub() as stub:
        client = make_training_client(make_cfg("tinker", tok_dir, base_url=stub.url))
        client.forward_backward(_datums(), "ppo", PPO)
        assert stub.requests[0].headers["x-api-key"] == TINKER_KEY
        shutdown(client)


def test_tinker_credential_command_supplies_the_key(
    home: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINKER_CREDENTIAL_CMD", f"echo {TINKER_KEY}")
    with TinkerStub() as stub:
        client = make_training_client(make_cfg("tinker", tok_dir, base_url=stub.url))
        client.forward_backward(_datums(), "ppo", PPO)
        # The command's key is exchanged for the service's JWT, which every later request carries.
        assert stub.bodies("/api/v1/auth/token")
        assert stub.requests[-1].headers["x-api-key"] == stub.jwt
        shutdown(client)


def test_tinker_malformed_key_is_reported_before_any_request(
    home: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINKER_API_KEY", "not-a-tinker-key")
    with TinkerStub() as stub:
        with pytest.raises(BackendUnavailableError, match="tml-"):
            make_training_client(make_cfg("tinker", tok_dir, base_url=stub.url))
        assert stub.requests == []


# -- reduction ----------------------------------------------------------------------------------------


def test_probe_totals_separate_every_denominator(remote: Remote) -> None:
    wire = [remote.client.to_wire(d, "ppo") for d in probe_datums(remote.client.held_tokenizer)]
    totals = batch_totals(wire, "ppo")
    # PyTRIO masks untrained targets (-100), so only trained positions are active; Tinker sees them all.
    active = 5 if remote.kind == "pytrio" else 7
    assert (totals.samples, totals.active_tokens, totals.advantage_tokens) == (2, active, 3)
    assert len(set(totals.candidates().values())) == 4


def test_adapter_counts_the_totals_the_sdk_sends(
    home: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token with a weight but zero advantage is active, not an advantage token (PyTRIO's count)."""
    set_key(monkeypatch, "pytrio")
    with PytrioStub() as stub:
        client = make_training_client(make_cfg("pytrio", tok_dir, base_url=stub.url))
        datums = _mixed_datums()
        client.forward_backward(datums, "ppo", PPO)
        sent = stub.calls[-1].totals  # what the real SDK put in gradient_accumulation
        ours = batch_totals([client.to_wire(d, "ppo") for d in datums], "ppo")
        assert (ours.samples, ours.active_tokens, ours.advantage_tokens) == (
            sent.samples,
            sent.active_tokens,
            sent.advantage_tokens,
        )
        assert sent.advantage_tokens == sent.active_tokens - 1
        shutdown(client)


# Cross-entropy has no advantage tokens: a service normalising by them leaves CE summed (the stub does).
CE_MODE = {"sum": "sum", "samples": "samples", "active_tokens": "active_tokens", "advantage_tokens": "sum"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reduction", ["sum", "samples", "active_tokens", "advantage_tokens"])
def test_self_check_finds_the_services_denominator(
    kind: str,
    reduction: str,
    home: Path,
    tok_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    set_key(monkeypatch, kind)
    with make_stub(kind, reduction) as stub:
        client = make_training_client(make_cfg(kind, tok_dir, base_url=stub.url))
        before = client.forward_backward(_mixed_datums(), "ppo", PPO).extra["server/loss_ratio"]
        assumed = "active_tokens" if kind == "pytrio" else "sum"
        assert (before == pytest.approx(1.0, rel=1e-5)) == (reduction == assumed)
        n_calls = len(stub.calls)
        guarded = GuardedTrainingClient(client, policy=RetryPolicy())  # as the trainer holds it
        with caplog.at_level(logging.INFO, logger="retool.backends.training.reduction"):
            reports = asyncio.run(guarded.check_reduction_async("ppo", PPO))
        assert [(r.loss_fn, r.mode) for r in reports] == [
            ("cross_entropy", CE_MODE[reduction]),
            ("ppo", reduction),
        ]
        assert f"normalises ppo by {reduction}" in caplog.text
        assert all(c.forward_only for c in stub.calls[n_calls:])  # the probe never accumulates a gradient
        assert len(stub.calls) == n_calls + 2
        assert asyncio.run(client.check_reduction_async("ppo", PPO)) == []  # once per client
        after = client.forward_backward(_mixed_datums(), "ppo", PPO)
        assert after.extra["server/loss_ratio"] == pytest.approx(1.0, rel=1e-5)
        assert stub.calls[-1].reported_loss == pytest.approx(after.loss, rel=1e-5)
        ce = client.forward_backward([Datum([1, 2, 3], [2, 3, 4], weights=[0.0, 0.5, 0.5])], "cross_entropy")
        assert ce.extra["server/loss_ratio"] == pytest.approx(1.0, rel=1e-5)
        shutdown(client)
        assert stub.errors == []


@pytest.mark.parametrize("kind", KINDS)
def test_self_check_refuses_an_unknown_normalisation(
    kind: str, home: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_key(monkeypatch, kind)
    # PyTRIO's SDK drops RL weights, so the adapter cannot know a per-sequence service's weight sums;
    # the Tinker adapter can (test_backends_skyrl), and is shown a normalisation nobody knows.
    unknown = "per_sequence_mean" if kind == "pytrio" else "squared_tokens"
    with make_stub(kind, unknown) as stub:
        client = make_training_client(make_cfg(kind, tok_dir, base_url=stub.url))
        with pytest.raises(ReductionCheckError, match="matches none of the known normalisations"):
            asyncio.run(client.check_reduction_async("importance_sampling"))
        assert stub.calls and all(c.forward_only for c in stub.calls)
        assert not client.reduction_verified
        shutdown(client)


def test_self_check_is_a_no_op_for_other_backends() -> None:
    class LocalLike(TrainingClient):  # computes its loss itself: the base class's hook applies
        forward_backward_async = optim_step_async = save_state_async = None  # type: ignore[assignment]
        load_state_async = sampling_client_async = None  # type: ignore[assignment]

    assert asyncio.run(LocalLike().check_reduction_async("ppo", PPO)) == []


# -- a stubbed training run ---------------------------------------------------------------------------


async def stub_rollouts(request: Any) -> list[list[Any]]:
    """Trajectories sampled from the remote sampler; rewards alternate so no group is degenerate."""
    from retool.env import ReToolOutcome
    from retool.rollout import AssistantTurn, Trajectory, Transition

    groups = []
    for pi, builder in enumerate(request.groups):
        prompt = [1, 2, 3 + pi]
        samples = await request.policy.sample_async(prompt, builder.group_size, SamplingParams(max_tokens=3))
        group = []
        for b, s in enumerate(samples):
            # Sampler logprobs a little off the learner's (as if one step stale): on-policy, the RL loss
            # of centred advantages is exactly 0 and could not show the service's normalisation.
            stale = [lp - 0.1 * (b + 1) for lp in s.logprobs]
            reward = 1.0 if b % 2 == 0 else -1.0
            traj = Trajectory(
                problem=builder.problem,
                group_index=b,
                problem_index=pi,
                transitions=(Transition(AssistantTurn(prompt, s.tokens, stale, "x"), reward, True),),
                reward=reward,
                outcome=ReToolOutcome(correct=reward > 0, valid_format=True, stop_reason="answer"),
            )
            group.append(traj)
        groups.append(group)
    return groups


@pytest.mark.filterwarnings("error::FutureWarning")
@pytest.mark.parametrize("kind", KINDS)
def test_a_training_run_and_its_resume_through_the_sdk(
    kind: str, home: Path, tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from retool.backends import make_training_client
    from retool.components import Components
    from retool.data.problem import Problem
    from retool.env import ProblemList
    from retool.train.loop import Trainer
    from test_train_loop import StubProtocol

    set_key(monkeypatch, kind)
    problems = [Problem(f"p{i}", f"What is {i} + {i}?", str(2 * i)) for i in range(4)]
    with make_stub(kind, "samples") as stub:

        def run(steps: int, resume: bool) -> Trainer:
            cfg = make_cfg(
                kind,
                tok_dir,
                f"train.steps={steps}",
                "checkpoint.every=1",
                "rollout.questions_per_step=2",
                "rollout.group_size=2",
                "logging.tracker='none'",
                "logging.progress=false",
                base_url=stub.url,
            )
            parts = Components(
                backend=make_training_client(cfg),
                protocol=StubProtocol(),
                verifier=object(),
                executor=object(),
            )
            trainer = Trainer(
                cfg,
                tmp_path / "run",
                resume=resume,
                source=ProblemList(problems, shuffle=False),
                components=parts,
                rollout_fn=stub_rollouts,
            )
            trainer.run()
            shutdown(parts.backend)
            return trainer

        run(2, resume=False)
        kinds = [("probe" if c.forward_only else "train") for c in stub.calls]
        assert kinds == ["probe", "probe", "train", "train"]  # the check runs once, before training
        run(3, resume=True)
        assert [("probe" if c.forward_only else "train") for c in stub.calls][4:] == [
            "probe",
            "probe",
            "train",
        ]
        if kind == "pytrio":  # the resumed run bound its checkpoint before the probe started the trainer
            assert stub.runs["tr-2"].restored_from and stub.runs["tr-2"].events[:2] == [
                "trainer.init_run",
                "trainer.forward",
            ]
        else:
            assert stub.bodies("/api/v1/load_weights")[0]["optimizer"] is True
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert all(r["policy/server/loss_ratio"] == pytest.approx(1.0, rel=1e-5) for r in rows)
        # the service returns neither the policy's entropy nor the starting policy's logprobs: null
        assert all(r["policy/entropy"] is None and r["policy/ref_kl"] is None for r in rows)
        assert all(r["policy/sampled_nll"] > 0 for r in rows)  # from the sampler's logprobs, any backend
        assert stub.errors == []
