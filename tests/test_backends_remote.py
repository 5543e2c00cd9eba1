"""PyTRIO and Tinker adapters against fake SDK modules that record calls and return canned responses.

The fake "server" implements the documented loss math on its side (Tinker: plain sum; the PyTRIO fake:
sum divided by the active-token count, our assumption about the real service), so the tests check that
what the adapter sends reproduces the loop's weighted loss on each backend.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from retool.backends.remote import BackendUnavailableError
from retool.backends.types import AdamParams, Datum, SamplingParams
from retool.config import load_config

# -- a fake SDK ---------------------------------------------------------------------------------------


class Future:
    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self, timeout: float | None = None) -> Any:
        return self.value


class _Model:
    """pydantic-ish: keyword fields only, ``model_fields`` lists them."""

    model_fields: ClassVar[dict[str, Any]] = {}

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(self.model_fields)
        if unknown:
            raise TypeError(f"unexpected fields {unknown}")
        for k, v in self.model_fields.items():
            setattr(self, k, kwargs.get(k, v))


class TensorData(_Model):
    model_fields: ClassVar[dict[str, Any]] = {"data": None, "dtype": None, "shape": None}

    def tolist(self) -> list:
        return list(self.data)


class ModelInput:
    def __init__(self, ints: list[int]) -> None:
        self.ints = list(ints)

    @classmethod
    def from_ints(cls, ints: list[int]) -> ModelInput:
        return cls(ints)

    def to_ints(self) -> list[int]:
        return self.ints


class FakeDatum:
    def __init__(self, model_input: ModelInput, loss_fn_inputs: dict[str, Any]) -> None:
        self.model_input = model_input
        self.loss_fn_inputs = loss_fn_inputs


class SamplingParamsT(_Model):
    model_fields: ClassVar[dict[str, Any]] = {
        "max_tokens": None,
        "seed": None,
        "stop": None,
        "temperature": 1.0,
        "top_k": -1,
        "top_p": 1.0,
    }


class AdamParamsT(_Model):
    model_fields: ClassVar[dict[str, Any]] = {
        "learning_rate": 1e-4,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-12,
        "weight_decay": 0.0,
    }


def learner_lp(token: int) -> float:
    """The fake server's 'current policy' logprob of a target token."""
    return -0.2 - 0.1 * (token % 7)


@dataclass
class Seq:
    tokens: list[int]
    logprobs: list[float] | None
    stop_reason: str


@dataclass
class Recorder:
    calls: list[tuple[str, Any]] = field(default_factory=list)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


class FakeSampler:
    def __init__(self, rec: Recorder, with_logprobs: bool = True) -> None:
        self.rec = rec
        self.with_logprobs = with_logprobs

    def sample(self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParamsT) -> Future:
        self.rec.calls.append(("sample", (prompt.to_ints(), num_samples, sampling_params)))
        seqs = []
        for i in range(num_samples):
            toks = [10 + i, 11, 12]
            seqs.append(
                Seq(
                    toks,
                    [learner_lp(t) for t in toks] if self.with_logprobs else None,
                    "length" if i else "stop",
                )
            )
        return Future(types.SimpleNamespace(sequences=seqs))


class FakeTrainer:
    def __init__(self, rec: Recorder, kind: str, futures_of_clients: bool) -> None:
        self.rec = rec
        self.kind = kind
        self.futures_of_clients = futures_of_clients

    def forward_backward(
        self, data: list[FakeDatum], loss_fn: str, loss_fn_config: dict | None = None
    ) -> Future:
        self.rec.calls.append(("forward_backward", (data, loss_fn, loss_fn_config)))
        outs = []
        total = 0.0
        active = 0
        lo = (loss_fn_config or {}).get("clip_low_threshold", 0.8)
        hi = (loss_fn_config or {}).get("clip_high_threshold", 1.2)
        for d in data:
            inp = d.loss_fn_inputs
            if self.kind == "tinker":
                allowed = {"target_tokens", "logprobs", "advantages", "weights"}
                assert set(inp) <= allowed, f"tinker raises on unknown keys: {set(inp) - allowed}"
            tgt = inp["target_tokens"].tolist()
            lps = [learner_lp(t) if t != -100 else 0.0 for t in tgt]
            outs.append({"logprobs": TensorData(data=lps, dtype="float32", shape=[len(lps)])})
            for j, t in enumerate(tgt):
                if t == -100:
                    continue
                active += 1
                if loss_fn == "cross_entropy":
                    w = inp["weights"].tolist()[j] if "weights" in inp else 1.0
                    total += -w * lps[j]
                else:
                    a = inp["advantages"].tolist()[j]
                    r = math.exp(lps[j] - inp["logprobs"].tolist()[j])
                    if loss_fn == "ppo":
                        total += -min(r * a, min(max(r, lo), hi) * a)
                    else:
                        total += -r * a
        metrics = {"loss:sum": total, "loss:mean": total / max(active, 1), "token_count": float(active)}
        return Future(types.SimpleNamespace(loss_fn_outputs=outs, metrics=metrics))

    def optim_step(self, adam_params: AdamParamsT) -> Future:
        self.rec.calls.append(("optim_step", adam_params))
        return Future(types.SimpleNamespace(metrics={"optim/grad_norm": 1.5}))

    def save_state(self, name: str) -> Future:
        self.rec.calls.append(("save_state", name))
        return Future(types.SimpleNamespace(path=f"{self.kind}://run-1/weights/{name}"))

    def load_state_with_optimizer(self, path: str) -> Future:
        self.rec.calls.append(("load_state_with_optimizer", path))
        return Future(None)

    def save_weights_and_get_sampling_client(self) -> Any:
        self.rec.calls.append(("save_weights_and_get_sampling_client", None))
        sampler = FakeSampler(self.rec)
        return Future(sampler) if self.futures_of_clients else sampler

    def get_tokenizer(self) -> Any:
        self.rec.calls.append(("get_tokenizer", None))
        return types.SimpleNamespace(eos_token="<|im_end|>", eos_token_id=2)


def make_fake_sdk(kind: str, futures_of_clients: bool) -> tuple[types.ModuleType, Recorder]:
    rec = Recorder()
    mod = types.ModuleType(kind)
    t = types.ModuleType(f"{kind}.types")
    t.TensorData = TensorData
    t.ModelInput = ModelInput
    t.Datum = FakeDatum
    t.SamplingParams = SamplingParamsT
    t.AdamParams = AdamParamsT
    mod.types = t

    class ServiceClient:
        def __init__(self, **kwargs: Any) -> None:
            rec.calls.append(("ServiceClient", kwargs))

        def create_lora_training_client(
            self,
            base_model: str,
            rank: int = 32,
            seed: int | None = None,
            train_mlp: bool = True,
            train_attn: bool = True,
            train_unembed: bool = True,
        ) -> Any:
            rec.calls.append(
                (
                    "create_lora_training_client",
                    {
                        "base_model": base_model,
                        "rank": rank,
                        "seed": seed,
                        "train_mlp": train_mlp,
                        "train_attn": train_attn,
                        "train_unembed": train_unembed,
                    },
                )
            )
            trainer = FakeTrainer(rec, kind, futures_of_clients)
            return Future(trainer) if futures_of_clients else trainer

    mod.ServiceClient = ServiceClient
    return mod, rec


# -- fixtures -----------------------------------------------------------------------------------------


@pytest.fixture(params=["pytrio", "tinker"])
def remote(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Recorder, str]:
    kind = request.param
    sdk, rec = make_fake_sdk(kind, futures_of_clients=(kind == "tinker"))
    monkeypatch.setitem(sys.modules, kind, sdk)
    monkeypatch.setenv("PYTRIO_API_KEY", "test-key")
    monkeypatch.setenv("TINKER_API_KEY", "test-key")
    from retool.backends import make_training_client

    cfg = load_config(
        None, [f'backend.kind="{kind}"', 'model.name="Qwen/Qwen3-4B"', "lora.rank=16", "train.seed=7"]
    )
    client = make_training_client(cfg)
    return client, rec, kind


def _datums() -> list[Datum]:
    # prompt positions weight 0; two trajectories with opposite advantages; loop weights 1/n_tok/n_datums
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


# -- tests --------------------------------------------------------------------------------------------


def test_client_creation_resolves_futures_and_passes_lora(remote: tuple[Any, Recorder, str]) -> None:
    client, rec, _kind = remote
    assert hasattr(client._client, "forward_backward")  # a future of a client was resolved (tinker)
    _name, kwargs = next(c for c in rec.calls if c[0] == "create_lora_training_client")
    assert kwargs["base_model"] == "Qwen/Qwen3-4B" and kwargs["rank"] == 16 and kwargs["seed"] == 7
    assert kwargs["train_attn"] and not kwargs["train_mlp"]  # default targets are attention projections


def test_forward_backward_masks_folds_weights_and_matches_loop_loss(
    remote: tuple[Any, Recorder, str],
) -> None:
    client, rec, kind = remote
    datums = _datums()
    res = client.forward_backward(datums, "ppo", {"clip_low": 0.8, "clip_high": 1.28})
    data, loss_fn, cfg = next(c[1] for c in rec.calls if c[0] == "forward_backward")
    assert loss_fn == "ppo"
    assert cfg == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}
    n_active = sum(1 for d in datums for w in d.weights if w)
    scale = float(n_active) if kind == "pytrio" else 1.0
    assert res.extra["reduction_scale"] == scale
    for d, sent in zip(datums, data, strict=True):
        inp = sent.loss_fn_inputs
        assert sent.model_input.to_ints() == d.input_tokens
        assert set(inp) == {"target_tokens", "logprobs", "advantages"}  # no weights/mask keys for RL losses
        tgt = inp["target_tokens"].tolist()
        adv = inp["advantages"].tolist()
        for j, w in enumerate(d.weights):
            if w == 0:
                assert adv[j] == 0.0
                assert tgt[j] == (-100 if kind == "pytrio" else d.target_tokens[j])
            else:
                assert tgt[j] == d.target_tokens[j]
                assert adv[j] == pytest.approx(d.advantages[j] * w * scale)
        assert inp["target_tokens"].dtype == "int64"
    # The fake server's own reduction applied to what was sent gives back the loop's weighted sum.
    server_view = res.extra["server/loss:sum"] if kind == "tinker" else res.extra["server/loss:mean"]
    assert server_view == pytest.approx(res.loss, rel=1e-6)
    assert res.trained_tokens == n_active
    assert res.ratio_min < 1 < res.ratio_max
    assert 0 < res.clip_fraction < 1
    if kind == "pytrio":
        assert res.extra["server/denominator"] == pytest.approx(scale)


def test_cross_entropy_sends_weights(remote: tuple[Any, Recorder, str]) -> None:
    client, rec, kind = remote
    datums = [Datum([1, 2, 3], [2, 3, 4], weights=[0.0, 0.5, 0.5])]
    res = client.forward_backward(datums, "cross_entropy")
    data, _loss_fn, cfg = next(c[1] for c in rec.calls if c[0] == "forward_backward")
    assert cfg is None
    inp = data[0].loss_fn_inputs
    scale = 2.0 if kind == "pytrio" else 1.0
    assert inp["weights"].tolist() == [0.0, 0.5 * scale, 0.5 * scale]
    assert res.loss == pytest.approx(-(0.5 * learner_lp(3) + 0.5 * learner_lp(4)))


def test_negative_weights_and_bad_losses_are_refused(remote: tuple[Any, Recorder, str]) -> None:
    client, rec, _kind = remote
    d = Datum([1, 2], [2, 3], [-1.0, -1.0], [1.0, 1.0], [1.0, -1.0])
    with pytest.raises(ValueError, match="negative"):
        client.forward_backward([d], "ppo")
    with pytest.raises(ValueError, match="unknown loss_fn"):
        client.forward_backward([d], "dro")
    with pytest.raises(ValueError, match="needs logprobs"):
        client.forward_backward([Datum([1], [2])], "importance_sampling")
    assert "forward_backward" not in rec.names()


def test_optim_step_maps_adam_params(remote: tuple[Any, Recorder, str]) -> None:
    client, rec, _kind = remote
    res = client.optim_step(AdamParams(lr=4e-5, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01))
    sent = next(c[1] for c in rec.calls if c[0] == "optim_step")
    assert (
        sent.learning_rate == 4e-5 and sent.beta2 == 0.95 and sent.eps == 1e-8 and sent.weight_decay == 0.01
    )
    assert res.grad_norm == 1.5 and client.step == 1


def test_build_model_aliases_and_drops() -> None:
    from retool.backends.remote import build_model

    class LrAdam(_Model):
        model_fields: ClassVar[dict[str, Any]] = {"lr": 1e-4, "beta1": 0.9}

    p = build_model(LrAdam, learning_rate=3e-5, beta1=0.8, grad_clip_norm=0.0)
    assert p.lr == 3e-5 and p.beta1 == 0.8


def test_sampling_client_and_stop_handling(remote: tuple[Any, Recorder, str]) -> None:
    client, rec, _kind = remote
    client.tokenizer = types.SimpleNamespace(eos_token="<|im_end|>", eos_token_id=2)
    sampler = client.sampling_client()
    assert rec.names().count("save_weights_and_get_sampling_client") == 1
    out = sampler.sample(
        [1, 2, 3], 2, SamplingParams(max_tokens=16, temperature=0.7, seed=3, stop=("</code>",))
    )
    prompt, n, params = next(c[1] for c in rec.calls if c[0] == "sample")
    assert prompt == [1, 2, 3] and n == 2
    assert params.max_tokens == 16 and params.temperature == 0.7 and params.seed == 3
    assert params.stop == ["</code>", "<|im_end|>"]  # an explicit stop list keeps EOS
    assert [s.stop_reason for s in out] == ["stop", "length"]
    assert out[0].tokens == [10, 11, 12] and out[0].logprobs == pytest.approx(
        [learner_lp(t) for t in [10, 11, 12]]
    )
    sampler.sample([1], 1, SamplingParams(max_tokens=4))
    assert [c[1][2].stop for c in rec.calls if c[0] == "sample"][-1] is None  # None keeps the service's EOS
    sampler.sample([1], 1, SamplingParams(max_tokens=4, stop=(7,)))
    assert [c[1][2].stop for c in rec.calls if c[0] == "sample"][-1] == [7, 2]
    # max_tokens is capped by the model context (config model.max_context = 8192)
    sampler.sample([1] * 8190, 1, SamplingParams(max_tokens=100))
    assert [c[1][2].max_tokens for c in rec.calls if c[0] == "sample"][-1] == 2
    n_calls = rec.names().count("sample")
    full = sampler.sample([1] * 8192, 2, SamplingParams(max_tokens=100))
    assert [s.stop_reason for s in full] == ["length", "length"] and rec.names().count("sample") == n_calls


def test_missing_logprobs_is_a_clear_error(remote: tuple[Any, Recorder, str]) -> None:
    client, rec, _kind = remote
    from retool.backends.remote import RemoteSamplingClient

    sampler = RemoteSamplingClient(client._sdk, FakeSampler(rec, with_logprobs=False), client)
    with pytest.raises(RuntimeError, match="no sampling logprobs"):
        sampler.sample([1, 2], 1, SamplingParams(max_tokens=3))


def test_checkpoint_paths(remote: tuple[Any, Recorder, str]) -> None:
    client, rec, kind = remote
    path = client.save_state("step-10")
    assert path == f"{kind}://run-1/weights/step-10"
    client.load_state(path)
    assert ("load_state_with_optimizer", path) in rec.calls
    if kind == "pytrio":
        with pytest.raises(ValueError, match="must match"):
            client.save_state("bad name/with slash")


def test_missing_sdk_and_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from retool.backends import make_training_client

    for kind in ("pytrio", "tinker"):
        monkeypatch.setitem(sys.modules, kind, None)  # import fails as if not installed
        cfg = load_config(None, [f'backend.kind="{kind}"'])
        with pytest.raises(BackendUnavailableError, match=f"retool-rl\\[{kind}\\]"):
            make_training_client(cfg)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("PYTRIO_API_KEY", raising=False)
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    for kind, var in (("pytrio", "PYTRIO_API_KEY"), ("tinker", "TINKER_API_KEY")):
        sdk, rec = make_fake_sdk(kind, futures_of_clients=False)
        monkeypatch.setitem(sys.modules, kind, sdk)
        with pytest.raises(BackendUnavailableError, match=var):
            make_training_client(load_config(None, [f'backend.kind="{kind}"']))
        assert rec.calls == []  # nothing was contacted


def test_pytrio_rank_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    from retool.backends import make_training_client

    sdk, _rec = make_fake_sdk("pytrio", futures_of_clients=False)
    monkeypatch.setitem(sys.modules, "pytrio", sdk)
    monkeypatch.setenv("PYTRIO_API_KEY", "k")
    with pytest.raises(ValueError, match="rank 4-64"):
        make_training_client(load_config(None, ['backend.kind="pytrio"', "lora.rank=128"]))
