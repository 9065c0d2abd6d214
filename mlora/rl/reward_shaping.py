"""DAPO's length shaping of outcome rewards (https://dapo-sia.github.io/), as SkyRL applies it.

Both are pure: lists or tensors in, tensors out, one value per response.
"""

from __future__ import annotations

from typing import Sequence

import torch


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_len: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, the value added to each response's reward.

    With ``L`` the response length, ``L_max = max_length``, ``B = buffer_len``, ``f = factor``::

        penalty(L) = 0                                 L <= L_max - B
                   = -f · (L - (L_max - B)) / B        L_max - B < L <= L_max

    0 up to ``L_max - B`` tokens, then linearly down to ``-f`` at ``L_max``. SkyRL's
    ``examples/train/algorithms/dapo/main_dapo.py`` also sets the reward of a response longer than
    ``L_max`` to 0; single-turn engines stop at ``L_max``, so that case is the caller's to refuse.
    """
    if not 0 < buffer_len <= max_length:
        raise ValueError(f"overlong_buffer_len={buffer_len} must be in [1, max_generate_length={max_length}]")
    if (lengths > max_length).any():
        raise ValueError(f"response lengths {lengths.max().item()} > max_generate_length={max_length}")
    start = max_length - buffer_len
    return -factor * (lengths.float() - start).clamp(min=0) / buffer_len


def overlong_filter_mask(finish_reasons: Sequence[str | None]) -> torch.Tensor:
    """DAPO's overlong filtering: 1.0 for a response that ended with a stop (``finish_reason == "stop"``:
    EOS or a stop string), 0.0 for one cut short (``"length"``, aborted); the 0 rows' tokens leave the
    loss (SkyRL's ``apply_overlong_filtering``: the loss mask of a truncated response is zeroed)."""
    return torch.tensor([1.0 if r == "stop" else 0.0 for r in finish_reasons])
