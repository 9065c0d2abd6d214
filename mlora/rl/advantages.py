"""Advantage estimators: GAE, GRPO (group-normalised), RLOO."""

from __future__ import annotations

import torch

from mlora.rl.masked import masked_whiten

ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo")


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                   lam: float = 0.95, whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens.

    For each sequence, over its response tokens ``t`` (``mask`` = 1; values past the last token
    count as 0)::

        δ_t = r_t + γ·V_{t+1} - V_t
        A_t = δ_t + γ·λ·A_{t+1}
        returns_t = A_t + V_t

    Masked positions are skipped (they neither receive nor pass on advantage). Advantages are
    whitened over the masked entries when ``whiten``. Shapes ``[batch, response_len]``.
    Returns ``(advantages, returns)``.
    """
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
    removed (Dr. GRPO). A group of one gets advantage 0.
    """
    g = _group_view(scores, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    if norm_by_std and group_size > 1:
        centred = centred / (g.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out: ``A_i = R_i - mean_{j≠i} R_j = (R_i - mean_g(R)) · n / (n - 1)``."""
    if group_size < 2:
        raise ValueError(f"RLOO needs at least 2 samples per prompt, got n_samples_per_prompt={group_size}")
    g = _group_view(scores, group_size)
    return ((g - g.mean(dim=1, keepdim=True)) * group_size / (group_size - 1)).reshape(-1)


def broadcast_to_tokens(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[batch]`` -> ``[batch, response_len]`` on response tokens (outcome advantages)."""
    return per_sequence[:, None].to(mask.dtype if mask.is_floating_point() else torch.float32) * mask
