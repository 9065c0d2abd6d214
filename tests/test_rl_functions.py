"""Every rl/ function against values computed by hand on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from mlora.rl import (
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    entropy_from_logits,
    gae_advantages,
    grpo_advantages,
    kl_penalty,
    policy_loss,
    rloo_advantages,
    value_loss,
)
from mlora.rl.kl import apply_kl_in_reward
from mlora.rl.vocab_parallel import (
    vocab_parallel_logprobs,
    vocab_parallel_sampling_logprobs,
    vocab_parallel_truncation_logmass,
)

pytestmark = pytest.mark.quick

T = torch.tensor


def test_gae_by_hand():
    # one sequence, 3 response tokens, γ=0.9, λ=0.5
    r, v, m = T([[0.0, 0.0, 1.0]]), T([[0.5, 0.4, 0.3]]), T([[1.0, 1.0, 1.0]])
    adv, ret = gae_advantages(r, v, m, gamma=0.9, lam=0.5, whiten=False)
    d2 = 1.0 - 0.3
    d1 = 0.0 + 0.9 * 0.3 - 0.4
    d0 = 0.0 + 0.9 * 0.4 - 0.5
    a2, a1 = d2, d1 + 0.45 * d2
    a0 = d0 + 0.45 * a1
    torch.testing.assert_close(adv, T([[a0, a1, a2]]))
    torch.testing.assert_close(ret, T([[a0 + 0.5, a1 + 0.4, a2 + 0.3]]))


def test_gae_skips_masked_tokens_and_whitens():
    r, v = T([[1.0, 0.0, 2.0, 0.0]]), T([[0.1, 0.2, 0.3, 9.0]])
    m = T([[1.0, 1.0, 1.0, 0.0]])  # the last position is padding: its value must not leak
    adv, _ = gae_advantages(r, v, m, gamma=1.0, lam=1.0, whiten=False, skip_masked=True)
    # γ=λ=1: A_t = Σ_{k≥t} r_k - V_t
    torch.testing.assert_close(adv, T([[3.0 - 0.1, 2.0 - 0.2, 2.0 - 0.3, 0.0]]))
    # SkyRL's GAE (the default) runs through every position: a value there enters the step before it
    skyrl, _ = gae_advantages(r, v, m, gamma=1.0, lam=0.5, whiten=False)
    # t3: δ = -9; t2: δ = 2 + 9 - 0.3 = 10.7, A = 10.7 - 4.5; t1: δ = 0.1, A = 0.1 + 3.1; t0: δ = 1.1, A = 1.1 + 1.6
    torch.testing.assert_close(skyrl, T([[2.7, 3.2, 6.2, -9.0]]))
    w, _ = gae_advantages(r, v, m, gamma=1.0, lam=1.0, whiten=True, skip_masked=True)
    vals = w[0, :3]
    assert abs(vals.mean().item()) < 1e-6 and abs(vals.std().item() - 1) < 1e-5 and w[0, 3] == 0


def test_grpo_and_rloo_by_hand():
    s = T([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # two prompts, three samples each
    std0 = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    torch.testing.assert_close(grpo_advantages(s, 3), T([2 / 3 / std0, -1 / 3 / std0, -1 / 3 / std0, 0, 0, 0]),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grpo_advantages(s, 3, norm_by_std=False), T([2 / 3, -1 / 3, -1 / 3, 0, 0, 0]))
    # RLOO: R_i - mean of the others
    torch.testing.assert_close(rloo_advantages(s, 3), T([1.0, -0.5, -0.5, 0, 0, 0]))
    with pytest.raises(ValueError, match="cannot be split into groups of 4"):
        grpo_advantages(s, 4)
    # groups of one, as SkyRL: GRPO's mean 0 and std 1 (the advantage is the reward), RLOO's 0
    torch.testing.assert_close(grpo_advantages(s, 1), s / (1 + 1e-6))
    torch.testing.assert_close(rloo_advantages(s, 1), torch.zeros(6))


def test_kl_estimators_by_hand():
    lp, ref = T([0.0, -1.0]), T([-0.5, -0.5])
    d = T([0.5, -0.5])
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), d)
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), 0.5 * d * d)
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.exp(-d) - 1 + d)
    torch.testing.assert_close(kl_penalty(lp, ref, "abs"), d.abs())
    with pytest.raises(ValueError, match="unknown KL estimator 'k9'; valid: k1, k2, k3, abs"):
        kl_penalty(lp, ref, "k9")


def test_kl_controllers_and_reward_penalty():
    fixed = FixedKLController(0.1)
    fixed.update(5.0, 10)
    assert fixed.value == 0.1
    ada = AdaptiveKLController(0.1, target_kl=1.0, horizon=100)
    ada.update(3.0, 10)  # error clipped to +0.2
    assert ada.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    ada.update(0.9, 10)
    assert ada.value == pytest.approx(0.1 * 1.02 * (1 - 0.1 * 0.1))
    torch.testing.assert_close(apply_kl_in_reward(T([[0.0, 1.0]]), T([[0.5, 0.5]]), T([[1.0, 1.0]]), 0.2),
                               T([[-0.1, 0.9]]))


def test_agg_modes_by_hand():
    loss = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(loss, mask, "token-mean", normalizer=8).item() == pytest.approx(10 / 8)
    # SkyRL's token_mean_legacy: each micro-batch's token mean / micro-batches; rows 0 and 1 as two micro-batches
    legacy = sum(agg_loss(loss[i:i + 1], mask[i:i + 1], "token-mean-legacy", normalizer=2) for i in range(2))
    assert legacy.item() == pytest.approx((6 / 3 + 4 / 1) / 2)
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'sum'; valid: token-mean"):
        agg_loss(loss, mask, "sum")


def test_seq_mean_token_sum_norm_by_hand():
    # Dr. GRPO: per-sequence token sums over the constant max_seq_len, mean over sequences
    loss = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", max_seq_len=8).item() == pytest.approx((6 / 8 + 4 / 8) / 2)
    # a micro-batch of the first row, normalised by the mini-batch's 2 sequences
    assert agg_loss(loss[:1], mask[:1], "seq-mean-token-sum-norm", normalizer=2, max_seq_len=8).item() == \
        pytest.approx(6 / 8 / 2)
    pg, _ = policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), -loss, mask, agg_mode="seq-mean-token-sum-norm",
                        max_seq_len=8)  # ratio 1: per-token loss = -A = loss
    assert pg.item() == pytest.approx((6 / 8 + 4 / 8) / 2)
    with pytest.raises(ValueError, match="'seq-mean-token-sum-norm' needs max_seq_len >= 1, got None"):
        agg_loss(loss, mask, "seq-mean-token-sum-norm")


def test_policy_loss_clip_and_dual_clip_by_hand():
    old = T([[0.0, 0.0, 0.0]])
    lp = T([[math.log(1.5), math.log(0.5), math.log(4.0)]])
    adv = T([[1.0, 1.0, -1.0]])
    m = torch.ones(1, 3)
    loss, metrics = policy_loss(lp, old, adv, m, clip_low=0.2, clip_high=0.28)
    # token 0: max(-1.5, -1.28) = -1.28; token 1: max(-0.5, -0.8) = -0.5; token 2: max(4, 1.28) = 4
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 4.0) / 3, rel=1e-5)
    assert metrics["clipfrac"].item() == pytest.approx(1 / 3)
    dual, _ = policy_loss(lp, old, adv, m, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert dual.item() == pytest.approx((-1.28 - 0.5 + 3.0) / 3, rel=1e-5)  # token 2 capped at -A·c = 3
    with pytest.raises(ValueError, match="dual_clip=0.5 must be > 1"):
        policy_loss(lp, old, adv, m, dual_clip=0.5)


def test_value_loss_by_hand():
    v, old, ret = T([[1.0, 0.0]]), T([[0.0, 0.0]]), T([[0.5, 1.0]])
    loss, _ = value_loss(v, old, ret, torch.ones(1, 2), clip_range=0.2)
    # token 0: max((1-.5)², (0.2-.5)²) = .25; token 1: max(1, 1) = 1
    assert loss.item() == pytest.approx(0.5 * (0.25 + 1.0) / 2)


def test_entropy_and_vocab_parallel_single_shard():
    z = torch.tensor([[0.0, math.log(3.0)]])  # p = (1/4, 3/4)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_from_logits(z).item() == pytest.approx(h, rel=1e-6)
    logits = torch.randn(2, 4, 13, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 11, (2, 4))
    lp, ent = vocab_parallel_logprobs(logits, target, 0, 11, group=None, with_entropy=True)
    ref = torch.log_softmax(logits[..., :11], -1)
    torch.testing.assert_close(lp, ref.gather(-1, target[..., None])[..., 0])
    torch.testing.assert_close(ent, entropy_from_logits(logits[..., :11]))
    w = torch.randn(2, 4, dtype=torch.float64)
    g = torch.autograd.grad((lp * w).sum() + ent.sum(), logits)[0]
    g_ref = torch.autograd.grad((ref.gather(-1, target[..., None])[..., 0] * w).sum()
                                + entropy_from_logits(logits[..., :11]).sum(), logits)[0]
    torch.testing.assert_close(g, g_ref)


def test_tempered_logprobs_entropy_and_grads():
    # log p = log_softmax(z / T), H of softmax(z / T), gradients through the division (float64, 1e-12)
    logits = torch.randn(2, 4, 13, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 11, (2, 4))
    lp, ent = vocab_parallel_logprobs(logits, target, 0, 11, group=None, with_entropy=True, temperature=0.7)
    ref_lp = torch.log_softmax(logits[..., :11] / 0.7, -1).gather(-1, target[..., None])[..., 0]
    ref_ent = entropy_from_logits(logits[..., :11] / 0.7)
    torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=0)
    w = torch.randn(2, 4, dtype=torch.float64)
    g = torch.autograd.grad((lp * w).sum() + ent.sum(), logits)[0]
    g_ref = torch.autograd.grad((ref_lp * w).sum() + ref_ent.sum(), logits)[0]
    torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="temperature=0 must be > 0"):
        vocab_parallel_logprobs(logits, target, 0, 11, temperature=0)


def test_sampling_logprobs_by_hand():
    # p = (0.5, 0.3, 0.15, 0.05); one padding column (never kept, no mass); tolerance 1e-6 (float32)
    z = torch.log(T([[0.5, 0.3, 0.15, 0.05]]))
    z = torch.cat([z, T([[50.0]])], -1)
    y = torch.tensor([0])

    def sampled(**kw):
        return vocab_parallel_sampling_logprobs(z, y, 0, 4, **kw).item()

    assert sampled() == pytest.approx(math.log(0.5), abs=1e-6)
    # top-p 0.7: mass above 0.3 is 0.5 < 0.7 (kept), above 0.15 is 0.8 (cut): M = 0.8
    assert sampled(top_p=0.7) == pytest.approx(math.log(0.5 / 0.8), abs=1e-6)
    # top-p 0.4: only the most likely token (the one always kept)
    assert sampled(top_p=0.4) == pytest.approx(0.0, abs=1e-6)
    # top-k 3, then top-p 0.9 of (0.5, 0.3, 0.15) / 0.95: mass above the third is 0.842 < 0.9: M = 0.95
    assert sampled(top_k=3, top_p=0.9) == pytest.approx(math.log(0.5 / 0.95), abs=1e-6)
    # min-p 0.2: keep p >= 0.1
    assert sampled(min_p=0.2) == pytest.approx(math.log(0.5 / 0.95), abs=1e-6)
    # T = 0.5: p ∝ p², (0.25, 0.09, 0.0225, 0.0025) / 0.365; top-p 0.9: mass above 0.09 is 0.685 (kept),
    # above 0.0225 is 0.932 (cut): M = 0.34 / 0.365
    assert sampled(temperature=0.5) == pytest.approx(math.log(0.25 / 0.365), abs=1e-6)
    assert sampled(temperature=0.5, top_p=0.9) == pytest.approx(math.log(0.25 / 0.34), abs=1e-6)
    lm = vocab_parallel_truncation_logmass(z, 4, temperature=0.5, top_p=0.9)
    assert lm.item() == pytest.approx(math.log(0.34 / 0.365), abs=1e-6)
    # a token the filters drop keeps a finite value: log p_T(y) - log M
    assert vocab_parallel_sampling_logprobs(z, torch.tensor([3]), 0, 4, top_p=0.7).item() == \
        pytest.approx(math.log(0.05 / 0.8), abs=1e-6)
    with pytest.raises(ValueError, match="top_p=0 must be in"):
        vocab_parallel_truncation_logmass(z, 4, top_p=0)
