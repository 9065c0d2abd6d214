"""Attention masks in megatron's convention (True = masked), built on the input's device."""

from __future__ import annotations

import torch


def attention_mask(batch: int, seq_len: int, padding_mask: torch.Tensor | None = None,
                   sliding_window: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[batch, 1, seq, seq]`` bool mask: causal, optionally windowed, keys at padding masked.

    ``padding_mask`` is HF's ``attention_mask`` (1 = token, 0 = padding). A query may see key
    ``j`` when ``j <= i``, ``i - j < sliding_window`` (if set) and key ``j`` is a token.
    """
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    masked = j > i
    if sliding_window is not None:
        masked = masked | (i - j >= sliding_window)
    masked = masked[None, None].expand(batch, 1, seq_len, seq_len)
    if padding_mask is not None:
        masked = masked | (padding_mask.to(device) == 0)[:, None, None, :]
    return masked.contiguous()
