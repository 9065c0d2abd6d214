"""Right-padded token batches for equivalence tests."""

from __future__ import annotations

import torch


def right_padded_batch(vocab: int, lengths: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids ``[len(lengths), max(lengths)]`` and HF's attention mask; padding ids are 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(lengths), max(lengths)), generator=g)
    mask = torch.ones_like(ids)
    for row, length in enumerate(lengths):
        mask[row, length:] = 0
        ids[row, length:] = 0
    return ids, mask
