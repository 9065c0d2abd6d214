"""The learning-rate multiplier of every schedule mlora trains with: linear warm-up, then constant or
cosine decay. A pure function of the step (the optimizer wraps it in ``LambdaLR``)."""

from __future__ import annotations

import math

# "constant_with_warmup" is SkyRL's (transformers') name for what "constant" does here: every
# schedule starts with the linear warm-up over warmup_steps (none when it is 0).
LR_SCHEDULES = ("constant", "constant_with_warmup", "cosine")


def lr_lambda(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, schedule: str) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based).

    Warm-up: ``(step + 1) / warmup_steps``; then cosine from 1 to ``min_lr_ratio`` over the
    remaining steps (``constant`` and ``constant_with_warmup`` keep 1).
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; valid: {', '.join(LR_SCHEDULES)}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule in ("constant", "constant_with_warmup"):
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
