"""One base, many adapters (``retool.backends.local.client.load_base_model`` / ``share_module``, as ``retool serve``
uses them): clients on a shared base hold the very base tensors, train only their own LoRA tensors, never
change the base or each other, and cost the base once plus their adapters (counted over tensor storage)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from retool.backends.interface.clients import run_sync
from retool.backends.interface.types import AdamParams, Datum, SamplingParams
from retool.backends.local.client import LocalLoraSpec, LocalTrainingClient, load_base_model

LORA = LocalLoraSpec(
    rank=4,
    alpha=8,
    dropout=0.0,
    target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "lm_head"),
)


def _data() -> list[Datum]:
    seq = [5, 6, 7, 8, 9, 10, 11]
    return [Datum(seq[:-1], seq[1:], weights=[0.0, 0.0] + [1.0] * 4)]


def _storages(model: torch.nn.Module) -> dict[int, int]:
    return {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in (*model.parameters(), *model.buffers())
    }


def test_clients_on_a_shared_base_share_its_tensors_and_never_see_each_others_weights(
    tiny_model_dir: Path,
) -> None:
    torch.set_num_threads(1)
    base = load_base_model(str(tiny_model_dir), device="cpu")
    before = {k: v.clone() for k, v in base.state_dict().items()}
    clients = [
        LocalTrainingClient(
            tiny_model_dir, lora=LORA, device="cpu", seed=s, shared_base=base, merge_lora_for_sampling=False
        )
        for s in (0, 0, 1)
    ]
    a, b, _ = clients
    data = _data()
    start_b = b.forward(data, "cross_entropy").loss
    assert a.forward(data, "cross_entropy").loss == pytest.approx(
        start_b, rel=1e-6
    )  # same seed, same adapter
    for _ in range(3):
        a.forward_backward(data, "cross_entropy")
        a.optim_step(AdamParams(lr=5e-2, grad_clip_norm=0.0))
    assert a.forward(data, "cross_entropy").loss < start_b - 1e-3
    assert b.forward(data, "cross_entropy").loss == pytest.approx(start_b, rel=1e-6)
    for k, v in base.state_dict().items():  # the shared base is exactly as loaded
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    # a sampler snapshot of a and a sampler of b sample from their own weights
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    frozen = run_sync(a.frozen_sampling_client_async())
    assert frozen.sample([5, 6, 7], 1, greedy)[0].logprobs != b.sample([5, 6, 7], 1, greedy)[0].logprobs

    # memory: every client's tensors other than its LoRA ones are the base's own storage
    base_bytes = _storages(base)
    seen: dict[int, int] = dict(base_bytes)
    adapters = 0
    for client in clients:
        own = {ptr: n for ptr, n in _storages(client.model).items() if ptr not in base_bytes}
        lora = [p for n, p in client.model.named_parameters() if "lora_" in n]
        lora_bytes = sum(p.numel() * p.element_size() for p in lora)
        assert sum(own.values()) == lora_bytes > 0, "a client holds more than its adapter"
        assert set(own).isdisjoint(seen), "two clients share an adapter tensor"
        seen.update(own)
        adapters += lora_bytes
    assert sum(seen.values()) == sum(base_bytes.values()) + adapters  # the base once, plus the adapters

    # a client without LoRA on a shared base samples but never trains it
    plain = LocalTrainingClient(tiny_model_dir, lora=None, device="cpu", shared_base=base)
    assert plain.sample([5, 6, 7], 1, greedy)[0].tokens
    with pytest.raises(ValueError, match="cannot train"):
        plain.forward_backward(data, "cross_entropy")
    for client in [*clients, plain]:
        client.close()
