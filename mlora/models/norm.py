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


QK_NORM_CONFIG_ATTR = "mlora_qk_norm"  # set on the TransformerConfig: None, "head" or "full"


class _FullWidthNorm(torch.nn.Module):
    """OLMoE's q/k RMSNorm over all heads' width at once (``num_heads * head_dim``), in megatron's q/k
    layernorm slot, which sees this TP rank's heads ``[s, b, heads, head_dim]``: the mean of squares is
    summed over TP ranks (an all-reduce whose backward sums too, since each rank's heads feed every
    rank's scale), the weight is this rank's heads' slice."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_: object) -> None:
        super().__init__()
        from megatron.core import parallel_state as ps

        self.eps, self.tp_group = eps, ps.get_tensor_model_parallel_group()
        heads = self.full_heads(config)
        self.width = heads * hidden_size
        local = heads // config.tensor_model_parallel_size
        self.weight = torch.nn.Parameter(torch.ones(local * hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, shape = x.dtype, x.shape
        h = x.reshape(*shape[:-2], -1).to(torch.float32)
        squares = h.pow(2).sum(-1, keepdim=True)
        if self.tp_group.size() > 1:
            import torch.distributed.nn.functional as dist_fn

            squares = dist_fn.all_reduce(squares, group=self.tp_group)
        h = h * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight * h.to(dtype)).reshape(shape)


class FullWidthQNorm(_FullWidthNorm):
    @staticmethod
    def full_heads(config) -> int:
        return config.num_attention_heads


class FullWidthKNorm(_FullWidthNorm):
    @staticmethod
    def full_heads(config) -> int:
        return config.num_query_groups
