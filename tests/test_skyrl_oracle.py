"""mlora's RL functions against SkyRL's own (the ``skyrl`` 0.3.0 wheel, imported unchanged: tests/skyrl_oracle.py).

Random tensors with masks that include empty rows, groups of one and zero-variance groups. Every registered
policy loss (value and gradient), every advantage estimator, every KL estimator, every loss reduction, the KL
and entropy loss terms and the zero-variance filter; tolerance 1e-6 relative (float64 inputs where SkyRL keeps
the dtype, float32 where it casts: ``safe_exp_delta`` computes in float32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from skyrl_oracle import algorithm_config, owner_function, ppo_utils

from mlora.rl.advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_to_tokens,
    gae_advantages,
    grpo_advantages,
    maxrl_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from mlora.rl.kl import KL_ESTIMATORS, kl_penalty
from mlora.rl.losses import LOSS_AGG_MODES, micro_batch_token_mean_term, reduction_scale, sequence_mean_term
from mlora.rl.policy_losses import POLICY_LOSSES, PolicyLossParams, token_policy_loss
from mlora.rl.sampling_filters import zero_variance_keep

pytestmark = pytest.mark.quick

REL = 1e-6
B, T = 8, 7
# mlora's loss_agg_mode -> SkyRL's loss_reduction (seq-mean-token-sum is verl's, SkyRL has no such mode)
SKYRL_REDUCTIONS = {"token-mean": "token_mean", "token-mean-legacy": "token_mean_legacy",
                    "seq-mean-token-mean": "sequence_mean", "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
                    "prompt-mean": "prompt_mean"}


def close(a: torch.Tensor, b: torch.Tensor, rel: float = REL, scale: float | None = None) -> None:
    """max |a - b| <= rel · scale; ``scale``: max |b| (for a sum: the sum of its terms' magnitudes)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    scale = b.abs().max().clamp(min=1e-12) if scale is None else max(scale, 1e-12)
    err = float((a - b).abs().max() / scale) if a.numel() else 0.0
    assert err <= rel, f"max |mlora - SkyRL| / max |SkyRL| = {err:.3g} > {rel}"


def batch(seed: int, dtype=torch.float64):
    """log π, log π_old, log μ, advantages and a mask with an empty row (row 3) and ragged lengths."""
    g = torch.Generator().manual_seed(seed)
    logprob = (-torch.rand(B, T, generator=g, dtype=dtype) * 3).requires_grad_(True)
    old = logprob.detach() + torch.randn(B, T, generator=g, dtype=dtype) * 0.4
    rollout = old + torch.randn(B, T, generator=g, dtype=dtype) * 0.1
    adv = torch.randn(B, T, generator=g, dtype=dtype)
    lengths = torch.tensor([7, 5, 2, 0, 6, 1, 4, 7])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(dtype)
    return logprob, old.clamp(max=0), rollout.clamp(max=0), adv, mask


def mlora_params(cfg) -> PolicyLossParams:
    return PolicyLossParams(
        eps_clip_low=cfg.eps_clip_low, eps_clip_high=cfg.eps_clip_high, clip_ratio_c=cfg.clip_ratio_c,
        tau_pos=cfg.sapo.tau_pos, tau_neg=cfg.sapo.tau_neg, cispo_eps_clip_low=cfg.cispo.cispo_eps_clip_low,
        cispo_eps_clip_high=cfg.cispo.cispo_eps_clip_high, dppo_type=cfg.dppo.dppo_type,
        delta_low=cfg.dppo.delta_low, delta_high=cfg.dppo.delta_high, clip_cov_ratio=cfg.clip_cov.clip_ratio,
        clip_cov_lb=cfg.clip_cov.clip_cov_lb, clip_cov_ub=cfg.clip_cov.clip_cov_ub,
        kl_cov_frac=cfg.kl_cov.kl_cov_frac, ppo_kl_coef=cfg.kl_cov.ppo_kl_coef)


# settings under which each loss's branches are all exercised by batch()
LOSS_SETTINGS = {
    "regular": {"eps_clip_high": 0.28},
    "dual_clip": {"clip_ratio_c": 1.5},
    "gspo": {"eps_clip_low": 3e-4, "eps_clip_high": 4e-4},
    "sapo": {"sapo.tau_pos": 1.3},
    "cispo": {"cispo.cispo_eps_clip_low": 0.2, "cispo.cispo_eps_clip_high": 0.3},
    "rollout_is": {},
    "dppo": {"dppo.delta_low": 0.02, "dppo.delta_high": 0.03},
    "dppo_kl": {"dppo.dppo_type": "binary_kl", "dppo.delta_low": 0.001, "dppo.delta_high": 0.002},
    "clip_cov": {"clip_cov.clip_ratio": 0.3, "clip_cov.clip_cov_lb": -0.5, "clip_cov.clip_cov_ub": 0.5},
    "kl_cov": {"kl_cov.kl_cov_frac": 0.3},
    "cross_entropy": {},
    "importance_sampling": {},
}


def test_every_registered_policy_loss_is_covered():
    skyrl = set(ppo_utils().PolicyLossRegistry.list_available())
    assert skyrl == set(POLICY_LOSSES), f"SkyRL's registry {sorted(skyrl)} != mlora's {sorted(POLICY_LOSSES)}"
    assert {k.split("_kl")[0] if k == "dppo_kl" else k for k in LOSS_SETTINGS} == skyrl


@pytest.mark.parametrize("case", sorted(LOSS_SETTINGS))
@pytest.mark.parametrize("reduction", sorted(SKYRL_REDUCTIONS))
def test_policy_loss_matches_skyrl(case, reduction):
    pu = ppo_utils()
    name = "dppo" if case == "dppo_kl" else case
    cfg = algorithm_config(policy_loss_type=name, loss_reduction=SKYRL_REDUCTIONS[reduction], max_seq_len=11,
                           **LOSS_SETTINGS[case])
    for seed in range(3):
        logprob, old, rollout, adv, mask = batch(seed)
        # SkyRL scales the advantages for the reduction (per mini-batch), then sums each loss over the mask
        kw = dict(micro_batch_size=2, max_seq_len=11, prompt_boundaries=[(i, i + 2) for i in range(0, B, 2)])
        skyrl_adv = pu.apply_loss_reduction_to_advantages_minibatch(adv, mask, cfg.loss_reduction, **kw)
        mine_adv = adv * reduction_scale(mask, reduction, micro_batch_size=2, max_seq_len=11, group_size=2)
        close(mine_adv, skyrl_adv)
        mine_adv = skyrl_adv  # the losses compared on the same inputs

        torch.manual_seed(seed)  # clip_cov draws its tokens from torch's generator
        ref_loss, _ = pu.PolicyLossRegistry.get(name)(logprob, old, skyrl_adv, cfg, mask, rollout)
        (ref_grad,) = torch.autograd.grad(ref_loss, logprob)
        torch.manual_seed(seed)
        tokens, metrics = token_policy_loss(name, logprob, old, mine_adv, mask, mlora_params(cfg), rollout)
        loss = (tokens * mask).sum()
        (grad,) = torch.autograd.grad(loss, logprob)
        # a sum of terms of both signs: relative to the terms' magnitudes (SkyRL's ratios are float32 even for
        # float64 inputs, mlora's float64: their rounding differs by ~1e-8 per term)
        close(loss.detach(), ref_loss.detach(), scale=float((tokens * mask).abs().sum()))
        close(grad, ref_grad)
        assert torch.isfinite(metrics["clipfrac"])


def test_cispo_anchored_on_the_rollout():
    """SkyRL HEAD's ``cispo_anchor=rollout`` (not in the 0.3.0 wheel): CISPO's ratio to the engine's log-probs, i.e.
    0.3.0's CISPO with the rollout log-probs in π_old's place; HEAD's defaults (1.0, 4.0) in effect."""
    pu = ppo_utils()
    cfg = algorithm_config(policy_loss_type="cispo", **{"cispo.cispo_eps_clip_low": 1.0,
                                                        "cispo.cispo_eps_clip_high": 4.0})
    logprob, old, rollout, adv, mask = batch(5)
    ref, _ = pu.PolicyLossRegistry.get("cispo")(logprob, rollout, adv, cfg, mask, None)
    params = PolicyLossParams(cispo_anchor="rollout")
    assert (params.cispo_eps_clip_low, params.cispo_eps_clip_high) == (1.0, 4.0)
    tokens, _ = token_policy_loss("cispo", logprob, old, adv, mask, params, rollout)
    close((tokens * mask).sum().detach(), ref.detach(), scale=float((tokens * mask).abs().sum()))
    with pytest.raises(ValueError, match="cispo_anchor='rollout' needs the engine's log-probs"):
        token_policy_loss("cispo", logprob, old, adv, mask, params)


def test_policy_losses_with_off_policy_correction_match_skyrl():
    """TIS and a sequence mask on the losses SkyRL corrects: SkyRL multiplies the per-token loss by its TIS
    ratio and drops masked sequences (apply_off_policy_correction); mlora's weights do both."""
    from mlora.rl.rollout_correction import OffPolicyCorrection, off_policy_correction

    pu = ppo_utils()
    settings = {"off_policy_correction.tis_ratio_type": "token", "off_policy_correction.sequence_mask_metric":
                "geometric", "off_policy_correction.geo_mask_low": 0.9, "off_policy_correction.geo_mask_high": 1.1}
    logprob, old, rollout, adv, mask = batch(7)
    for name, corrected in POLICY_LOSSES.items():
        if not corrected[1]:
            continue
        cfg = algorithm_config(policy_loss_type=name, **settings)
        scaled = adv * reduction_scale(mask, "token-mean")
        ref_loss, _ = pu.PolicyLossRegistry.get(name)(logprob, old, scaled, cfg, mask, rollout)
        weights, _ = off_policy_correction(old, rollout, mask, OffPolicyCorrection(
            tis_ratio_type="token", sequence_mask_metric="geometric", geo_mask_low=0.9, geo_mask_high=1.1))
        tokens, _ = token_policy_loss(name, logprob, old, scaled, mask, mlora_params(cfg), rollout)
        close((tokens * mask * weights).sum().detach(), ref_loss.detach())


def test_every_reduction_and_the_loss_terms():
    pu = ppo_utils()
    torch_utils = __import__("skyrl.backends.skyrl_train.utils.torch_utils", fromlist=["masked_mean"])
    assert set(SKYRL_REDUCTIONS) == set(LOSS_AGG_MODES) - {"seq-mean-token-sum"}
    logprob, old, rollout, adv, mask = batch(3, torch.float64)
    ref = logprob.detach() - 0.3
    for estimator in KL_ESTIMATORS:
        skyrl = pu.compute_approx_kl(logprob.detach(), ref, loss_mask=mask, kl_estimator_type=estimator)
        close(kl_penalty(logprob.detach(), ref, estimator) * mask, skyrl)
    # k3 far apart: SkyRL clamps the log-ratio at ±20; the gradient stays finite
    far = torch.full((1, 3), -200.0, dtype=torch.float64, requires_grad=True)
    k3 = kl_penalty(far, torch.zeros(1, 3, dtype=torch.float64), "k3")
    close(k3.detach(), pu.compute_approx_kl(far.detach(), torch.zeros(1, 3, dtype=torch.float64)))
    k3.sum().backward()
    assert torch.isfinite(far.grad).all()
    # the KL term: SkyRL's masked_mean(kl, loss_mask, dim=-1).mean() per micro-batch, weighted by its share of
    # the mini-batch; the entropy term: masked_mean(entropy, loss_mask) weighted the same way
    kl = kl_penalty(logprob.detach(), ref, "k3")
    entropy = torch.rand(B, T, dtype=torch.float64)
    mine_kl = mine_ent = ref_kl = ref_ent = 0.0
    for start in range(0, B, 2):  # micro-batches of 2 rows
        s = slice(start, start + 2)
        weight = 2 / B
        ref_kl += torch_utils.masked_mean(kl[s], mask[s], dim=-1).mean() * weight
        ref_ent += torch_utils.masked_mean(entropy[s], mask[s]) * weight
        mine_kl += sequence_mean_term(kl[s], mask[s], B)
        mine_ent += micro_batch_token_mean_term(entropy[s], mask[s], B)
    close(mine_kl, ref_kl)
    close(mine_ent, ref_ent)


def group_scores(seed: int, n: int) -> torch.Tensor:
    """``[4·n]`` scores with a zero-variance group (the second) and, for n > 1, distinct values elsewhere."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 3, (4 * n,), generator=g).double() + torch.rand(4 * n, generator=g, dtype=torch.float64)
    s[n:2 * n] = 0.5
    return s


@pytest.mark.parametrize("n", [1, 2, 4])
def test_outcome_estimators_match_skyrl(n):
    pu = ppo_utils()
    assert set(pu.AdvantageEstimatorRegistry.list_available()) == set(ADVANTAGE_ESTIMATORS)
    scores = group_scores(n, n)
    rows = scores.numel()
    mask = (torch.arange(T)[None, :] < torch.randint(1, T + 1, (rows,))[:, None]).double()
    last = mask.shape[1] - 1 - torch.flip(mask, dims=[1]).argmax(dim=1)
    token_rewards = torch.zeros(rows, T, dtype=torch.float64)
    token_rewards[torch.arange(rows), last] = scores
    index = np.array([i // n for i in range(rows)])
    cfg = algorithm_config()
    mine = {
        "grpo": grpo_advantages(scores, n),
        "grpo_no_std": grpo_advantages(scores, n, norm_by_std=False),
        "rloo": rloo_advantages(scores, n),
        "maxrl": maxrl_advantages(scores, n),
    }
    for name, per_seq in mine.items():
        est = name.split("_")[0]
        ref, _ = pu.compute_advantages_and_returns(token_rewards.clone(), mask, index, est, cfg,
                                                   grpo_norm_by_std=name != "grpo_no_std")
        close(broadcast_to_tokens(per_seq, mask), ref)
    adv, ret = reinforce_pp_advantages(token_rewards, mask, gamma=0.9)
    ref_adv, ref_ret = pu.compute_advantages_and_returns(token_rewards.clone(), mask, index, "reinforce++", cfg,
                                                         gamma=0.9)
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_gae_matches_skyrl():
    pu = ppo_utils()
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).double()  # holes: multi-turn observation tokens
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.97, lam=0.9)
    ref_adv, ref_ret = pu.compute_advantages_and_returns(rewards, mask, np.arange(B), "gae", algorithm_config(),
                                                         values=values, gamma=0.97, lambd=0.9)
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_zero_variance_filter_matches_skyrl():
    from collections import defaultdict

    skyrl = owner_function("train/utils/trainer_utils.py", "zero_variance_filter",
                           {"defaultdict": defaultdict, "List": list, "Optional": type(None)})
    rewards = [1.0, 1.0, 0.0, 1.0, 0.5, 0.5 + 1e-7, 2.0, 3.0, 7.0]
    uids = ["a", "a", "b", "b", "c", "c", "d", "e", "e"]
    masks = [[1], [1], [1], [1], [1], [1], [1], [0], [1]]  # e: one live row, kept
    for tol in (0.0, 1e-6):
        keep = zero_variance_keep(torch.tensor(rewards), uids, torch.tensor([sum(m) > 0 for m in masks]), tol)
        assert torch.nonzero(keep).flatten().tolist() == skyrl(rewards, uids, loss_masks=masks, tol=tol)


def test_dapo_penalty_reaches_the_advantages_of_token_rewards():
    """A skyrl_gym text environment's rewards arrive per token (batch.token_rewards): DAPO's soft overlong
    penalty must land there, where the advantages read the reward (SkyRL: ``reward[-1] -= penalty``). Rewards
    [1, 0.25, -0.5, -1] on responses of 2, 5, 6, 7 tokens (max 8, buffer 4, factor 1) become [1, 0, -1, -1.75];
    GRPO over the group: [1.20, 0.37, -0.47, -1.10]."""
    from mlora.config.schema import TrainConfig
    from mlora.train.batch import RolloutBatch
    from mlora.train.config import PPOConfig
    from mlora.train.engine import compute_advantages
    from mlora.train.rl_stage import dapo_shaping

    lengths, raw = [2, 5, 6, 7], torch.tensor([1.0, 0.25, -0.5, -1.0])
    s = 3 + 8
    ids = torch.ones(4, s, dtype=torch.long)
    attn, resp = torch.zeros(4, s, dtype=torch.long), torch.zeros(4, s, dtype=torch.long)
    token_rewards = torch.zeros(4, s - 1)
    for i, n in enumerate(lengths):
        attn[i, :3 + n] = 1
        resp[i, 3:3 + n] = 1
        token_rewards[i, 3 + n - 2] = raw[i]  # on the last response token's action position
    batch = RolloutBatch(ids, attn, resp, raw.clone(), token_rewards=token_rewards)
    cfg = TrainConfig()
    cfg.generator.sampling_params.max_generate_length = 8
    cfg.trainer.algorithm.overlong_buffer_len = 4
    dapo_shaping(cfg, batch, ["stop"] * 4)
    expected_rewards = torch.tensor([1.0, 0.0, -1.0, -1.75])
    close(batch.rewards, expected_rewards)
    close(batch.token_rewards.sum(-1), expected_rewards)
    zeros = torch.zeros(4, s - 1)
    out = compute_advantages(PPOConfig(advantage_estimator="grpo", n_samples_per_prompt=4), batch, zeros, zeros, None)
    per_row = out["advantages"].sum(-1) / batch.response_positions.sum(-1)
    assert per_row.tolist() == pytest.approx([1.20, 0.37, -0.47, -1.10], abs=0.005)
    skyrl = ppo_utils().compute_grpo_outcome_advantage(out["token_rewards"], batch.response_positions,
                                                       np.zeros(4, dtype=int))[0]
    close(out["advantages"], skyrl)
