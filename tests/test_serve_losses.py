"""Every loss the installed SDKs name, through ``retool serve`` by the SDKs themselves: the loss the server
reports against the documented formula computed here from the logprobs it returns (Tinker: the plain sum;
PyTRIO: divided by the SDK's token count), stable_reinforce's stability info and provenance, and the
``custom`` loss both ways the Tinker SDK sends it. Gradients of the same code path are checked against
hand-derived ones in ``test_backends_losses`` and ``test_backends_local_losses``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytrio
import tinker
import torch
from pytrio import types as ptypes
from tinker import types as ttypes

from loss_reference import ref_cispo, ref_dro, ref_gspo, ref_stable
from serve_harness import ServeProcess


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    root = tmp_path_factory.mktemp("serve-losses") / "root"
    with ServeProcess(tiny_model_dir, root) as proc:
        yield proc


@pytest.fixture
def tinker_client(server: ServeProcess, sdk_env: Path) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=server.url, api_key="tml-local")
    yield client
    try:
        client.close("success").result(timeout=5)
    except Exception:  # the heartbeat thread stops either way
        pass


def _expected(
    loss_fn: str, rows: list[list[tuple[float, float, float, float]]], masks: list[list[float]], cfg: dict
) -> float:
    """The documented per-token formula summed over tokens and datums (loss_reference), in plain floats."""
    lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    total = 0.0
    for row, mask in zip(rows, masks, strict=True):
        if loss_fn == "gspo":
            total += sum(v for v, _ in ref_gspo(row, mask, lo, hi))
            continue
        for lp, old, adv, w in row:
            if not w:
                continue
            if loss_fn == "importance_sampling":
                total += -w * float(np.exp(lp - old)) * adv
            elif loss_fn == "ppo":
                r = float(np.exp(lp - old))
                total += -w * min(r * adv, min(max(r, lo), hi) * adv)
            elif loss_fn == "cispo":
                total += ref_cispo(lp, old, adv, w, lo, hi)[0]
            elif loss_fn == "dro":
                total += ref_dro(lp, old, adv, w, cfg.get("beta", 0.05))[0]
            else:
                total += ref_stable(lp, old, adv, w, cfg.get("ratio_cap", 2.0), cfg.get("kl_coeff", 0.0))[0]
    return total


def _sampled(client: tinker.ServiceClient, model: Path) -> tuple[Any, list[int], Any]:
    trainer = client.create_lora_training_client(base_model=str(model), rank=4, seed=5).result()
    sampler = trainer.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = [5, 6, 7, 8]
    got = sampler.sample(
        prompt=ttypes.ModelInput.from_ints(prompt),
        num_samples=2,
        sampling_params=ttypes.SamplingParams(max_tokens=5, temperature=1.0, seed=11),
    ).result()
    return trainer, prompt, got.sequences


def _tinker_datum(
    prompt: list[int], seq: Any, adv: float, shift: list[float], loss_fn: str, provenance: bool = True
) -> tuple[Any, list[float], list[float], list[float]]:
    """A datum whose sampler logprobs are the sampled ones moved by ``shift`` (ratios away from 1); the
    returned lists are the per-position sampler logprobs, advantages and sequence-ratio mask."""
    tokens = list(seq.tokens)
    full = prompt + tokens
    first = len(prompt) - 1
    old = [0.0] * first + [lp + d for lp, d in zip(seq.logprobs, shift, strict=True)]
    advs = [0.0] * first + [adv] * len(tokens)
    mask = [0.0] * first + [1.0] * len(tokens)
    inputs: dict[str, Any] = {
        "target_tokens": np.asarray(full[1:], dtype=np.int64),
        "logprobs": np.asarray(old, dtype=np.float32),
        "advantages": np.asarray(advs, dtype=np.float32),
    }
    if loss_fn == "gspo":
        inputs["sequence_ratio_mask"] = np.asarray(mask, dtype=np.float32)
    datum = ttypes.Datum(model_input=ttypes.ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs)
    if provenance:
        sid = seq.sequence_id
        datum = datum.with_provenance(
            model_input=[
                ttypes.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
                ttypes.SampledProvenanceSpan(sequence_id=sid, length=len(tokens) - 1),
            ],
            loss_fn_inputs=[
                ttypes.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
                ttypes.SampledProvenanceSpan(sequence_id=sid, length=len(tokens)),
            ],
        )
    return datum, old, advs, mask


SHIFTS = [[0.9, -0.6, 0.05, -0.02, 0.4], [-0.9, 0.3, 0.0, 0.7, -0.1]]
TINKER_CASES = [
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", {}),
    ("cispo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}),
    ("dro", {}),
    ("dro", {"beta": 0.5}),
    ("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("stable_reinforce", {}),
    ("stable_reinforce", {"kl_coeff": 0.2}),
]


def test_every_tinker_loss_reports_its_documented_formula(
    tinker_client: tinker.ServiceClient, tiny_model_dir: Path
) -> None:
    trainer, prompt, seqs = _sampled(tinker_client, tiny_model_dir)
    assert all(s.sequence_id and len(s.tokens) == 5 for s in seqs)
    for loss_fn, cfg in TINKER_CASES:
        built = [
            _tinker_datum(prompt, s, a, d, loss_fn) for s, a, d in zip(seqs, [1.0, -0.5], SHIFTS, strict=True)
        ]
        out = trainer.forward([b[0] for b in built], loss_fn, cfg or None).result()
        lps = [o["logprobs"].tolist() for o in out.loss_fn_outputs]
        rows, masks = [], []
        for (_, old, advs, mask), lp, seq in zip(built, lps, seqs, strict=True):
            if loss_fn == "stable_reinforce":
                # trained against the *recorded* sampler logprobs, on the sampled positions only
                first = len(prompt) - 1
                old = [0.0] * first + list(seq.logprobs)
                w = mask
            else:
                w = [1.0] * len(lp)  # Tinker sums over every position (prompt ones have advantage 0)
            rows.append(list(zip(lp, old, advs, w, strict=True)))
            masks.append(mask)
        want = _expected(loss_fn, rows, masks, cfg)
        got = out.metrics["loss:sum"]
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5), (loss_fn, cfg)
    # a backward pass and a step with the cookbook's default loss
    data = [
        _tinker_datum(prompt, s, a, d, "stable_reinforce")[0]
        for s, a, d in zip(seqs, [1.0, -0.5], SHIFTS, strict=True)
    ]
    trainer.forward_backward(data, "stable_reinforce")
    assert trainer.optim_step(ttypes.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm:mean"] > 0


def test_stable_reinforce_checks_provenance_and_gspo_its_mask(
    server: ServeProcess, tinker_client: tinker.ServiceClient, tiny_model_dir: Path
) -> None:
    trainer, prompt, seqs = _sampled(tinker_client, tiny_model_dir)
    bare = _tinker_datum(prompt, seqs[0], 1.0, SHIFTS[0], "x", provenance=False)[0]
    with pytest.raises(tinker.BadRequestError, match="needs provenance"):
        trainer.forward([bare], "stable_reinforce").result(timeout=60)
    # provenance naming the other sequence: its recorded tokens are not this datum's targets
    datum = _tinker_datum(prompt, seqs[0], 1.0, SHIFTS[0], "x")[0]
    other = seqs[1].sequence_id
    spans = [
        ttypes.PromptProvenanceSpan(sequence_id=other, offset=1, length=len(prompt) - 1),
        ttypes.SampledProvenanceSpan(sequence_id=other, length=5),
    ]
    if list(seqs[0].tokens) != list(seqs[1].tokens):
        wrong = datum.with_provenance(model_input=datum.model_input_spans, loss_fn_inputs=spans)
        with pytest.raises(tinker.BadRequestError, match=r"not .*recorded sampled_tokens"):
            trainer.forward([wrong], "stable_reinforce").result(timeout=60)
    unknown = [ttypes.SampledProvenanceSpan(sequence_id="seq-nope", length=len(prompt) + 4)]
    ghost = datum.with_provenance(model_input=datum.model_input_spans, loss_fn_inputs=unknown)
    with pytest.raises(tinker.BadRequestError, match="no recorded stability info"):
        trainer.forward([ghost], "stable_reinforce").result(timeout=60)
    no_mask = _tinker_datum(prompt, seqs[0], 1.0, SHIFTS[0], "x", provenance=False)[0]
    with pytest.raises(tinker.BadRequestError, match="gspo needs sequence_ratio_mask"):
        trainer.forward([no_mask], "gspo").result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="not read by dro"):
        trainer.forward([no_mask], "dro", {"clip_low_threshold": 0.8}).result(timeout=60)
    # a second session cannot train on this session's sequences
    other_client = tinker.ServiceClient(base_url=server.url, api_key="tml-local")
    try:
        stranger = other_client.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
        with pytest.raises(tinker.BadRequestError, match="another session"):
            stranger.forward([datum], "stable_reinforce").result(timeout=60)
    finally:
        other_client.close("success").result(timeout=5)


def test_custom_losses_run_client_side_and_server_side_graphs_get_a_clear_400(
    tinker_client: tinker.ServiceClient, tiny_model_dir: Path
) -> None:
    trainer, prompt, seqs = _sampled(tinker_client, tiny_model_dir)
    full = prompt + list(seqs[0].tokens)
    datum = ttypes.Datum(
        model_input=ttypes.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(full[1:], dtype=np.int64)},
    )

    def mean_nll(data: list[Any], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        loss = -torch.stack([lp.mean() for lp in logprobs]).sum()
        return loss, {"mean_nll": float(loss.detach())}

    out = trainer.forward_backward_custom([datum], mean_nll).result()
    lp = trainer.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert out.metrics["mean_nll"] == pytest.approx(-float(np.mean(lp)), rel=1e-4)
    assert trainer.optim_step(ttypes.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm:mean"] > 0
    with pytest.raises(tinker.BadRequestError, match="forward_backward_custom"):
        trainer.forward_backward([datum], "custom", {"loss_id": 3.0}).result(timeout=60)


def _pytrio_datums(
    prompt: list[int], seqs: list[Any]
) -> tuple[list[Any], list[list[float]], list[list[float]]]:
    data, olds, advs = [], [], []
    for seq, adv, shift in zip(seqs, [1.0, -0.5], SHIFTS, strict=True):
        full = prompt + list(seq.tokens)
        first = len(prompt) - 1
        old = [0.0] * first + [lp + d for lp, d in zip(seq.logprobs, shift, strict=True)]
        a = [0.0] * first + [adv] * len(seq.tokens)
        inputs = {
            "target_tokens": np.asarray(full[1:], dtype=np.int64),
            "logprobs": np.asarray(old, dtype=np.float32),
            "advantages": np.asarray(a, dtype=np.float32),
        }
        inputs = {k: ptypes.TensorData.from_numpy(v) for k, v in inputs.items()}
        data.append(ptypes.Datum(model_input=ptypes.ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs))
        olds.append(old)
        advs.append(a)
    return data, olds, advs


@pytest.mark.parametrize(
    ("loss_fn", "cfg"),
    [
        ("cispo", {}),
        ("cispo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}),
        ("dro", {}),
        ("dro", {"beta": 0.5}),
    ],
)
def test_pytrio_cispo_and_dro_report_the_formula_over_the_sdk_denominator(
    server: ServeProcess, tiny_model_dir: Path, sdk_env: Path, loss_fn: str, cfg: dict[str, float]
) -> None:
    pytrio.configure(base_url=server.url, api_key="local", home=os.environ["HOME"])
    service = pytrio.ServiceClient(api_key="local")
    trainer = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=5)
    sampler = trainer.save_weights_and_get_sampling_client()
    prompt = [5, 6, 7, 8]
    params = ptypes.SamplingParams(max_tokens=5, temperature=1.0, seed=11)
    seqs = (
        sampler.sample(ptypes.ModelInput.from_ints(prompt), num_samples=2, sampling_params=params)
        .result()
        .sequences
    )
    seqs = [s for s in seqs if len(s.tokens) == 5]
    assert len(seqs) == 2
    data, olds, advs = _pytrio_datums(prompt, seqs)
    out = trainer.forward(data, loss_fn=loss_fn, loss_fn_config=cfg or None).result()
    lps = [np.asarray(o["logprobs"].to_numpy()).tolist() for o in out.loss_fn_outputs]
    rows = [
        list(zip(lp, o, a, [1.0] * len(lp), strict=True)) for lp, o, a in zip(lps, olds, advs, strict=True)
    ]
    total = _expected(loss_fn, rows, [[1.0] * len(r) for r in rows], cfg)
    # the SDK's denominators: every target position is active; advantage tokens are the sampled ones
    active = sum(len(r) for r in rows)
    with_adv = sum(1 for a in advs for x in a if x != 0)
    want = total / (with_adv if loss_fn == "dro" else active)
    assert out.metrics["loss_sum"] == pytest.approx(want, rel=1e-4, abs=1e-5)


# -- prompt logprobs (distillation and KL recipes) -------------------------------------------------------


def _trained_tinker(client: tinker.ServiceClient, model: Path) -> tuple[Any, list[int]]:
    """A LoRA trainer one step away from its init (so a sampler on the base would score differently)."""
    trainer, prompt, seqs = _sampled(client, model)
    data = [
        _tinker_datum(prompt, s, a, d, "ppo", provenance=False)[0]
        for s, a, d in zip(seqs, [1.0, -0.5], SHIFTS, strict=True)
    ]
    trainer.forward_backward(data, "importance_sampling")
    trainer.optim_step(ttypes.AdamParams(learning_rate=5e-2)).result()
    return trainer, [5, 9, 17, 3, 28, 11, 40]


def _trainer_prompt_logprobs(trainer: Any, prompt: list[int], sdk: Any) -> list[float]:
    inputs: dict[str, Any] = {"target_tokens": np.asarray(prompt[1:], dtype=np.int64)}
    if sdk is ptypes:
        inputs = {k: ptypes.TensorData.from_numpy(v) for k, v in inputs.items()}
    datum = sdk.Datum(model_input=sdk.ModelInput.from_ints(prompt[:-1]), loss_fn_inputs=inputs)
    out = trainer.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    return [float(x) for x in np.asarray(out.to_numpy() if hasattr(out, "to_numpy") else out.tolist())]


def test_tinker_prompt_logprobs_topk_and_targets_match_the_trainers_forward(
    tinker_client: tinker.ServiceClient, tiny_model_dir: Path
) -> None:
    trainer, prompt = _trained_tinker(tinker_client, tiny_model_dir)
    want = _trainer_prompt_logprobs(trainer, prompt, ttypes)
    sampler = trainer.save_weights_and_get_sampling_client().result()
    one = ttypes.SamplingParams(max_tokens=1, temperature=0.0)
    got = sampler.sample(
        prompt=ttypes.ModelInput.from_ints(prompt), num_samples=1, sampling_params=one,
        include_prompt_logprobs=True, topk_prompt_logprobs=3,
    ).result()  # fmt: skip
    assert got.prompt_logprobs is not None and got.prompt_logprobs[0] is None
    np.testing.assert_allclose(got.prompt_logprobs[1:], want, atol=2e-4)
    topk = got.topk_prompt_logprobs
    assert topk is not None and topk[0] is None and all(r is not None and len(r) == 3 for r in topk[1:])
    for i, row in enumerate(topk[1:], start=1):
        values = [lp for _, lp in row]
        assert values == sorted(values, reverse=True)
        assert values[0] >= want[i - 1] - 2e-4  # the best candidate is at least as likely as the prompt token
        if prompt[i] in [t for t, _ in row]:
            assert dict(row)[prompt[i]] == pytest.approx(want[i - 1], abs=2e-4)
    # target_prompt_logprobs: row i - 1 scores position i; -1 asks nothing and gets 0.0
    ids = np.full((len(prompt) - 1, 2), -1, dtype=np.int64)
    ids[:, 0] = prompt[1:]
    ids[2, 1] = topk[3][1][0]  # position 3's second candidate
    for target in (
        ttypes.TensorData.from_numpy(ids),
        ttypes.TensorData.from_torch_sparse(torch.from_numpy(ids), pad_value=-1),
    ):
        res = sampler.sample(
            prompt=ttypes.ModelInput.from_ints(prompt), num_samples=1, sampling_params=one,
            target_prompt_logprobs=target, prompt_logprobs_last_n=None,
        ).result()  # fmt: skip
        assert res.target_prompt_logprobs is not None
        dense = (
            res.target_prompt_logprobs.to_torch().numpy()
            if target.sparse_crow_indices is None
            else (res.target_prompt_logprobs.to_torch().to_dense().numpy())
        )
        np.testing.assert_allclose(dense[:, 0], want, atol=2e-4)
        assert dense[2, 1] == pytest.approx(topk[3][1][1], abs=1e-5)
        assert dense[0, 1] == 0.0
    last = sampler.sample(
        prompt=ttypes.ModelInput.from_ints(prompt), num_samples=1, sampling_params=one,
        include_prompt_logprobs=True, prompt_logprobs_last_n=2,
    ).result()  # fmt: skip
    assert last.prompt_logprobs is not None
    assert last.prompt_logprobs[:-2] == [None] * (len(prompt) - 2)
    np.testing.assert_allclose(last.prompt_logprobs[-2:], want[-2:], atol=2e-4)
    assert sampler.compute_logprobs(ttypes.ModelInput.from_ints(prompt)).result()[1:] == pytest.approx(
        want, abs=2e-4
    )


def test_pytrio_prompt_logprobs_match_the_trainers_forward(
    server: ServeProcess, tiny_model_dir: Path, sdk_env: Path
) -> None:
    pytrio.configure(base_url=server.url, api_key="local", home=os.environ["HOME"])
    service = pytrio.ServiceClient(api_key="local")
    trainer = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=5)
    prompt = [5, 9, 17, 3, 28, 11, 40]
    want = _trainer_prompt_logprobs(trainer, prompt, ptypes)
    sampler = trainer.save_weights_and_get_sampling_client()
    got = sampler.sample(
        ptypes.ModelInput.from_ints(prompt), num_samples=1,
        sampling_params=ptypes.SamplingParams(max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=2,
    ).result()  # fmt: skip
    assert got.prompt_logprobs[0] is None
    np.testing.assert_allclose(got.prompt_logprobs[1:], want, atol=2e-4)
    assert got.topk_prompt_logprobs[0] is None and all(len(r) == 2 for r in got.topk_prompt_logprobs[1:])
    assert sampler.compute_logprobs(ptypes.ModelInput.from_ints(prompt)).result()[1:] == pytest.approx(
        want, abs=2e-4
    )


def test_stability_records_are_bounded_in_tokens_session_scoped_and_expire(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from retool.serve import state as state_module
    from retool.serve.state import ServeError, StabilityRecord, StabilityRecords

    prompt = np.arange(6, dtype=np.int32)
    records = StabilityRecords(max_tokens=30, ttl_seconds=100.0)

    def rec(session: str) -> StabilityRecord:
        return StabilityRecord(session, prompt, np.arange(4, dtype=np.int32), np.zeros(4, dtype=np.float32))

    for k in range(3):
        records.add(f"s{k}", rec("a"))  # 10 tokens each: exactly at the bound
    assert len(records) == 3 and records.tokens == 30
    records.get("s0", "a")  # used: now the most recent
    records.add("s3", rec("a"))  # over the bound: the least recently used (s1) goes
    assert len(records) == 3 and records.tokens == 30
    with pytest.raises(ServeError, match="no recorded stability info"):
        records.get("s1", "a")
    with pytest.raises(ServeError, match="another session"):
        records.get("s0", "b")
    now = state_module.time.monotonic()
    monkeypatch.setattr(state_module.time, "monotonic", lambda: now + 101.0)
    with pytest.raises(ServeError, match="no recorded stability info"):
        records.get("s2", "a")  # a day (here 100 s) after its last use
    assert records.tokens == 20
