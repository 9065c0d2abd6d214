"""DeepSeek-V3's multi-head latent attention: megatron-core's ``MLASelfAttention`` with transformers' RoPE, on CPU.

megatron-core 0.16's MLA is built for Transformer Engine on CUDA: its rotary embeddings allocate on the current CUDA
device when built, its YaRN embedding moves its frequencies to CUDA at the first forward, and its constructor
compares the linear classes of the spec by identity with megatron's own (``ColumnParallelLinear`` and TE's), and
checks ``isinstance(..., TELinear)`` where TE is absent (``TELinear`` is None then). :class:`LoraMLASelfAttention`
builds megatron's class unchanged with those three names bound, for its constructor only, to what mlora uses:
:class:`HFRotaryEmbedding` (transformers' inverse frequencies and YaRN attention factor for the decoupled RoPE dims,
on the model's device), :class:`LoraDuplicatedLinear` as the accepted class of the down projections, and a type
nothing is an instance of. The forward is megatron's: the q and kv down projections, their RMSNorms, the up
projections (column-parallel), RoPE on the decoupled dims (megatron's MLA reads them interleaved, as transformers does
with ``rope_interleave``), the core attention (mlora's SDPA, q/k head dim ≠ v head dim) and the output projection.

The down projections are duplicated, as megatron's Transformer Engine spec builds them (``parallel_mode=
"duplicated"``): every TP rank holds the whole weight and, under SP, projects its own slice of the sequence; megatron
then gathers the decoupled RoPE key over the sequence, whose backward sums the TP ranks' partial gradients (each
rank's heads use it). Column-parallel down projections (megatron's local spec) gather their outputs over TP instead,
whose backward takes each rank's slice of the gradient without that sum: the RoPE key's gradient, and every
gradient below it, would miss the other ranks' heads.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer import multi_latent_attention as _mla
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from mlora.lora.layers import LoraHost, lora_linear

MLA_ROPE_CONFIG_ATTR = "mlora_mla_rope"  # on megatron's config: (inv_freq, attention_factor) from transformers


class LoraDuplicatedLinear(LoraHost, MegatronModule):
    """A linear every TP rank holds whole, applied to this rank's input (its slice of the sequence under SP), with
    LoRA branches: the site kind ``duplicated``, whose factors are replicated and whose gradients are partial per TP
    rank (summed over TP × DP, like a MoE router's). Built by megatron's MLA for its down projections (it takes the
    constructor arguments of megatron's linears; there is nothing to gather, split or reduce)."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method=None, bias: bool = False,
                 skip_bias_add: bool = False, is_expert: bool = False, tp_comm_buffer_name=None,
                 skip_weight_param_allocation: bool = False, tp_group=None, gather_output: bool = False,
                 parallel_mode=None) -> None:
        if bias:
            raise ValueError("multi-latent attention's down projections have no bias in the families mlora builds")
        super().__init__(config=config)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype,
                                                     device=device))
        self.bias = None
        self.tp_group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
        self._init_lora()
        self.weight_scale = None  # never FP8 (mlora.models.megatron_build refuses FP8 with MLA)

    def forward(self, x: torch.Tensor):
        branches, routes = self._slice_routed_branches(x)
        return lora_linear(x, self.weight, None, branches, self.lora_site, routes=routes), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """The weight as a tensor every TP rank holds whole (megatron's duplicated TE linears do the same)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint({"weight": self.weight}, prefix, {}, sharded_offsets)


class HFRotaryEmbedding(torch.nn.Module):
    """megatron's (YaRN) rotary embedding interface on transformers' numbers: ``forward(seq_len)`` gives the angles
    ``[s, 1, 1, dim]`` (each frequency twice, megatron's layout) and the factor cos and sin are scaled by (YaRN's
    attention factor; 1 otherwise)."""

    get_rotary_seq_len = RotaryEmbedding.get_rotary_seq_len

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float) -> None:
        super().__init__()
        self.inv_freq = inv_freq
        self.attention_factor = float(attention_factor)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        seq = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32) + offset
        freqs = torch.outer(seq, self.inv_freq.float())
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :], self.attention_factor


class _NoTELinear:
    """What megatron's MLA checks ``isinstance(linear_proj, TELinear)`` against when TE is absent."""


@contextlib.contextmanager
def _bound(**names):
    saved = {name: getattr(_mla, name) for name in names}
    try:
        for name, value in names.items():
            setattr(_mla, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(_mla, name, value)


class LoraMLASelfAttention(MLASelfAttention):
    """megatron's ``MLASelfAttention``, built on CPU or CUDA with mlora's LoRA linears and transformers' RoPE (see the
    module's docstring). The config carries the RoPE (:data:`MLA_ROPE_CONFIG_ATTR`) and ``rope_type="yarn"`` with
    the YaRN factor and ``mscale_all_dim`` megatron scales the softmax by (1 and 0 without YaRN)."""

    def __init__(self, config, submodules, *args, **kwargs) -> None:
        inv_freq, factor = getattr(config, MLA_ROPE_CONFIG_ATTR)
        te_linear = _mla.TELinear if isinstance(_mla.TELinear, type) else _NoTELinear
        with _bound(YarnRotaryEmbedding=lambda *a, **k: HFRotaryEmbedding(inv_freq, factor),
                    RotaryEmbedding=lambda *a, **k: HFRotaryEmbedding(inv_freq, factor),
                    TELinear=te_linear, Linear=LoraDuplicatedLinear):
            super().__init__(config, submodules, *args, **kwargs)
