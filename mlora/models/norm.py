"""RMSNorm with the exact arithmetic of HF Llama/Qwen2/Mistral, usable with sequence parallelism.

megatron's local spec wraps ``torch.nn.RMSNorm`` and refuses ``sequence_parallel``; a norm is
per token, so under SP it only needs its weight marked so that its gradient is summed over TP.
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    """``weight * x / sqrt(mean(x²) + eps)``, computed in float32 like transformers' LlamaRMSNorm."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_: object) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # Read by megatron's grad reduction: under SP each TP rank sees only its tokens.
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
