"""Loss math and micro-batch packing (pure functions, no model)."""

from __future__ import annotations

import math

import pytest
import torch

from loss_reference import ref_cispo, ref_dro, ref_gspo, ref_stable
from packing_baseline import greedy_micro_batches
from retool.backends.training.losses import token_loss
from retool.backends.training.packing import pack_micro_batches, padding_efficiency

LO, HI = 0.8, 1.28


def _reference_ppo(lp: float, old: float, adv: float, w: float) -> tuple[float, float, bool]:
    """Hand-written per-token PPO: loss, d loss / d lp, clipped?"""
    r = math.exp(lp - old)
    unclipped = r * adv
    clipped_obj = min(max(r, LO), HI) * adv
    loss = -w * min(unclipped, clipped_obj)
    # d/d lp of r*A is r*A; the clipped branch is constant in lp when r is outside [LO, HI]
    if unclipped <= clipped_obj or LO <= r <= HI:
        grad = -w * adv * r
        clipped = False
    else:
        grad = 0.0
        clipped = True
    return loss, grad, clipped


CASES = [
    # (lp, old, adv, w): ratios inside, above and below the thresholds, both advantage signs
    (-1.0, -1.0, 1.0, 1.0),
    (-1.0, -1.5, 2.0, 0.5),  # r = e^0.5 = 1.65 > HI, A > 0: clipped
    (-1.0, -1.5, -2.0, 0.5),  # r > HI, A < 0: not clipped
    (-2.0, -1.0, 1.5, 0.25),  # r = e^-1 = 0.37 < LO, A > 0: not clipped
    (-2.0, -1.0, -1.5, 0.25),  # r < LO, A < 0: clipped
    (-0.3, -0.4, -0.7, 2.0),  # r = 1.105 inside
    (-0.3, -0.2, 0.9, 1.0),  # r = 0.905 inside
    (-5.0, 0.0, 3.0, 0.0),  # weight 0 (e.g. padded old lp 0): contributes nothing
]


def test_ppo_loss_and_gradient_match_hand_reference() -> None:
    lp = torch.tensor([c[0] for c in CASES], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([c[1] for c in CASES], dtype=torch.float64)
    adv = torch.tensor([c[2] for c in CASES], dtype=torch.float64)
    w = torch.tensor([c[3] for c in CASES], dtype=torch.float64)
    out = token_loss("ppo", lp, w, old, adv, {"clip_low": LO, "clip_high": HI})
    out.loss.sum().backward()
    assert lp.grad is not None
    for k, case in enumerate(CASES):
        ref_loss, ref_grad, ref_clipped = _reference_ppo(*case)
        assert out.loss[k].item() == pytest.approx(ref_loss, abs=1e-12), k
        assert lp.grad[k].item() == pytest.approx(ref_grad, abs=1e-12), k
        if case[3] != 0:
            assert bool(out.clipped[k]) == ref_clipped, k
    assert not bool(out.clipped[-1]) and not bool(out.trained[-1])
    assert bool(out.clipped[1]) and bool(out.clipped[4])


def test_ppo_default_thresholds_are_0_8_and_1_28() -> None:
    lp = torch.tensor([0.0, 0.0])
    old = torch.tensor([-math.log(1.5), math.log(1 / 0.5)])  # r = 1.5, r = 0.5
    out = token_loss("ppo", lp, torch.ones(2), old, torch.tensor([1.0, -1.0]))
    assert out.loss[0].item() == pytest.approx(-1.28, rel=1e-6)
    assert out.loss[1].item() == pytest.approx(0.8, rel=1e-6)


def test_importance_sampling_and_cross_entropy() -> None:
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    old = torch.tensor([-1.5, -1.0, -0.5])
    adv = torch.tensor([1.0, -2.0, 0.5])
    w = torch.tensor([1.0, 0.5, 0.0])
    out = token_loss("importance_sampling", lp, w, old, adv)
    r = torch.exp(lp.detach() - old)
    expected = -w * r * adv
    torch.testing.assert_close(out.loss.detach(), expected)
    out.loss.sum().backward()
    torch.testing.assert_close(lp.grad, expected)  # d(-w r A)/d lp = -w r A
    lp2 = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ce = token_loss("cross_entropy", lp2, w)
    torch.testing.assert_close(ce.loss.detach(), torch.tensor([1.0, 1.0, 0.0]))
    ce.loss.sum().backward()
    torch.testing.assert_close(lp2.grad, -w)


def test_loss_rejects_bad_config() -> None:
    lp = torch.zeros(2)
    with pytest.raises(ValueError, match="unknown loss_fn"):
        token_loss("dpo", lp, torch.ones(2))
    with pytest.raises(ValueError, match="unknown loss_config"):
        token_loss("ppo", lp, torch.ones(2), lp, lp, {"epsilon": 0.2})
    with pytest.raises(ValueError, match="thresholds"):
        token_loss("ppo", lp, torch.ones(2), lp, lp, {"clip_low": 1.2})
    with pytest.raises(ValueError, match="needs sampler logprobs"):
        token_loss("ppo", lp, torch.ones(2))


def test_pack_micro_batches_respects_area_and_covers_everything() -> None:
    lengths = [5, 100, 37, 64, 3, 99, 12, 250, 41, 41]
    area = 200
    batches = pack_micro_batches(lengths, area)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(len(lengths)))
    for b in batches:
        longest = max(lengths[i] for i in b)
        assert len(b) * longest <= area or len(b) == 1
    # the oversize sequence gets a batch of its own
    assert [7] in batches
    eff = padding_efficiency(lengths, batches)
    assert 0 < eff <= 1
    naive = padding_efficiency(lengths, [[i] for i in range(len(lengths))])
    assert naive == 1.0
    one = padding_efficiency(lengths, [list(range(len(lengths)))])
    assert eff > one  # sorting by length wastes less than one big padded batch


@pytest.mark.parametrize("seed", range(5))
def test_packer_uses_fewest_batches_and_least_padding(seed: int) -> None:
    import random

    rng = random.Random(seed)
    lengths = [min(int(rng.lognormvariate(4.3, 0.7)), 700) + 4 for _ in range(40)]
    area = rng.choice([512, 1024, 4096])
    packed = pack_micro_batches(lengths, area)
    greedy = greedy_micro_batches(lengths, area)
    assert len(packed) == len(greedy)  # greedy filling is count-optimal; so is the packer
    assert padding_efficiency(lengths, packed) >= padding_efficiency(lengths, greedy) - 1e-12
    for b in packed:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= area


@pytest.mark.parametrize("seed", range(5))
def test_a_batch_cost_buys_tighter_micro_batches_at_the_least_total_cost(seed: int) -> None:
    """With ``batch_cost`` the packer minimises padded area + cost per micro-batch: never worse than the
    fewest-batches packing by that measure, and better where padding costs more than a micro-batch."""
    import itertools
    import random

    rng = random.Random(seed)
    lengths = [rng.choice([29, 29, 29, 53, 55, 65, 67, 75, 96, 120]) for _ in range(8)]
    area, cost = 1024, 64

    def total(batches: list[list[int]]) -> int:
        return sum(cost + len(b) * max(lengths[i] for i in b) for b in batches)

    packed = pack_micro_batches(lengths, area, batch_cost=cost)
    assert sorted(i for b in packed for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= area for b in packed)
    assert total(packed) <= total(pack_micro_batches(lengths, area))
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    cuts = [
        [order[a:b] for a, b in itertools.pairwise([0, *chosen, len(order)])]
        for k in range(len(order))
        for chosen in itertools.combinations(range(1, len(order)), k)
    ]
    fitting = [c for c in cuts if all(len(b) * max(lengths[i] for i in b) <= area for b in c)]
    assert total(packed) == min(total(c) for c in fitting)  # the best contiguous cut, found exhaustively


def test_a_long_short_batch_is_cut_in_two_when_padding_costs_more() -> None:
    lengths = [96, 75, 67, 65, 55, 53, 29, 29]
    assert len(pack_micro_batches(lengths, 1024)) == 1  # 8 x 96 fits: one batch, 299 tokens of padding
    cut = pack_micro_batches(lengths, 1024, batch_cost=64)  # padding costs more than two more batches
    assert len(cut) == 3 and padding_efficiency(lengths, cut) > 0.9


def test_pack_micro_batches_errors() -> None:
    with pytest.raises(ValueError):
        pack_micro_batches([1, 2], 0)
    assert pack_micro_batches([], 10) == []


def test_loss_tally_sums_over_calls_and_ignores_untrained_tokens() -> None:
    from retool.backends.training.losses import LossTally

    tally = LossTally()
    assert tally.result().ratio_mean == 1.0 and tally.result().clip_fraction == 0.0  # nothing trained
    lp = torch.tensor([-1.0, -1.0, -1.0])
    old = torch.tensor([-1.5, -1.0, -9.0])  # ratios e^0.5 (clipped), 1, e^8 (weight 0: not counted)
    w = torch.tensor([1.0, 1.0, 0.0])
    tl = token_loss("ppo", lp, w, old, torch.ones(3))
    sel = tally.add(tl)
    tally.add(token_loss("ppo", lp[1:2], w[1:2], old[1:2], torch.ones(1)))
    assert sel.tolist() == [True, True, False]
    res = tally.result({"k": 1.0})
    assert res.trained_tokens == 3 and res.extra == {"k": 1.0}
    assert res.loss == pytest.approx(float(tl.loss.sum()) - 1.0)
    assert res.ratio_max == pytest.approx(math.exp(0.5)) and res.ratio_min == pytest.approx(1.0)
    assert res.ratio_mean == pytest.approx((math.exp(0.5) + 2) / 3)
    assert res.clip_fraction == pytest.approx(1 / 3)


# -- truncated importance sampling and the sampler/trainer mismatch ---------------------------------------

CAP = 2.0
TIS_CASES = [
    # (lp, mu, adv, w): rho = exp(lp - mu) below, inside and above the cap, both advantage signs
    (-1.0, -1.0, 1.0, 1.0),  # on-policy: rho = 1
    (-1.0, -1.5, 2.0, 0.5),  # rho = e^0.5 = 1.65: weighted, not truncated (PPO against mu would clip)
    (-1.0, -2.0, -2.0, 0.5),  # rho = e^1 = 2.72 > CAP: truncated to 2
    (-2.0, -1.0, 1.5, 0.25),  # rho = e^-1 = 0.37
    (-0.2, -3.0, 0.7, 1.0),  # rho = e^2.8 = 16.4: truncated to 2
    (-5.0, 0.0, 3.0, 0.0),  # weight 0: nothing, whatever the logprobs
]


def _reference_tis(lp: float, mu: float, adv: float, w: float) -> tuple[float, float, bool]:
    """By hand: the weight min(rho, C) is a constant; the PPO ratio against the pre-update policy is 1, so
    its clip is inactive and the per-token loss is -w * min(rho, C) * A, its gradient the same times 1."""
    if w == 0:
        return 0.0, 0.0, False
    rho = math.exp(lp - mu)
    weight = min(rho, CAP)
    return -w * weight * adv, -w * weight * adv, rho > CAP


@pytest.mark.parametrize("loss_fn", ["ppo", "importance_sampling"])
def test_truncated_importance_sampling_matches_hand_reference(loss_fn: str) -> None:
    lp = torch.tensor([c[0] for c in TIS_CASES], dtype=torch.float64, requires_grad=True)
    mu = torch.tensor([c[1] for c in TIS_CASES], dtype=torch.float64)
    adv = torch.tensor([c[2] for c in TIS_CASES], dtype=torch.float64)
    w = torch.tensor([c[3] for c in TIS_CASES], dtype=torch.float64)
    out = token_loss(loss_fn, lp, w, mu, adv, {"clip_low": LO, "clip_high": HI, "tis_cap": CAP})
    out.loss.sum().backward()
    assert lp.grad is not None and out.truncated is not None
    for k, case in enumerate(TIS_CASES):
        ref_loss, ref_grad, ref_truncated = _reference_tis(*case)
        assert out.loss[k].item() == pytest.approx(ref_loss, abs=1e-12), k
        assert lp.grad[k].item() == pytest.approx(ref_grad, abs=1e-12), k
        assert bool(out.truncated[k]) == ref_truncated, k
        assert out.ratio[k].item() == 1.0 and not bool(out.clipped[k])  # the PPO ratio is pi / pi_old
    # Without TIS, case 1 is clipped by PPO (ratio against the sampler) and gets no gradient at all.
    plain = token_loss("ppo", lp.detach().requires_grad_(), w, mu, adv, {"clip_low": LO, "clip_high": HI})
    assert bool(plain.clipped[1]) and out.truncated.tolist() == [False, False, True, False, True, False]


def test_tis_cap_zero_is_exactly_the_loss_without_tis() -> None:
    torch.manual_seed(0)
    lp = torch.randn(64, dtype=torch.float64) - 2.0
    mu = lp + 0.3 * torch.randn(64, dtype=torch.float64)
    adv, w = torch.randn(64, dtype=torch.float64), torch.rand(64, dtype=torch.float64)
    grads = []
    for cfg in ({"clip_low": LO, "clip_high": HI}, {"clip_low": LO, "clip_high": HI, "tis_cap": 0.0}):
        x = lp.clone().requires_grad_()
        out = token_loss("ppo", x, w, mu, adv, cfg)
        out.loss.sum().backward()
        assert x.grad is not None
        grads.append((out.loss.detach(), x.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    with pytest.raises(ValueError, match="tis_cap must be >= 0"):
        token_loss("ppo", lp, w, mu, adv, {"tis_cap": -1.0})


def test_mismatch_metrics_match_hand_computation() -> None:
    from retool.backends.training.losses import LossTally

    lp = torch.tensor([-1.0, -1.0, -2.0, -0.2, -3.0])
    mu = torch.tensor([-1.0, -1.8, -1.0, -0.2, 0.0])  # the last one is padding: weight 0
    w = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0])
    tally = LossTally()
    tally.add(token_loss("ppo", lp, w, mu, adv, {"tis_cap": 2.0}))
    result = tally.result()
    diffs = [0.0, 0.8, -1.0, 0.0]  # lp - mu on the trained tokens
    assert result.mismatch_tokens == 4
    assert result.logprob_diff_mean == pytest.approx(sum(abs(d) for d in diffs) / 4, rel=1e-6)
    assert result.logprob_diff_max == pytest.approx(1.0, rel=1e-6)
    k3 = [math.exp(d) - 1 - d for d in diffs]
    assert result.kl_k3 == pytest.approx(sum(k3) / 4, rel=1e-5)
    # e^0.8 = 2.23 and e^-1 = 0.37 lie outside [0.5, 2]; e^0.8 > 2 is truncated
    assert result.ratio_outside == 0.5 and result.tis_truncated == 0.25
    # Cross entropy measures nothing: it has no sampler logprobs.
    ce = LossTally()
    ce.add(token_loss("cross_entropy", lp, w))
    assert ce.result().mismatch_tokens == 0


# -- cispo, dro, gspo, stable_reinforce: against hand-derived per-token formulas -------------------------
# Each reference is written in plain floats from the formula (value) and its derivative in lp (gradient),
# independent of the torch code; the batch mixes ratios inside and outside the clip band, both advantage
# signs, and a masked position whose padded sampler logprob is 0.

POLICY_ROWS = [
    # (lp, old, adv, w) per token of one sequence
    [(-1.0, -1.2, 1.0, 1.0), (-0.5, -1.5, 1.0, 1.0), (-2.0, -1.0, 1.0, 0.5), (-4.0, 0.0, 0.0, 0.0)],
    [(-0.3, -0.4, -0.7, 2.0), (-2.0, -1.0, -0.7, 1.0), (-0.2, -0.9, -0.7, 1.0), (-1.1, -1.0, -0.7, 1.0)],
]


def _tensors(rows: list[list[tuple[float, float, float, float]]]) -> tuple[torch.Tensor, ...]:
    cols = [torch.tensor([[tok[j] for tok in row] for row in rows], dtype=torch.float64) for j in range(4)]
    lp = cols[0].clone().requires_grad_(True)
    return lp, cols[1], cols[2], cols[3]


def _check(out_loss: torch.Tensor, grad: torch.Tensor, refs: list[list[tuple[float, float]]]) -> None:
    for r, row in enumerate(refs):
        for t, (value, g) in enumerate(row):
            assert out_loss[r, t].item() == pytest.approx(value, abs=1e-12), (r, t)
            assert grad[r, t].item() == pytest.approx(g, abs=1e-12), (r, t)


@pytest.mark.parametrize("cfg", [{}, {"clip_low": 0.5, "clip_high": 1.5}])
def test_cispo_loss_and_gradient_match_hand_reference(cfg: dict[str, float]) -> None:
    lp, old, adv, w = _tensors(POLICY_ROWS)
    out = token_loss("cispo", lp, w, old, adv, cfg)
    out.loss.sum().backward()
    assert lp.grad is not None
    lo, hi = cfg.get("clip_low", LO), cfg.get("clip_high", HI)
    refs = [[ref_cispo(*tok, lo, hi) if tok[3] else (0.0, 0.0) for tok in row] for row in POLICY_ROWS]
    _check(out.loss.detach(), lp.grad, refs)
    # r = e^1 = 2.72 is outside the band: counted clipped, yet (unlike PPO) its gradient is not zero
    assert bool(out.clipped[0, 1]) and lp.grad[0, 1].item() != 0.0


@pytest.mark.parametrize("beta", [None, 0.5])
def test_dro_loss_and_gradient_match_hand_reference(beta: float | None) -> None:
    lp, old, adv, w = _tensors(POLICY_ROWS)
    out = token_loss("dro", lp, w, old, adv, {} if beta is None else {"beta": beta})
    out.loss.sum().backward()
    assert lp.grad is not None
    b = 0.05 if beta is None else beta
    refs = [[ref_dro(*tok, b) if tok[3] else (0.0, 0.0) for tok in row] for row in POLICY_ROWS]
    _check(out.loss.detach(), lp.grad, refs)


@pytest.mark.parametrize("cfg", [{}, {"kl_coeff": 0.3, "ratio_cap": 1.5}])
def test_stable_reinforce_loss_and_gradient_match_hand_reference(cfg: dict[str, float]) -> None:
    lp, old, adv, w = _tensors(POLICY_ROWS)
    out = token_loss("stable_reinforce", lp, w, old, adv, cfg)
    out.loss.sum().backward()
    assert lp.grad is not None
    cap, kl = cfg.get("ratio_cap", 2.0), cfg.get("kl_coeff", 0.0)
    refs = [[ref_stable(*tok, cap, kl) if tok[3] else (0.0, 0.0) for tok in row] for row in POLICY_ROWS]
    _check(out.loss.detach(), lp.grad, refs)
    assert out.truncated is not None and bool(out.truncated[0, 1])  # r = e^1 > 2: weight cut to the cap


@pytest.mark.parametrize("use_mask", [False, True])
def test_gspo_loss_and_gradient_match_hand_reference(use_mask: bool) -> None:
    lp, old, adv, w = _tensors(POLICY_ROWS)
    # default mask: the trained positions; the explicit one leaves out the first token of each row
    masks = [[1.0 if tok[3] else 0.0 for tok in row] for row in POLICY_ROWS]
    if use_mask:
        masks = [[0.0, *m[1:]] for m in masks]
    ratio_mask = torch.tensor(masks, dtype=torch.float64) if use_mask else None
    out = token_loss("gspo", lp, w, old, adv, {"clip_low": 0.8, "clip_high": 1.2}, ratio_mask)
    out.loss.sum().backward()
    assert lp.grad is not None
    refs = [ref_gspo(row, m, 0.8, 1.2) for row, m in zip(POLICY_ROWS, masks, strict=True)]
    _check(out.loss.detach(), lp.grad, refs)
    # every trained token of a row carries the same (sequence) ratio
    for r in range(2):
        vals = out.ratio[r][w[r] != 0]
        torch.testing.assert_close(vals, vals[:1].expand_as(vals))


def test_gspo_refuses_a_sequence_without_ratio_tokens_and_new_losses_check_their_keys() -> None:
    lp, old, adv, w = _tensors(POLICY_ROWS)
    with pytest.raises(ValueError, match="sequence ratio mask"):
        token_loss("gspo", lp, w, old, adv, None, torch.zeros_like(lp))
    with pytest.raises(ValueError, match="unknown loss_config keys \\['clip_low'\\] for 'dro'"):
        token_loss("dro", lp, w, old, adv, {"clip_low": 0.8})
    with pytest.raises(ValueError, match="unknown loss_config keys"):
        token_loss("stable_reinforce", lp, w, old, adv, {"beta": 0.1})
    with pytest.raises(ValueError, match="beta must be >= 0"):
        token_loss("dro", lp, w, old, adv, {"beta": -1.0})
    with pytest.raises(ValueError, match="needs sampler logprobs"):
        token_loss("cispo", lp, w)
