"""Core attention for the local layer spec, and the attention masks mlora hands to it.

Two implementations fill megatron's ``core_attention`` slot (chosen with
``mlora.from_pretrained(..., attention=...)``):

- ``"sdpa"`` (default): :class:`SDPAttention`, ``torch.nn.functional.scaled_dot_product_attention``
  (flash / memory-efficient kernels on GPU, the fused flash kernel on CPU). It never builds the
  ``[s, s]`` score matrix, and :func:`sdpa_mask` gives it no mask at all for causal batches without
  padding or with right padding only; Mistral's sliding window costs one ``[1, 1, s, s]`` additive
  mask per step, shared by every layer and micro-batch.
  gpt-oss's attention sinks ride along as one key more (:func:`_with_sink_key`) and its window on every other layer
  is each layer's own (``LAYER_WINDOWS_CONFIG_ATTR``), on top of the model's mask.
- ``"unfused"``: megatron's ``DotProductAttention`` (scores materialised, softmax, matmul) with
  the full ``[b, 1, s, s]`` boolean mask of :func:`attention_mask`; kept as the reference the fused
  path is tested and benchmarked against. The Transformer Engine spec (``fp8="te"``) also takes the
  full boolean mask.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

ATTENTION_IMPLS = ("sdpa", "unfused")
ATTENTION_CONFIG_ATTR = "mlora_attention"  # on megatron's TransformerConfig: which core attention block_spec uses
# on megatron's TransformerConfig: the model's sliding window (Mistral), which packed rows apply per segment;
# unpacked batches carry it in their mask
WINDOW_CONFIG_ATTR = "mlora_sliding_window"
# on megatron's TransformerConfig: a window per layer (gpt-oss: None = full attention), applied by each layer's
# SDPAttention on top of the model's mask (which then carries no window)
LAYER_WINDOWS_CONFIG_ATTR = "mlora_layer_windows"

# Mask types under which a missing mask means "causal" (megatron's unfused path builds a causal
# mask for these itself; SDPA's is_causal does the same without one).
_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)


def check_attention_arg(attention: str) -> str:
    """``attention`` if it names a core-attention implementation, else a ValueError naming the valid ones."""
    if attention not in ATTENTION_IMPLS:
        raise ValueError(f"attention={attention!r} is not supported; choose one of "
                         + ", ".join(repr(a) for a in ATTENTION_IMPLS))
    return attention


def attention_mask(batch: int, seq_len: int, padding_mask: torch.Tensor | None = None,
                   sliding_window: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[batch, 1, seq, seq]`` bool mask in megatron's convention (True = masked): causal,
    optionally windowed, keys at padding masked. The unfused and TE core attentions need it.

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


def is_right_padded(padding_mask: torch.Tensor) -> bool:
    """Whether every row of HF's ``attention_mask`` reads ``1…1 0…0`` (no padding counts as right padding)."""
    tokens = padding_mask != 0
    return bool((tokens[:, 1:] <= tokens[:, :-1]).all())


def sdpa_mask(seq_len: int, padding_mask: torch.Tensor | None = None, sliding_window: int | None = None,
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The smallest mask :class:`SDPAttention` needs on top of causality, or None (then it runs causal).

    - no padding, or right padding only, and no window shorter than the sequence: None. Under causal
      attention a token's query sees only keys at or before it, which are tokens too, so every token
      position is exact; positions at padding get unspecified outputs (as in HF), never used.
    - a window shorter than the sequence (Mistral), no padding or right padding: an additive
      ``[1, 1, s, s]`` mask (0 = attend, -inf = masked) with causality and the window, broadcast over
      the batch.
    - any other padding (left, or holes): the full ``[b, 1, s, s]`` additive mask: causal, window,
      keys at padding masked. Each query also sees its own key so that no row is fully masked (a
      fully masked row is NaN in some kernels); that changes only outputs at padding positions.

    The mask is additive in ``dtype`` (the model's activation dtype) rather than boolean: SDPA turns
    a boolean mask into such a float tensor in every call anyway, and the flash kernels keep the
    mask for backward, so one float mask shared by all layers is the least memory.
    """
    window = sliding_window if sliding_window is not None and sliding_window < seq_len else None
    arbitrary = padding_mask is not None and not is_right_padded(padding_mask)
    if window is None and not arbitrary:
        return None
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j < window)
    allowed = allowed[None, None]
    if arbitrary:
        allowed = (allowed & (padding_mask.to(device) != 0)[:, None, None, :]) | (i == j)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def _repeat_kv_needed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      is_causal: bool) -> bool:
    """Whether K/V must be repeated to the query heads because no fused kernel takes them grouped.

    Measured with torch 2.13 on CPU (AVX-512): the flash kernel takes ``enable_gqa=True`` itself
    (the profile shows no ``repeat_interleave``; 1.15x faster than repeating at s=2048, 8 heads,
    2 groups), with and without a mask. On CUDA the flash kernel takes GQA too; a kernel that does not
    (e.g. memory-efficient attention in some torch versions) makes torch pick the math path, which
    materialises the scores: then repeating K/V (``O(s)`` memory) keeps a fused kernel.
    """
    choice = getattr(torch, "_fused_sdp_choice", None)  # private; without it let torch decide
    if choice is None:
        return False
    from torch.nn.attention import SDPBackend

    try:
        picked = choice(query, key, value, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
    except (RuntimeError, TypeError):
        return False
    return int(picked) == int(SDPBackend.MATH)


def _value_as_wide_as_query(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``v`` zero-padded to the query's head dim, and its own dim (multi-latent attention: q/k 192 dims, v 128). SDPA's
    fused kernels (flash, memory-efficient, CPU's flash) take one head dim for q, k and v; without them it runs its
    math kernel, which keeps the ``[b, h, s, s]`` probabilities. The zero columns give zero outputs, cut off after."""
    v_dim = v.shape[-1]
    if v_dim == q.shape[-1]:
        return v, v_dim
    return torch.nn.functional.pad(v, (0, q.shape[-1] - v_dim)), v_dim


@functools.lru_cache(maxsize=2)
def _window_mask(seq_len: int, window: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive causal ``[1, 1, s, s]`` mask of a ``window``, built once for every layer that has it (gpt-oss's
    windowed layers share one; the latest two lengths kept)."""
    return sdpa_mask(seq_len, None, window, dtype, device)


def sink_key_dim(head_dim: int) -> int:
    """The head dim of q, k and v with the sinks' extra dim (:func:`_with_sink_key`): past ``head_dim`` by 1, padded
    to a multiple of 8."""
    return head_dim + (-(head_dim + 1)) % 8 + 1


def _with_sink_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sink: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q, k, v and the mask ``[b, h, s, ·]`` with gpt-oss's attention sinks as one key more, for SDPA's fused kernels.

    A sink adds ``exp(sink_h)`` to each softmax denominator of head h and nothing to the output (transformers
    concatenates it to the scores and drops its column). Here it is key 0 with a zero value, its score ``sink_h`` made
    by one more head dim: 1 on the sink key, 0 on the others, ``sink_h / scale`` on every query of head h (per query
    head, so K/V stay grouped); zeros pad the head dim to a multiple of 8. A dummy query 0 (zeros, its output dropped)
    keeps the causal mask square: query i + 1 sees keys 0..i + 1, the sink and real keys 0..i. An explicit mask gets
    the sink's column (always seen) and the dummy's row."""
    b, h, s, d = q.shape
    pad = sink_key_dim(d) - d
    column = (sink.to(q.dtype) / scale).view(1, h, 1, 1).expand(b, h, s, 1)
    q = torch.cat([q, column, q.new_zeros(b, h, s, pad - 1)], dim=-1)
    q = torch.cat([q.new_zeros(b, h, 1, d + pad), q], dim=2)
    sink_key = k.new_zeros(1, 1, 1, d + pad)
    sink_key[..., d] = 1.0
    k = torch.cat([sink_key.expand(b, k.shape[1], 1, d + pad), F.pad(k, (0, pad))], dim=2)
    v = torch.cat([v.new_zeros(b, v.shape[1], 1, v.shape[-1]), v], dim=2)
    if mask is not None:
        mask = F.pad(mask, (1, 0, 1, 0), value=True if mask.dtype == torch.bool else 0.0)
    return q, k, v, mask


class SDPAttention(MegatronModule):
    """Drop-in for megatron's ``DotProductAttention`` (same constructor and forward signature)
    computed by ``torch.nn.functional.scaled_dot_product_attention``.

    ``forward(query, key, value, attention_mask)`` takes ``[s, b, heads, head_dim]`` (query groups
    for key and value) and returns ``[s, b, heads * head_dim]``. ``attention_mask``:

    - None: causal when the layer's mask type is causal (mlora's spec), else none;
    - boolean: megatron's convention (True = masked), e.g. :func:`attention_mask`;
    - floating: additive (0 = attend, -inf = masked), as :func:`sdpa_mask` builds it.

    Scale: ``softmax_scale`` or ``1/sqrt(kv_channels)``, as megatron. megatron's
    ``apply_query_key_layer_scaling`` divides the scores by the layer number and multiplies them
    back inside the fp32 softmax, which leaves the result unchanged (it only keeps fp16 scores in
    range); SDPA's kernels accumulate in fp32 for bf16/fp16 inputs, so there is nothing to undo.
    For the same reason ``attention_softmax_in_fp32`` needs no counterpart.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, k_channels: int | None = None,
                 v_channels: int | None = None) -> None:
        # k_channels/v_channels: multi-latent attention's head dims (q/k ≠ v); SDPA reads them off the tensors
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism (context_parallel_size must be 1)")
        if config.softmax_type not in ("vanilla", "learnable"):
            raise NotImplementedError(f"SDPAttention supports softmax_type 'vanilla' and 'learnable' (attention sinks), "
                                      f"not {config.softmax_type!r}")
        self.layer_number = max(1, layer_number)
        # gpt-oss's sinks: megatron's learnable softmax offset (its name and TP split), loaded from the checkpoint
        self.softmax_offset = None
        if config.softmax_type == "learnable":
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            heads = config.num_attention_heads // config.tensor_model_parallel_size
            self.softmax_offset = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        windows = getattr(config, LAYER_WINDOWS_CONFIG_ATTR, None)
        self.window = windows[self.layer_number - 1] if windows is not None else None
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params=None) -> torch.Tensor:
        """Attention output ``[s, b, heads * head_dim]`` (see the class docstring for the mask)."""
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by SDPAttention")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, mask_type)
        sq, batch, heads, _ = query.shape
        is_causal = attention_mask is None and mask_type in _CAUSAL_TYPES
        if is_causal and key.shape[0] != sq:
            raise NotImplementedError("causal SDPAttention needs as many keys as queries (no KV cache)")
        mask = attention_mask
        if mask is not None:
            # boolean masks come in megatron's convention (True = masked), SDPA's is True = attend
            mask = ~mask if mask.dtype == torch.bool else mask.to(query.dtype)
        if self.window is not None and self.window < sq:  # this layer's window on top of the model's mask
            mask = self._windowed(mask, sq, query)
            is_causal = False
        # [s, b, h, d] -> [b, h, s, d]: views; the kernels read strided inputs
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout = self.dropout_p if self.training else 0.0
        fork = contextlib.nullcontext()
        if dropout > 0.0 and not self.config.sequence_parallel:
            from megatron.core import tensor_parallel

            fork = tensor_parallel.get_cuda_rng_tracker().fork()  # as megatron: per-TP-rank dropout stream
        with fork:
            out = self._attend(q, k, v, mask, is_causal, dropout)
        # [b, h, s, d] -> [s, b, h * d]
        return out.permute(2, 0, 1, 3).reshape(sq, batch, -1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """The sinks (where the layer has them) split over TP with the heads, under megatron's key
        (``core_attention.softmax_offset``, as its ``DotProductAttention`` writes them)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        if self.softmax_offset is None:
            return {}
        return make_sharded_tensors_for_checkpoint({"softmax_offset": self.softmax_offset}, prefix,
                                                   {"softmax_offset": 0}, sharded_offsets)

    def _windowed(self, mask: torch.Tensor | None, seq_len: int, like: torch.Tensor) -> torch.Tensor:
        """``mask`` (SDPA's convention, or None: causal) with this layer's window: additive ``[1, 1, s, s]`` alone
        (one for every layer with this window and length, :func:`_window_mask`), else combined with the model's."""
        windowed = _window_mask(seq_len, self.window, like.dtype, like.device)
        if mask is None:
            return windowed
        if mask.dtype == torch.bool:
            return mask & (windowed == 0)
        return mask + windowed

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                dropout: float) -> torch.Tensor:
        """SDPA of ``[b, h, s, d]`` q and grouped k/v, with the sinks where the layer has them; ``[b, h, s, d_v]``."""
        v_dim, sq = v.shape[-1], q.shape[2]
        if self.softmax_offset is not None:
            q, k, v, mask = _with_sink_key(q, k, v, mask, self.softmax_offset, self.softmax_scale)
        v, _ = _value_as_wide_as_query(q, v)
        heads = q.shape[1]
        gqa = k.shape[1] != heads
        if gqa and _repeat_kv_needed(q, k, v, mask, is_causal):
            k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
            gqa = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                                             scale=self.softmax_scale, enable_gqa=gqa)
        return out[:, :, -sq:, :v_dim]

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed_seq_params,
                mask_type: AttnMaskType) -> torch.Tensor:
        """Megatron's ``thd`` format (``[t, heads, head_dim]``, segments at ``cu_seqlens``): each segment
        attends to itself only, causal (and windowed) as an unpacked row would; ``[t, heads * head_dim]``.

        One SDPA call per segment, what a varlen kernel (flash-attention, TE) does in one launch: the
        work is ``Σ len²`` rather than ``(Σ len)²`` and no ``[t, t]`` mask is built."""
        if packed_seq_params.qkv_format != "thd":
            raise NotImplementedError(f"SDPAttention takes packed sequences in the 'thd' format, not "
                                      f"{packed_seq_params.qkv_format!r}")
        if mask_type not in _CAUSAL_TYPES:
            raise NotImplementedError(f"packed SDPAttention is causal only, not {mask_type}")
        cu = packed_seq_params.cu_seqlens_q.tolist()
        if cu != packed_seq_params.cu_seqlens_kv.tolist() or cu[-1] != query.shape[0]:
            raise ValueError(f"packed attention needs cu_seqlens_q == cu_seqlens_kv ending at the {query.shape[0]} "
                             f"tokens, got {cu} and {packed_seq_params.cu_seqlens_kv.tolist()}")
        per_layer = getattr(self.config, LAYER_WINDOWS_CONFIG_ATTR, None) is not None
        window = self.window if per_layer else getattr(self.config, WINDOW_CONFIG_ATTR, None)
        dropout = self.dropout_p if self.training else 0.0
        fork = contextlib.nullcontext()
        if dropout > 0.0 and not self.config.sequence_parallel:
            from megatron.core import tensor_parallel

            fork = tensor_parallel.get_cuda_rng_tracker().fork()
        outs = []
        with fork:
            for a, b in zip(cu[:-1], cu[1:]):
                # [len, h, d] -> [1, h, len, d]: views
                q, k, v = (t[a:b].permute(1, 0, 2)[None] for t in (query, key, value))
                mask = sdpa_mask(b - a, None, window, query.dtype, query.device)
                out = self._attend(q, k, v, mask, mask is None, dropout)
                outs.append(out[0].permute(1, 0, 2).reshape(b - a, -1))
        return torch.cat(outs)
