"""Masked reductions shared by the RL functions (``mask`` is 1 on response tokens, 0 elsewhere), and the
clamped exponential of a log-ratio."""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0  # as SkyRL's safe_exp_delta: exp of at most ±20 (ratios in [2e-9, 5e8])


def safe_exp(log_ratio: torch.Tensor, clip: float = LOG_RATIO_CLAMP) -> torch.Tensor:
    """``exp(clamp(x, -clip, clip))``: a ratio from its log, finite however far the two policies are apart.

    SkyRL's ``safe_exp_delta`` (``skyrl_train/utils/torch_utils.py``), used for every importance ratio it
    takes. The clamp also stops the gradient past ``±clip``. Computed in at least float32 (SkyRL: float32),
    returned in the input's dtype; float64 stays float64.
    """
    wide = torch.promote_types(log_ratio.dtype, torch.float32)
    return log_ratio.to(wide).clamp(-clip, clip).exp().to(log_ratio.dtype)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """``Σ x·m / Σ m`` (0 where the mask is empty)."""
    return masked_sum(x, mask, dim) / mask.sum(dim).clamp(min=1) if dim is not None else \
        masked_sum(x, mask) / mask.sum().clamp(min=1)


def masked_std(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sqrt(Σ (x - x̄)²·m / (Σ m - 1))`` over the masked entries, ``x̄`` their mean (unbiased, as
    ``torch.std``; 0 with fewer than two entries)."""
    n = mask.sum()
    var = masked_sum((x - masked_mean(x, mask)) ** 2, mask) / (n - 1).clamp(min=1)
    return torch.where(n > 1, var.sqrt(), torch.zeros_like(var))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the masked entries (unbiased variance, as verl)."""
    mean = masked_mean(x, mask)
    n = mask.sum()
    var = masked_sum((x - mean) ** 2, mask) / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    return out if shift_mean else out + mean
