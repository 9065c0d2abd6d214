"""Rollout correction (mlora.rl.rollout_correction) against hand-computed values: token and sequence TIS,
product and geometric sequence masks, outlier-token and per-token masks, SkyRL's rollout_is loss; the
corrected PPO loss; and in the engine: correction off is bit-identical to no correction at all, correction
on with no mismatch leaves the update unchanged (1e-6). The TP-2 vocab-parallel case is in
test_vocab_parallel.py."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch

from mlora.rl.losses import policy_loss
from mlora.rl.rollout_correction import (
    OffPolicyCorrection,
    off_policy_correction,
    outlier_token_mask,
    rollout_is_loss,
    sequence_mask,
    sequence_tis_weights,
    token_mask,
    token_tis_weights,
)

pytestmark = pytest.mark.quick

# two sequences; ρ = π_old / μ per token. Row 1's last position is padding with a wild ratio (ignored).
RHO = torch.tensor([[1.5, 3.0, 0.5], [1.0, 0.9, 100.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
OLD = torch.log(RHO)  # μ = 1 on every token: log μ = 0
MU = torch.zeros_like(OLD)


def test_token_tis():
    w, m = token_tis_weights(OLD - MU, MASK, 2.0)
    torch.testing.assert_close(w[MASK > 0], torch.tensor([1.5, 2.0, 0.5, 1.0, 0.9], dtype=torch.float64))
    assert m == {"tis_token_clip_high_ratio": pytest.approx(1 / 5)}  # 3.0 capped; the padding's 100 not counted


def test_sequence_tis():
    w, m = sequence_tis_weights(OLD - MU, MASK, 2.0)  # products 2.25 and 0.9 (padding left out)
    torch.testing.assert_close(w, torch.tensor([[2.0], [0.9]], dtype=torch.float64))
    assert m == {"tis_seq_clip_high_ratio": pytest.approx(0.5)}


def test_sequence_masks():
    keep, m = sequence_mask(OLD - MU, MASK, "product", 0.5, 2.0)  # 2.25 over, 0.9 in
    assert keep.flatten().tolist() == [0.0, 1.0]
    assert m == {"product_sequence_mask_masked_ratio": 0.5, "product_sequence_mask_over_high_ratio": 0.5,
                 "product_sequence_mask_under_low_ratio": 0.0}
    # geometric means 2.25^(1/3) = 1.31 and 0.9^(1/2) = 0.949
    keep, m = sequence_mask(OLD - MU, MASK, "geometric", 0.95, 1.2)
    assert keep.flatten().tolist() == [0.0, 0.0]
    assert m["geo_sequence_mask_over_high_ratio"] == 0.5 and m["geo_sequence_mask_under_low_ratio"] == 0.5
    keep, _ = sequence_mask(OLD - MU, MASK, "geometric", 0.94, 1.32)
    assert keep.flatten().tolist() == [1.0, 1.0]


def test_outlier_and_token_masks():
    keep, m = outlier_token_mask(OLD - MU, MASK, 0.6, 2.5)  # row 0 has 3.0 (> 2.5) and 0.5 (< 0.6)
    assert keep.flatten().tolist() == [0.0, 1.0]
    assert m == {"outlier_seq_masked_ratio": 0.5, "outlier_seq_over_high_ratio": 0.5,
                 "outlier_seq_under_low_ratio": 0.5}
    keep, _ = outlier_token_mask(OLD - MU, MASK, None, 3.5)  # one bound only; the padding's 100 is ignored
    assert keep.flatten().tolist() == [1.0, 1.0]
    keep, m = token_mask(OLD - MU, MASK, 0.8, 2.0)  # IcePop: 3.0 and 0.5 out
    assert keep.tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert m == {"token_mask_ratio": pytest.approx(2 / 5)}


def test_combined_factor_and_metrics():
    cfg = OffPolicyCorrection(tis_ratio_type="token", token_tis_ratio_clip_high=2.0,
                              token_mask_is_threshold_low=0.8, token_mask_is_threshold_high=2.0)
    f, m = off_policy_correction(OLD, MU, MASK, cfg)
    # token mask first (3.0 and 0.5 out), then TIS on what is left
    torch.testing.assert_close(f[MASK > 0], torch.tensor([1.5, 0.0, 0.0, 1.0, 0.9], dtype=torch.float64))
    assert m["is_ratio_mean"] == pytest.approx((1.5 + 3.0 + 0.5 + 1.0 + 0.9) / 5)
    assert (m["is_ratio_max"], m["is_ratio_min"]) == (pytest.approx(3.0), pytest.approx(0.5))
    k3 = [r - 1 - math.log(r) for r in (1.5, 3.0, 0.5, 1.0, 0.9)]  # KL(μ ‖ π_old), samples from μ
    assert m["rollout_kl_k3"] == pytest.approx(sum(k3) / 5)
    assert m["token_mask_ratio"] == pytest.approx(0.4) and m["tis_token_clip_high_ratio"] == 0.0
    # sequence TIS after an outlier mask: the masked row gets 0, the other its capped product
    cfg = OffPolicyCorrection(tis_ratio_type="sequence", sequence_tis_ratio_clip_high=5.0,
                              outlier_token_is_threshold_high=2.5, sequence_mask_metric="product",
                              product_mask_low=0.5, product_mask_high=2.0)
    f, m = off_policy_correction(OLD, MU, MASK, cfg)
    torch.testing.assert_close(f, torch.tensor([[0.0] * 3, [0.9] * 3], dtype=torch.float64))
    assert m["outlier_seq_masked_ratio"] == 0.5 and m["product_sequence_mask_masked_ratio"] == 0.0


def test_no_mismatch_is_the_identity():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    mask = (torch.rand(4, 6, generator=g) > 0.2).double()
    adv = torch.randn(4, 6, generator=g, dtype=torch.float64)
    cfg = OffPolicyCorrection(tis_ratio_type="token", sequence_mask_metric="geometric",
                              outlier_token_is_threshold_low=1e-4, outlier_token_is_threshold_high=100.0,
                              token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2.0)
    f, m = off_policy_correction(lp, lp.clone(), mask, cfg)
    assert torch.equal(f, torch.ones_like(f)) and m["rollout_kl_k3"] == 0.0 and m["is_ratio_mean"] == 1.0
    new = lp + 0.05 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    plain, _ = policy_loss(new, lp, adv, mask)
    weighted, _ = policy_loss(new, lp, adv, mask, token_weights=f)
    assert plain.item() == weighted.item()


def test_tis_scales_the_ppo_loss_per_token():
    adv = torch.tensor([[1.0, -1.0, 2.0], [0.5, 1.0, 0.0]], dtype=torch.float64)
    new = OLD + 0.1  # ratio e^0.1 to π_old on every token: inside the clip range for A > 0, clipped for A < 0
    w, _ = token_tis_weights(OLD - MU, MASK, 2.0)
    loss, _ = policy_loss(new, OLD, adv, MASK, token_weights=w)
    r = math.exp(0.1)
    per_token = [-1.0 * r * 1.5, 1.0 * r * 2.0, -2.0 * r * 0.5, -0.5 * r * 1.0, -1.0 * r * 0.9]
    assert loss.item() == pytest.approx(sum(per_token) / 5)


def test_rollout_is_loss_and_gradient():
    # r = π / μ per token: 1.1 inside (0.8, 1.2), 1.5 and 0.7 outside (zeroed); padding ignored
    logprob = torch.log(torch.tensor([[1.1, 1.5, 0.7]], dtype=torch.float64)).requires_grad_(True)
    mu = torch.zeros(1, 3, dtype=torch.float64)
    adv = torch.tensor([[2.0, 2.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    loss, m = rollout_is_loss(logprob, mu, adv, mask, 0.2, 0.2)
    assert loss.item() == pytest.approx(-(1.1 * 2.0 * math.log(1.1)) / 3)
    assert m["clipfrac"].item() == pytest.approx(2 / 3)
    loss.backward()  # -sg(f(r))·A / 3 on the token inside, 0 elsewhere
    torch.testing.assert_close(logprob.grad, torch.tensor([[-1.1 * 2.0 / 3, 0.0, 0.0]], dtype=torch.float64))


def test_bad_settings():
    with pytest.raises(ValueError, match="tis_ratio_type='tokens'; valid: null, token, sequence"):
        OffPolicyCorrection(tis_ratio_type="tokens")
    with pytest.raises(ValueError, match="sequence_mask_metric='geo'; valid: null, product, geometric"):
        OffPolicyCorrection(sequence_mask_metric="geo")
    with pytest.raises(ValueError, match="geo_mask_low=1.1 must be below geo_mask_high=1.01"):
        OffPolicyCorrection(geo_mask_low=1.1)
    with pytest.raises(ValueError, match="set both or neither"):
        OffPolicyCorrection(token_mask_is_threshold_low=0.5)
    with pytest.raises(ValueError, match="token_tis_ratio_clip_high=0 must be > 0"):
        OffPolicyCorrection(token_tis_ratio_clip_high=0)


# ---------------------------------------------------------------- in the engine (tiny model, one process)
sys.path.insert(0, str(Path(__file__).parent / "dist"))


def _trained(tiny_models, mesh, batch, **kw) -> tuple[dict, dict]:
    import mlora
    from mlora.train.config import PPOConfig
    from mlora.train.engine import ActorCriticEngine

    torch.manual_seed(0)
    model = mlora.from_pretrained(tiny_models / "llama", mesh)
    cfg = PPOConfig(advantage_estimator="grpo", n_samples_per_prompt=2, mini_batch_size=4, micro_train_batch_size=2,
                    micro_forward_batch_size=4, actor_lr=1e-2, lr_schedule="constant", **kw)
    engine = ActorCriticEngine(model, cfg, policy_lora=mlora.LoraConfig(rank=4, seed=3))
    metrics = engine.step(batch)
    return metrics, {k: v.detach().clone() for k, v in model.adapter_tensors("policy").items()}


def test_engine_off_is_bit_identical_and_no_mismatch_changes_nothing(tiny_models):
    from ppo_equivalence import synthetic_rollouts

    import mlora

    mesh = mlora.init_parallel(tp=1, pp=1)
    batch = synthetic_rollouts(vocab=256)
    no_rollout = dataclasses.replace(batch, rollout_logprobs=None)
    m0, w0 = _trained(tiny_models, mesh, no_rollout)
    m1, w1 = _trained(tiny_models, mesh, batch)  # the engine's log-probs present, correction off
    assert all(torch.equal(w0[k], w1[k]) for k in w0) and m0["actor/pg_loss"] == m1["actor/pg_loss"]
    assert m1["off_policy/rollout_kl_k3"] > 0.1  # the synthetic engine log-probs are far off: a real mismatch
    # the engine's log-probs equal to the trainer's (float32 trainer and engine, no gap): every correction on
    # changes neither the loss nor the update
    from mlora.train.config import PPOConfig
    from mlora.train.engine import ActorCriticEngine

    probe = ActorCriticEngine(mlora.from_pretrained(tiny_models / "llama", mesh),
                              PPOConfig(advantage_estimator="grpo", n_samples_per_prompt=2, mini_batch_size=4,
                                        micro_forward_batch_size=4), policy_lora=mlora.LoraConfig(rank=4, seed=3))
    own = probe._forward_pass(batch, ("policy",), values=False)
    matched = dataclasses.replace(batch, rollout_logprobs=own)
    every = OffPolicyCorrection(tis_ratio_type="token", sequence_mask_metric="geometric",
                                outlier_token_is_threshold_low=1e-4, outlier_token_is_threshold_high=100.0,
                                token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2.0)
    m2, w2 = _trained(tiny_models, mesh, matched, off_policy=every)
    assert m2["off_policy/is_ratio_max"] == m2["off_policy/is_ratio_min"] == 1.0
    assert m2["off_policy/geo_sequence_mask_masked_ratio"] == 0.0
    assert abs(m2["actor/pg_loss"] - m0["actor/pg_loss"]) < 1e-6
    assert all((w2[k] - w0[k]).abs().max() < 1e-6 for k in w0)
    # with the mismatch, token TIS changes the update
    m3, w3 = _trained(tiny_models, mesh, batch, off_policy=OffPolicyCorrection(tis_ratio_type="token",
                                                                                  token_tis_ratio_clip_high=0.1))
    assert m3["off_policy/tis_token_clip_high_ratio"] > 0 and any(not torch.equal(w3[k], w0[k]) for k in w0)
    # rollout_is trains too (its ratio is to μ; with μ = π_old its gradient is PPO's)
    m4, w4 = _trained(tiny_models, mesh, matched, policy_loss_type="rollout_is")
    assert m4["actor/clipfrac"] < 0.5 and m4["actor/grad_norm"] > 0
    assert all((w4[k] - w0[k]).abs().max() < 1e-6 for k in w0)
