"""Advantage estimators under SkyRL's names (``trainer.algorithm.advantage_estimator``): GAE, GRPO
(group-normalised), RLOO, REINFORCE++, MaxRL; checked against SkyRL's own in ``tests/test_skyrl_oracle.py``."""

from __future__ import annotations

import torch

from mlora.rl.masked import masked_whiten

ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce++", "maxrl")
CRITIC_ESTIMATORS = ("gae",)  # the others need no value model


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                   lam: float = 0.95, whiten: bool = True, skip_masked: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation. Shapes ``[batch, len]``; returns ``(advantages, returns)``::

        δ_t = r_t + γ·V_{t+1} - V_t
        A_t = δ_t + γ·λ·A_{t+1}
        returns_t = A_t + V_t

    SkyRL's (``compute_gae_advantage_return``, the default): the recursion runs over every position (``V``
    past the end is 0), ``mask`` only selects what whitening averages over (SkyRL's ``response_mask``: in a
    multi-turn row the observation tokens too), and the whitened advantages are not masked.

    ``skip_masked`` (mlora's multi-turn variant, opt-in): masked positions are skipped, neither receiving nor
    passing on advantage, so that an environment's tokens between two turns do not enter the model's
    advantages; returns and advantages are 0 there.
    """
    if not skip_masked:
        next_value = torch.zeros_like(values[:, 0])
        last = torch.zeros_like(values[:, 0])
        adv = torch.zeros_like(values)
        for t in reversed(range(values.shape[1])):
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            last = delta + gamma * lam * last
            adv[:, t] = last
            next_value = values[:, t]
        returns = adv + values
        return (masked_whiten(adv, mask.to(values.dtype)) if whiten else adv), returns
    mask = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    adv = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = a * m
        next_value = values[:, t] * m + next_value * (1 - m)
        next_adv = a * m + next_adv * (1 - m)
    returns = adv + values * mask
    if whiten:
        adv = masked_whiten(adv, mask) * mask
    return adv, returns


def _group_view(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    if scores.dim() != 1 or scores.numel() % group_size:
        raise ValueError(f"scores of shape {tuple(scores.shape)} cannot be split into groups of {group_size} "
                         "(n_samples_per_prompt); expected a 1-D tensor with a multiple of that many entries")
    return scores.view(-1, group_size)


def grpo_advantages(scores: torch.Tensor, group_size: int, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantages, one per response: ``A_i = (R_i - mean_g(R)) / (std_g(R) + ε)``.

    ``scores`` ``[n_prompts · group_size]``, responses of a prompt adjacent. ``std`` is the
    unbiased standard deviation within the group; with ``norm_by_std=False`` only the mean is
    removed (Dr. GRPO). A group of one has mean 0 and std 1 (SkyRL's), so its advantage is its reward
    (divided by ``1 + ε``).
    """
    g = _group_view(scores, group_size)
    if group_size == 1:
        return (g / (1.0 + eps) if norm_by_std else g).reshape(-1)
    centred = g - g.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (g.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out: ``A_i = R_i - mean_{j≠i} R_j = (R_i - mean_g(R)) · n / (n - 1)``; a group of one
    has no other sample to compare with and gets 0 (SkyRL's)."""
    g = _group_view(scores, group_size)
    if group_size == 1:
        return torch.zeros_like(g).reshape(-1)
    return ((g - g.mean(dim=1, keepdim=True)) * group_size / (group_size - 1)).reshape(-1)


def maxrl_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """MaxRL: the group-centred reward relative to the group's mean, ``A_i = (R_i - mean_g(R)) / (mean_g(R) + ε)``
    (SkyRL's ``compute_maxrl_advantage``); a group of one has mean 0, so ``A = R``."""
    g = _group_view(scores, group_size)
    if group_size == 1:
        return g.reshape(-1).clone()
    mean = g.mean(dim=1, keepdim=True)
    return ((g - mean) / (mean + eps)).reshape(-1)


def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, 2025): discounted returns ``G_t = r_t + γ·G_{t+1}``, the running return reset after each
    masked position, whitened over the whole batch's masked tokens (no critic, no group baseline).
    ``[batch, len]``; returns ``(advantages · mask, returns)``."""
    mask = mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return masked_whiten(returns, mask) * mask, returns


def broadcast_to_tokens(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[batch]`` -> ``[batch, response_len]`` on response tokens (outcome advantages)."""
    return per_sequence[:, None].to(mask.dtype if mask.is_floating_point() else torch.float32) * mask
