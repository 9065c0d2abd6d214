"""Masked reductions shared by the RL functions (``mask`` is 1 on response tokens, 0 elsewhere)."""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """``Σ x·m / Σ m`` (0 where the mask is empty)."""
    return masked_sum(x, mask, dim) / mask.sum(dim).clamp(min=1) if dim is not None else \
        masked_sum(x, mask) / mask.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the masked entries (unbiased variance, as verl)."""
    mean = masked_mean(x, mask)
    n = mask.sum()
    var = masked_sum((x - mean) ** 2, mask) / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    return out if shift_mean else out + mean
