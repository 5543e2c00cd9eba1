"""The Tinker adapter against a stand-in for SkyRL's self-hosted Tinker API server (``sdk_stubs.SkyrlStub``).

The real ``tinker`` SDK runs unmodified against a local server that reduces the loss as SkyRL 0.4.0 does
(per sequence ``sum(w * l) / max(sum(w), 1e-9)``, summed, the accumulated gradient divided by the
number of sequences before ``optim_step``; ``skyrl/backends/jax.py``), reports no loss metric, and lacks
what SkyRL lacks (a ``model_id``-less ``load_weights``, the session-finish endpoint). The stub computes a
real gradient on a four-parameter model, so the tests compare the gradient the service applies with the
one the local backend's loss code gives for the same batch. The real server is exercised by
``bench/interop_skyrl.sh``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
import torch

from retool.backends import make_training_client
from retool.backends.interface.types import AdamParams, Datum
from retool.backends.remote.common import BackendUnavailableError
from retool.backends.remote.guarded import GuardedTrainingClient
from retool.backends.remote.tinker import TinkerTrainingClient
from retool.backends.training.losses import token_loss
from retool.backends.training.reduction import (
    GRADIENT_LOSS,
    GRADIENT_TOLERANCE,
    REDUCTION_MODES,
    ReductionCheckError,
    UnweightableLossError,
    gradient_probe_batches,
    predicted_gradient_ratios,
)
from retool.config import Config, load_config
from retool.retry import RetryPolicy
from retool.train.step import train_step
from sdk_stubs import TINKER_KEY, SkyrlStub, TinkerStub, learner_lp, token_feature

PPO = {"clip_low": 0.8, "clip_high": 1.28}


@pytest.fixture(autouse=True)
def tinker_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("TINKER_BASE_URL", "TINKER_CREDENTIAL_CMD", "TINKER_PROJECT_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TINKER_API_KEY", TINKER_KEY)  # SkyRL checks none; the SDK wants a tml- key
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


@pytest.fixture
def skyrl() -> Iterator[SkyrlStub]:
    with SkyrlStub() as stub:
        yield stub
        assert stub.errors == []


def make_cfg(tok: Path, url: str) -> Config:
    overrides = ['backend.kind="tinker"', f'model.name="{tok}"', "lora.rank=16", "train.seed=7"]
    return load_config(None, [*overrides, f'backend.base_url="{url}"'])


def client_on(stub: TinkerStub, tok: Path) -> TinkerTrainingClient:
    client = make_training_client(make_cfg(tok, stub.url))
    assert isinstance(client, TinkerTrainingClient)
    return client


def rl_datums(n: int = 3) -> list[Datum]:
    """``n`` trajectories of different lengths: 2 prompt positions (weight 0), loop weights
    ``1 / n_tokens / n_datums``, advantages of both signs, sampler logprobs off the learner's either way
    (so PPO clips some tokens)."""
    out = []
    for i in range(n):
        toks = [5, 6, *range(10 + 3 * i, 13 + 4 * i)]
        n_tr = len(toks) - 1 - 2
        adv = (1.0, -0.5, 0.75)[i % 3]
        old = [0.0, 0.0] + [learner_lp(t) + (0.3 if j % 2 else -0.3) for j, t in enumerate(toks[3:])]
        w = [0.0, 0.0] + [1.0 / n_tr / n] * n_tr
        out.append(Datum(toks[:-1], toks[1:], old, [0.0, 0.0] + [adv] * n_tr, w))
    return out


def local_gradient(datums: list[Datum], loss_fn: str, loss_config: dict[str, float] | None) -> list[float]:
    """The gradient the local backend's loss code gives for ``datums`` on the stub's model: autograd
    through ``token_loss`` (the same function the local backend sums) to each token's logprob, times the
    stub's ``d lp / d theta``."""
    grad = [0.0] * 4
    for d in datums:
        lp = torch.tensor([learner_lp(t) for t in d.target_tokens], dtype=torch.float64, requires_grad=True)
        w = torch.tensor(d.weights, dtype=torch.float64)
        old = torch.tensor(d.logprobs, dtype=torch.float64) if d.logprobs else None
        adv = torch.tensor(d.advantages, dtype=torch.float64) if d.advantages else None
        token_loss(loss_fn, lp, w, old, adv, loss_config).loss.sum().backward()
        assert lp.grad is not None
        for slope, t in zip(lp.grad.tolist(), d.target_tokens, strict=True):
            grad = [g + slope * f for g, f in zip(grad, token_feature(t), strict=True)]
    return grad


def close(client: TinkerTrainingClient) -> None:
    asyncio.run(client.close_async())


# -- the reduction self-check ---------------------------------------------------------------------


def test_the_gradient_probes_tell_every_known_reduction_apart(skyrl: SkyrlStub, tok_dir: Path) -> None:
    client = client_on(skyrl, tok_dir)
    forward, build = gradient_probe_batches(client.held_tokenizer)
    wire = [[client.to_wire(d, GRADIENT_LOSS) for d in b] for b in build([0.0] * len(forward))]
    predicted = predicted_gradient_ratios(wire, GRADIENT_LOSS, REDUCTION_MODES)
    signatures = list(predicted.values())
    for i, a in enumerate(signatures):
        for b in signatures[i + 1 :]:
            assert max(abs(x / y - 1) for x, y in zip(a, b, strict=True)) > 2 * GRADIENT_TOLERANCE
    assert predicted["sequence_mean"] == pytest.approx([1.0, 0.5, 0.5])
    close(client)


def test_self_check_identifies_the_per_sequence_mean_on_a_scratch_model(
    skyrl: SkyrlStub, tok_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client = client_on(skyrl, tok_dir)
    guarded = GuardedTrainingClient(client, policy=RetryPolicy())  # as the trainer holds it
    with caplog.at_level(logging.INFO, logger="retool.backends.training.reduction"):
        reports = asyncio.run(guarded.check_reduction_async("ppo", PPO))
    assert [(r.loss_fn, r.mode) for r in reports] == [
        ("cross_entropy", "sequence_mean"),
        ("ppo", "sequence_mean"),
    ]
    assert "gradient norms [a]" in reports[0].detail and "reduces the loss by sequence_mean" in caplog.text
    # The probes ran on a scratch model, which is unloaded; the run's own model got no optimizer step.
    [scratch] = [m for m in skyrl.grads]
    assert len(skyrl.grads[scratch]) == 4 and scratch in skyrl.unloaded
    main = client.sdk_client.model_id
    assert main != scratch and main not in skyrl.grads
    assert client.one_call_per_step and guarded.one_call_per_step
    # Every probe batch carried its 0/1 weight mask, the masked first position included.
    sent = [c for c in skyrl.calls if c.loss_fn == GRADIENT_LOSS]
    assert sent and all(d.weights is not None and d.weights[0] == 0.0 for c in sent for d in c.data)
    close(client)


@pytest.mark.parametrize("loss_fn", ["ppo", "importance_sampling"])
def test_a_step_applies_the_local_backends_gradient(skyrl: SkyrlStub, tok_dir: Path, loss_fn: str) -> None:
    client = client_on(skyrl, tok_dir)
    config = PPO if loss_fn == "ppo" else None
    asyncio.run(client.check_reduction_async(loss_fn, config))
    datums = rl_datums(3)
    guarded = GuardedTrainingClient(client, policy=RetryPolicy())
    # A micro-batch budget that would split the step in three: the adapter asks for one call instead.
    n_calls = len(skyrl.calls)
    result = asyncio.run(
        train_step(
            guarded,
            datums,
            loss_fn=loss_fn,  # type: ignore[arg-type]
            loss_config=config,
            adam=AdamParams(lr=1e-3),
            micro_batch_tokens=8,
        )
    )
    assert result.n_micro_batches == 1 and len(skyrl.calls) == n_calls + 1
    [call] = skyrl.calls[n_calls:]
    for d, sent in zip(datums, call.data, strict=True):
        assert sent.weights == [0.0 if w == 0 else 1.0 for w in d.weights]  # prompt tokens: weight 0
    applied = skyrl.grads[client.sdk_client.model_id][-1]
    expected = local_gradient(datums, loss_fn, config)
    assert applied == pytest.approx(expected, rel=1e-5, abs=1e-9)
    assert result.grad_norm == pytest.approx(math.sqrt(sum(g * g for g in expected)), rel=1e-5)
    assert result.forward_backward is not None
    if loss_fn == "ppo":  # some tokens clipped: the clipped branch's zero gradient is in the comparison
        assert 0 < result.forward_backward.clip_fraction < 1
    close(client)


def test_the_same_step_on_a_summing_service_is_unchanged(tok_dir: Path) -> None:
    """Tinker's documented sum: no rescaling, micro-batches as before, weights sent as a 0/1 mask."""
    with TinkerStub("sum") as stub:
        client = client_on(stub, tok_dir)
        asyncio.run(client.check_reduction_async("ppo", PPO))
        assert not client.one_call_per_step
        res = client.forward_backward(rl_datums(3), "ppo", PPO)
        assert res.extra["reduction_scale"] == 1.0
        assert res.extra["server/loss_ratio"] == pytest.approx(1.0, rel=1e-5)
        close(client)


def test_a_second_forward_backward_before_the_step_is_refused(skyrl: SkyrlStub, tok_dir: Path) -> None:
    client = client_on(skyrl, tok_dir)
    asyncio.run(client.check_reduction_async("importance_sampling"))
    client.forward_backward(rl_datums(2), "importance_sampling")
    n_calls = len(skyrl.calls)
    with pytest.raises(RuntimeError, match=r"second forward_backward .* before optim_step"):
        client.forward_backward(rl_datums(1), "importance_sampling")
    assert len(skyrl.calls) == n_calls  # refused before sending
    client.optim_step(AdamParams())
    client.forward_backward(rl_datums(1), "importance_sampling")  # a new step may start
    close(client)


def test_cross_entropy_cannot_be_weighted_on_a_per_sequence_service(skyrl: SkyrlStub, tok_dir: Path) -> None:
    client = client_on(skyrl, tok_dir)
    with pytest.raises(ReductionCheckError, match=r"reduces the loss per sequence.*weights cancel"):
        asyncio.run(client.check_reduction_async("cross_entropy"))
    client.set_reduction("cross_entropy", "sequence_mean")
    with pytest.raises(UnweightableLossError, match="weights cancel"):
        client.forward_backward([Datum([1, 2, 3], [2, 3, 4], weights=[0.0, 0.5, 0.5])], "cross_entropy")
    close(client)


def test_an_unknown_reduction_is_refused_with_what_was_measured(tok_dir: Path) -> None:
    with SkyrlStub(sequence_power=2) as stub:  # divides by the weight sum squared: no known reduction
        client = client_on(stub, tok_dir)
        with pytest.raises(ReductionCheckError) as caught:
            asyncio.run(client.check_reduction_async("ppo", PPO))
        message = str(caught.value)
        assert "reports no loss, so the reduction was measured from gradient norms" in message
        # The measured ratios, and what each known reduction predicts, are in the message.
        assert "(1, 0.5, 0.25)" in message and "sequence_mean (1, 0.5, 0.5)" in message
        assert not client.reduction_verified
        close(client)


def test_a_per_sequence_service_that_reports_its_loss_is_identified_from_it(tok_dir: Path) -> None:
    with TinkerStub("per_sequence_mean") as stub:  # SkyRL's formula, with a loss:sum metric
        client = client_on(stub, tok_dir)
        reports = asyncio.run(client.check_reduction_async("ppo", PPO))
        assert [(r.loss_fn, r.mode) for r in reports] == [
            ("cross_entropy", "sequence_mean"),
            ("ppo", "sequence_mean"),
        ]
        assert all(c.forward_only for c in stub.calls)  # the loss metric needs no gradient
        datums = rl_datums(3)
        res = client.forward_backward(datums, "ppo", PPO)
        # The service's objective over the scaled datums is the loop's weighted sum.
        assert stub.calls[-1].reported_loss == pytest.approx(res.loss, rel=1e-5)
        close(client)


def test_squared_tokens_is_refused_by_the_loss_metric_check(tok_dir: Path) -> None:
    with TinkerStub("squared_tokens") as stub:
        client = client_on(stub, tok_dir)
        with pytest.raises(ReductionCheckError, match="matches none of the known normalisations"):
            asyncio.run(client.check_reduction_async("importance_sampling"))
        close(client)


# -- resume and close -----------------------------------------------------------------------------


@pytest.mark.filterwarnings("error::FutureWarning")
def test_resume_loads_the_checkpoint_into_a_new_model_when_the_server_wants_a_model_id(
    skyrl: SkyrlStub, tok_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_cfg(tok_dir, skyrl.url)
    client = make_training_client(cfg)
    client.forward_backward(rl_datums(2), "importance_sampling")
    client.optim_step(AdamParams())
    path = client.save_state("step-1")
    resumed = make_training_client(cfg)
    assert isinstance(resumed, TinkerTrainingClient)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        resumed.load_state(path)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]
    first, second = skyrl.bodies("/api/v1/load_weights")
    assert "model_id" not in first  # tinker 0.38's create_training_client_from_state_with_optimizer: 422
    new = resumed.sdk_client.model_id
    assert second["model_id"] == new and second["optimizer"] is True and skyrl.loaded == {new: path}
    assert "refused create_training_client_from_state_with_optimizer (422" in caplog.text
    resumed.forward_backward(rl_datums(2), "importance_sampling")
    assert skyrl.bodies("/api/v1/forward_backward")[-1].model_id == new
    close(resumed)
    close(client)


def test_resume_that_no_call_achieves_names_the_sdk_and_the_server(skyrl: SkyrlStub, tok_dir: Path) -> None:
    resumed = make_training_client(make_cfg(tok_dir, skyrl.url))
    missing = "tinker://model_00000000/weights/nowhere"
    with pytest.raises(BackendUnavailableError) as caught:
        resumed.load_state(missing)
    message = str(caught.value)
    assert f"tinker {tinker.__version__}" in message or "tinker 0." in message
    assert skyrl.url in message and missing in message and "Server version: not reported" in message
    assert "422" in message and "not found" in message
    assert skyrl.live == []  # the model made for the attempt was unloaded again
    close(resumed)


def test_closing_unloads_the_models_and_a_missing_finish_endpoint_is_a_warning(
    tok_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Two adapter slots: without unloading, the third client in a row would be refused.
    with SkyrlStub(max_adapters=2) as stub:
        for _ in range(3):
            client = client_on(stub, tok_dir)
            client.forward_backward(rl_datums(1), "importance_sampling")
            with caplog.at_level(logging.WARNING, logger="retool.backends.remote.tinker"):
                close(client)  # never raises
        assert len(stub.unloaded) == 3 and stub.live == []
        assert "has no session-finish endpoint (404" in caplog.text
        assert [r.path for r in stub.requests if r.path.endswith("/finish")]
        assert stub.errors == []


def test_closing_against_a_server_without_unload_is_quiet(
    tok_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with TinkerStub("sum") as stub:  # answers 404 to routes it lacks, unload_model included
        client = client_on(stub, tok_dir)
        client.forward_backward(rl_datums(1), "importance_sampling")
        with caplog.at_level(logging.INFO, logger="retool.backends.remote.tinker"):
            close(client)
        assert stub.bodies("/api/v1/unload_model")
        assert "has no /api/v1/unload_model" in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
