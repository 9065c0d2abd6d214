"""Loss and ratio details against SkyRL's own functions (the skyrl wheel, tests/skyrl_oracle.py): the
``sequence_mean``/``seq_mean_token_sum_norm`` divisor (every row of the mini-batch, empty ones too), the
PPO ratio's ±20 log clamp, the rollout-correction sequence log-ratio clamped on the sum (not per token), and
the ``is_ratio_std`` metric (issue 35, item 3). SkyRL's ``safe_exp_delta`` computes in float32: 1e-6 relative."""

from __future__ import annotations

import math

import pytest
import torch
from skyrl_oracle import ppo_utils, skyrl_module

from mlora.rl.losses import agg_loss, loss_normalizer, policy_loss
from mlora.rl.rollout_correction import OffPolicyCorrection, off_policy_correction, sequence_mask, sequence_tis_weights

pytestmark = pytest.mark.quick

T = torch.tensor
D = torch.float64
REL = 1e-6


def skyrl_safe_exp_delta(delta: torch.Tensor, clip: float = 20.0) -> torch.Tensor:
    return skyrl_module("backends.skyrl_train.utils.torch_utils").safe_exp_delta(delta, clip=clip)


def skyrl_reduced(loss: torch.Tensor, loss_mask: torch.Tensor, loss_reduction: str, max_seq_len: int) -> float:
    # SkyRL scales the advantages (the loss is linear in them) so that reduce_loss, (loss * loss_mask).sum(),
    # gives the mean: scaling the per-token loss instead is the same
    scaled = ppo_utils().apply_loss_reduction_to_advantages_minibatch(loss, loss_mask, loss_reduction, 1, max_seq_len)
    return float((scaled * loss_mask).sum())


# three rows; the last was zeroed by overlong filtering (its loss mask is all 0), as SkyRL's
# apply_overlong_filtering does: it still counts as a row of the mini-batch
LOSS = T([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [7.0, 8.0, 9.0]], dtype=D)
MASK = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=D)


@pytest.mark.parametrize("mode,skyrl", [("seq-mean-token-mean", "sequence_mean"),
                                        ("seq-mean-token-sum-norm", "seq_mean_token_sum_norm")])
def test_sequence_modes_divide_by_every_row(mode, skyrl):
    ref = skyrl_reduced(LOSS, MASK, skyrl, max_seq_len=8)
    assert agg_loss(LOSS, MASK, mode, max_seq_len=8).item() == pytest.approx(ref, rel=REL)
    # the engine's path: micro-batches of one row, each normalised by the mini-batch's count, summed
    n = loss_normalizer(MASK, mode)
    assert n == 3.0
    parts = sum(agg_loss(LOSS[i:i + 1], MASK[i:i + 1], mode, n, max_seq_len=8) for i in range(3))
    assert parts.item() == pytest.approx(ref, rel=REL)


def test_ppo_ratio_log_clamp():
    # skyrl/backends/skyrl_train/utils/ppo_utils.py: ppo_policy_loss, ratio = safe_exp_delta(log_probs -
    # old_log_probs, clip=20.0); loss = -min(ratio·A, clamp(ratio, 1-ε_low, 1+ε_high)·A); reduce_loss over
    # token_mean-scaled advantages
    log_probs = T([[-0.5, -1.0]], dtype=D, requires_grad=True)
    old = T([[-30.5, -1.1]], dtype=D)  # log-ratios 30 (past the clamp) and 0.1
    adv = T([[-1.0, 2.0]], dtype=D)
    mask = torch.ones_like(adv)
    ratio = skyrl_safe_exp_delta(log_probs.detach() - old)
    ref = -torch.minimum(ratio * adv, ratio.clamp(1 - 0.2, 1 + 0.2) * adv)
    ref = float((ref * mask / mask.sum()).sum())
    got, _ = policy_loss(log_probs, old, adv, mask)
    assert got.item() == pytest.approx(ref, rel=REL)
    # token 0: -A·ρ = exp(20), not exp(30); token 1: ρ = e^0.1 inside the clip, -A·ρ = -2·e^0.1
    assert got.item() == pytest.approx((math.exp(20) - 2 * math.exp(0.1)) / 2, rel=REL)
    got.backward()
    assert log_probs.grad[0, 0].item() == 0.0  # the clamp stops the gradient past ±20, as in SkyRL


def test_sequence_log_ratio_clamped_on_the_sum():
    # skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py: compute_tis_ratio ("sequence") and
    # compute_sequence_mask sum the *unclamped* token log-ratios, then safe_exp_delta clamps the sum (or the
    # geometric mean) once
    old = T([[30.0, -15.0, 0.0], [15.0, 15.0, 0.0], [50.0, -40.0, 0.0]], dtype=D)  # rollout log-probs 0
    mu = torch.zeros_like(old)
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=D)
    seq_log = ((old - mu) * mask).sum(-1, keepdim=True)  # 15, 30 (each token within ±20), 10
    ref_tis = skyrl_safe_exp_delta(seq_log).clamp(max=1e12)
    w, _ = sequence_tis_weights(old - mu, mask, 1e12)
    torch.testing.assert_close(w, ref_tis, rtol=REL, atol=0)
    assert w[0, 0].item() == pytest.approx(math.exp(15))  # a per-token clamp would give exp(20 - 15)
    ref_geo = skyrl_safe_exp_delta(seq_log / mask.sum(-1, keepdim=True).clamp(min=1))  # 7.5, 15, 5: all over
    keep, m = sequence_mask(old - mu, mask, "geometric", 0.99, 1.01)
    assert keep.flatten().tolist() == [0.0, 0.0, 0.0]
    assert m["geo_sequence_mask_over_high_ratio"] == float((ref_geo > 1.01).float().mean()) == 1.0
    assert m["geo_sequence_mask_under_low_ratio"] == 0.0  # a per-token clamp puts row 2 at exp(-10): under
    # the combined factor carries the same sequence weight
    f, _ = off_policy_correction(old, mu, mask, OffPolicyCorrection(tis_ratio_type="sequence",
                                                                    sequence_tis_ratio_clip_high=1e12))
    torch.testing.assert_close(f, ref_tis.expand_as(f), rtol=REL, atol=0)


def test_is_ratio_std():
    # skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py: compute_off_policy_correction,
    # is_ratio = safe_exp_delta(old - rollout); is_ratio_std = (is_ratio * loss_mask).std()
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g, dtype=D)
    mu = old + 0.3 * torch.randn(3, 5, generator=g, dtype=D)
    cfg = OffPolicyCorrection(tis_ratio_type="token")
    full = torch.ones_like(old)  # no padding: SkyRL's formula exactly
    _, m = off_policy_correction(old, mu, full, cfg)
    assert m["is_ratio_std"] == pytest.approx(float((skyrl_safe_exp_delta(old - mu) * full).std()), rel=REL)
    # with padding, mlora takes the std over response tokens only (SkyRL's counts the padding as zeros, so its
    # value depends on how a micro-batch was padded): a deliberate difference, stated in docs/algorithms.md
    mask = full.clone()
    mask[1, 3:] = 0.0
    _, m = off_policy_correction(old, mu, mask, cfg)
    rho = torch.exp(old - mu)[mask > 0]
    assert m["is_ratio_std"] == pytest.approx(float(rho.std()), rel=REL)
    _, m = off_policy_correction(old, old.clone(), mask, cfg)  # no mismatch: every ratio 1
    assert m["is_ratio_std"] == 0.0
