"""AdamW over trainable parameters with linear warm-up, then constant or cosine decay."""

from __future__ import annotations

import torch

from mlora.rl.lr_schedule import lr_lambda


def build_optimizer(params: list[torch.nn.Parameter], lr: float, weight_decay: float, betas, warmup_steps: int,
                    total_steps: int, min_lr_ratio: float, schedule: str):
    """``(AdamW, LambdaLR)``; AdamW is element-wise, so sharded parameters update exactly as whole ones."""
    if not params:
        raise ValueError("no trainable parameters for the optimizer")
    lr_lambda(0, warmup_steps, total_steps, min_lr_ratio, schedule)  # a bad schedule name fails here, not later
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, warmup_steps, total_steps, min_lr_ratio, schedule))
    return opt, sched
