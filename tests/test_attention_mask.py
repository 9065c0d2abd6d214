"""Attention masks follow HF semantics: causal, sliding window (i - j < window), padded keys."""

from __future__ import annotations

import torch

from mlora.models.attention import attention_mask


def test_causal_window_and_padding():
    pad = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    m = attention_mask(2, 4, pad, sliding_window=2)
    allowed0 = ~m[0, 0]
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(allowed0, expected)
    assert torch.equal(~m[1, 0, :, 2:], torch.zeros(4, 2, dtype=torch.bool))
    assert torch.equal(~attention_mask(1, 3)[0, 0], torch.tril(torch.ones(3, 3, dtype=torch.bool)))
