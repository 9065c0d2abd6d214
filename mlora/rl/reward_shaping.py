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

    0 up to ``L_max - B`` tokens, then linearly down to ``-f`` at ``L_max``; a response longer than ``L_max``
    (a multi-turn trajectory, whose length counts the environment's tokens) gets 0 here and its reward set to
    0 by :func:`overlong_zeroed` (SkyRL's ``apply_dapo_soft_overlong_punishment``).
    """
    if not 0 < buffer_len <= max_length:
        raise ValueError(f"overlong_buffer_len={buffer_len} must be in [1, max_generate_length={max_length}]")
    start = max_length - buffer_len
    penalty = -factor * (lengths.float() - start).clamp(min=0) / buffer_len
    return torch.where(lengths > max_length, torch.zeros_like(penalty), penalty)


def overlong_zeroed(lengths: torch.Tensor, max_length: int) -> torch.Tensor:
    """``[B]`` bool: the responses longer than ``max_length``, whose reward DAPO's shaping sets to 0."""
    return lengths > max_length


def overlong_filter_mask(finish_reasons: Sequence[str | None]) -> torch.Tensor:
    """DAPO's overlong filtering: 1.0 for a response that ended with a stop (``finish_reason == "stop"``:
    EOS or a stop string), 0.0 for one cut short (``"length"``, aborted); the 0 rows' tokens leave the
    loss (SkyRL's ``apply_overlong_filtering``: the loss mask of a truncated response is zeroed)."""
    return torch.tensor([1.0 if r == "stop" else 0.0 for r in finish_reasons])
