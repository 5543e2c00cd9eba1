"""Every policy loss through the local backend (the path ``retool train`` and ``retool serve`` take): the
loss it reports and the parameter gradient it accumulates, on a tiny model across several micro-batches,
against the hand-written per-token formulas of ``loss_reference`` chained through the model by autograd."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from loss_reference import ref_cispo, ref_dro, ref_gspo, ref_stable
from retool.backends.interface.types import Datum
from retool.backends.local.client import LocalTrainingClient

Token = tuple[float, float, float, float]  # lp, old, adv, w


def _per_token(
    loss_fn: str, cfg: dict[str, float]
) -> Callable[[list[Token], list[float]], list[tuple[float, float]]]:
    def rows(row: list[Token], mask: list[float]) -> list[tuple[float, float]]:
        if loss_fn == "gspo":
            return ref_gspo(row, mask, cfg.get("clip_low", 0.8), cfg.get("clip_high", 1.28))
        out = []
        for tok in row:
            if not tok[3]:
                out.append((0.0, 0.0))
            elif loss_fn == "cispo":
                out.append(ref_cispo(*tok, cfg.get("clip_low", 0.8), cfg.get("clip_high", 1.28)))
            elif loss_fn == "dro":
                out.append(ref_dro(*tok, cfg.get("beta", 0.05)))
            else:
                out.append(ref_stable(*tok, cfg.get("ratio_cap", 2.0), cfg.get("kl_coeff", 0.0)))
        return out

    return rows


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path) -> LocalTrainingClient:
    torch.set_num_threads(1)
    # 24 tokens per micro-batch: the three datums below take two micro-batches
    return LocalTrainingClient(tiny_model_dir, lora=None, device="cpu", seed=0, micro_batch_tokens=24)


def _datums(client: LocalTrainingClient) -> list[Datum]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for k, (n, n_prompt) in enumerate([(12, 4), (9, 3), (7, 2)]):
        ids = torch.randint(3, 200, (n + 1,), generator=gen).tolist()
        with torch.no_grad():
            t = torch.tensor([ids[:-1]])
            lp = client.target_logprobs(t, torch.ones_like(t), torch.tensor([ids[1:]]))[0].tolist()
        # sampler logprobs off from the learner's by up to +-1 nat: ratios inside and outside every band
        noise = (torch.rand(n, generator=gen) * 2 - 1).tolist()
        old = [0.0] * n_prompt + [lp[i] + noise[i] for i in range(n_prompt, n)]
        adv = [0.0] * n_prompt + [(1.0, -0.5, 2.0)[k]] * (n - n_prompt)
        w = [0.0] * n_prompt + [1.0] * (n - n_prompt)
        out.append(Datum(ids[:-1], ids[1:], logprobs=old, advantages=adv, weights=w))
    return out


CASES = [
    ("cispo", {}),
    ("cispo", {"clip_low": 0.9, "clip_high": 1.1}),
    ("dro", {"beta": 0.3}),
    ("gspo", {"clip_low": 0.8, "clip_high": 1.2}),
    ("stable_reinforce", {}),
    ("stable_reinforce", {"kl_coeff": 0.2, "ratio_cap": 1.5}),
]


@pytest.mark.parametrize(("loss_fn", "cfg"), CASES)
def test_local_backend_loss_and_gradient_match_the_formula(
    client: LocalTrainingClient, loss_fn: str, cfg: dict[str, float]
) -> None:
    datums = _datums(client)
    client._zero_grad()
    result = client.forward_backward(datums, loss_fn, cfg)  # type: ignore[arg-type]
    assert result.extra["micro_batches"] == 2.0
    got = [p.grad.detach().clone() for p in client.trainable_parameters() if p.grad is not None]
    assert result.token_logprobs is not None
    refs = _per_token(loss_fn, cfg)
    expected_loss = 0.0
    client._zero_grad()
    surrogate = torch.zeros((), dtype=torch.float64)
    for d, lps in zip(datums, result.token_logprobs, strict=True):
        row = list(zip(lps, d.logprobs, d.advantages, d.weights, strict=True))
        per = refs(row, [1.0 if w else 0.0 for w in d.weights])
        expected_loss += sum(v for v, _ in per)
        # the model's gradient is sum_t dL/dlp_t * dlp_t/dtheta: chain the hand-derived dL/dlp through it
        t = torch.tensor([d.input_tokens])
        lp = client.target_logprobs(t, torch.ones_like(t), torch.tensor([d.target_tokens]))[0]
        surrogate = surrogate + (torch.tensor([g for _, g in per], dtype=torch.float64) * lp.double()).sum()
    surrogate.backward()
    want = [p.grad.detach().clone() for p in client.trainable_parameters() if p.grad is not None]
    client._zero_grad()
    assert result.loss == pytest.approx(expected_loss, rel=1e-4, abs=1e-5)
    assert len(got) == len(want) > 0
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e.to(g.dtype), rtol=1e-3, atol=1e-6)


def test_retool_train_config_selects_every_local_loss_and_keeps_them_off_remote_backends() -> None:
    from retool.config import ConfigError, load_config
    from retool.train.loop import _loss_config

    expected = {
        "cispo": {"clip_low": 0.8, "clip_high": 1.28},
        "gspo": {"clip_low": 0.8, "clip_high": 1.28},
        "dro": {"beta": 0.25},
        "stable_reinforce": {"kl_coeff": 0.1, "ratio_cap": 2.0},
    }
    for name, want in expected.items():
        cfg = load_config("tiny", [f"loss.name={name}", "loss.beta=0.25", "loss.kl_coeff=0.1"])
        assert _loss_config(cfg) == want
    with pytest.raises(ConfigError, match="local backend only"):
        load_config("tiny", ["loss.name=dro", "backend.kind=tinker"])
