"""Training forwards that run a micro-batch's shared prefix once (``retool.backends.local.shared_prefix``):
the loss, the per-token logprobs and the gradients are those of the plain forward; a micro-batch whose
rows share too little runs the plain way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from retool.backends.interface.types import Datum
from retool.backends.local.client import LocalTrainingClient
from retool.backends.local.shared_prefix import SHARE_MIN_SAVED_TOKENS, shared_input_prefix

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _datums(vocab: int, prefix: int, tails: list[int], seed: int = 1) -> list[Datum]:
    """RL-shaped datums after one shared prompt of ``prefix`` tokens, zero weight on the prompt."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(5, vocab, (prefix,), generator=g).tolist()
    out = []
    for n in tails:
        seq = head + torch.randint(5, vocab, (n + 1,), generator=g).tolist()
        total = len(seq) - 1
        lp = (-torch.rand(total, generator=g) * 6).tolist()
        adv = float(torch.randn((), generator=g))
        w = [0.0] * (prefix - 1) + [1.0 / n / len(tails)] * (total - prefix + 1)
        out.append(Datum(seq[:-1], seq[1:], lp, [adv] * total, w))
    return out


def _run(client: LocalTrainingClient, datums: list[Datum], share: bool, loss_fn: str) -> tuple:
    client.share_train_prefix = share
    for p in client.trainable_parameters():
        p.grad = None
    result = client.forward_backward(datums, loss_fn)
    grads = [p.grad.detach().clone() for p in client.trainable_parameters() if p.grad is not None]
    return result, grads


def test_which_micro_batches_share() -> None:
    d = _datums(100, 40, [5, 9, 3])
    assert shared_input_prefix(d, [0, 1, 2]) == 40  # the prompt (every row keeps a position of its own)
    assert shared_input_prefix(d, [1]) == 0  # one row: nothing to share
    short = _datums(100, SHARE_MIN_SAVED_TOKENS // 2 - 1, [5, 9], seed=2)
    assert shared_input_prefix(short, [0, 1]) == 0  # saves less than a second forward costs


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_a_shared_prefix_pass_is_the_plain_pass(tiny_model_dir: Path, lora: dict | None) -> None:
    client = LocalTrainingClient(tiny_model_dir, lora=lora, device="cpu", seed=0, micro_batch_tokens=4096)
    try:
        with torch.no_grad():  # LoRA B starts at zero: make every LoRA matrix get a gradient
            for name, p in client.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        datums = _datums(client.vocab_size, 48, [7, 12, 3, 20])
        for loss_fn in ("ppo", "cross_entropy"):
            (a, ga), (b, gb) = _run(client, datums, False, loss_fn), _run(client, datums, True, loss_fn)
            assert b.loss == pytest.approx(a.loss, rel=1e-5, abs=1e-6)
            for x, y in zip(a.token_logprobs or [], b.token_logprobs or [], strict=True):
                assert y == pytest.approx(x, abs=1e-4)
            scale = max(float(g.abs().max()) for g in ga)
            assert scale > 0 and len(ga) == len(gb)
            for x, y in zip(ga, gb, strict=True):
                torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5 * scale)
    finally:
        client.close()
