"""Activation bytes of one micro-batch on one rank: what autograd keeps, and the working memory on top.

Pure arithmetic on a :class:`Geometry` (this rank's slice of one micro-batch). The terms follow
the tensors autograd actually saves in mlora's local layer spec (counted with
``torch.autograd.graph.saved_tensors_hooks``; ``tests/test_memory_plan.py`` holds the formula to
that count), so they change when the layer code does. Assumptions, per term:

- Every saved tensor is in the compute dtype except the RMSNorm statistics (float32 input copy and
  ``rsqrt``), the SDPA log-sum-exp and the unfused softmax, which are float32.
- autograd saves only what a gradient needs: the frozen base GEMMs save nothing of their input; a
  tensor is saved only once something upstream of it (a trainable LoRA factor, a stage input from
  the previous pipeline stage, the embedding output under recompute) requires grad.
- A trainable LoRA branch on a column-parallel layer saves the layer's input *after* the
  sequence-parallel all-gather (the whole sequence) and its ``x·Aᵀ`` (on an FP8 base also the block
  ``s·B`` it built); on a row-parallel layer the input slice (shared with the attention output, or
  the MLP product). A branch computing in float32 on a 16-bit base (the default there, as PEFT) keeps
  its own float32 copy of the input, its ``x·Aᵀ`` and the block ``s·B`` in float32.
- SDPA (flash kernels on GPU, the fused flash kernel on CPU) keeps q, k (after RoPE), v (a view
  of the fused QKV output, so the whole QKV output), its output and a float32 log-sum-exp per head
  and token: memory linear in the sequence. The unfused path keeps the ``[b, heads, s, s]`` float32
  softmax (plus its dtype copy when the dtype is narrower) and K/V repeated to every query head under
  GQA; every micro-batch of a call also holds its ``[b, 1, s, s]`` boolean mask.
- q/k RMSNorms (Qwen3, OLMoE) keep float32 copies of q (and of k where it is not a view of the QKV
  output already kept) and their ``rsqrt``.
- Sequence parallelism divides the residual stream (norm inputs, stage boundaries) by TP; the
  gathered inputs of LoRA column layers and everything inside attention and the MLP are whole.
- Recompute is megatron's: ``full`` keeps the input of each checkpointed group of layers and, while
  one group runs backward, that group's activations; ``selective`` (``core_attn``) keeps only the
  inputs of the core attention (q, k, the QKV output), ``mlp`` only the MLP input.

Transients (working memory beyond what is kept) are bounded per layer: the largest intermediate
set of a forward (no-grad passes) and of a backward (the gradients of one sublayer in flight).

Mixture-of-experts layers (:class:`Experts` on the layer's geometry) replace the MLP terms with
megatron's MoE layer as mlora builds it (the router in the model's dtype or float32, all-to-all dispatcher,
the local experts' GEMMs grouped (:mod:`mlora.models.grouped_experts`; one after another with FP8 weights), expert
TP 1):

- kept: the router's input (its gating GEMM saves it), the routing's top-k indices and softmax
  (float32: over the k chosen logits when the k weights are renormalised, else over all E; a sigmoid
  router's float32 scores and the k picked), the permutation's ``[E, tokens]`` routing map (bool) and
  probabilities (in the router's dtype) and its int64 sorted indices; per received token copy, an expert's MLP
  terms (``[gate; up]``, silu(gate), megatron's ``up + 0`` on the sequential path, and the GLU output the routing
  weight multiplies) and that weight. A trainable LoRA on the experts keeps its input (the received tokens, or the
  GLU product for ``down``) and ``x·Aᵀ``; grouped, also the stacked A and the block-diagonal ``s·B`` of every local
  expert, their ranks padded to grouped_mm's 16-byte strides (:func:`mlora.models.grouped_experts.padded_rank`).
- the tokens this rank's experts receive: every token of the rank (the residual stream's, split over
  TP under SP) goes to ``top_k`` experts; the planner assumes balanced routing, so an EP rank receives
  ``tokens · top_k`` copies per sparse layer (exact at EP 1; ``expert_load`` scales it). The worst
  case, every token of the EP group routed to this rank's experts, is
  ``EP · min(top_k, E / EP) / top_k`` times that (:func:`mlora.plan.workload.worst_expert_load`).
- transients: the router's float32 logits and probabilities ``[tokens, E]``; the dispatcher's buffers
  (the permuted copies sent, ``tokens · top_k × hidden``; the received ones sorted by expert, the
  experts' outputs and their concatenation, each ``received × hidden``) and the experts' MLP terms: every
  received copy's at once when grouped, one expert's at a time on the sequential path; the same shapes again as
  gradients in the backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from mlora.models.attention import sink_key_dim
from mlora.models.grouped_experts import padded_rank

F32 = 4  # bytes of a float32
I64 = 8  # bytes of an int64 index
I32 = 4  # bytes of an int32 offset


@dataclass(frozen=True)
class Experts:
    """One sparse layer's experts as an EP rank holds them (expert TP 1: whole experts, ``num_experts / ep``
    of them) and the routing that feeds them."""

    num_experts: int  # E, the router's width
    top_k: int
    ffn: int  # one expert's intermediate size (never split over TP)
    ep: int
    topk_softmax: bool  # softmax over the k chosen logits (top-k weights renormalised), else over all E first
    load: float = 1.0  # token copies received, relative to balanced routing
    shared_ffn: int = 0  # a shared expert's intermediate size on this rank (TP-split like a dense MLP's; 0: none)
    shared_gate: bool = True  # the shared expert's output scaled by sigmoid(x·gate) (Qwen2-MoE; GLM-4.5: none)
    sigmoid: bool = False  # sigmoid scores (GLM-4.5, DeepSeek-V3), else softmax
    router_fp32: bool = False  # the router's logits and routing weights in float32, else in the model's dtype
    clamped: bool = False  # gpt-oss: biased experts with the clamped SwiGLU, computed one after another

    @property
    def local(self) -> int:
        return self.num_experts // self.ep

    def received(self, tokens: int) -> int:
        """Token copies this rank's experts process in one sparse layer when every rank routes ``tokens``."""
        return math.ceil(tokens * self.top_k * self.load)

    def per_expert(self, tokens: int) -> int:
        """The copies one local expert processes (its share; each token of the group reaches it once at most)."""
        return min(-(-self.received(tokens) // self.local), self.ep * tokens)


@dataclass(frozen=True)
class Geometry:
    """This rank's view of one micro-batch at one layer."""

    batch: int  # sequences in the micro-batch
    seq: int  # tokens per sequence inside the model (padded to a multiple of TP under SP)
    hidden: int
    heads: int  # attention heads on this rank (heads / TP)
    kv_heads: int  # query groups on this rank
    head_dim: int
    ffn: int  # intermediate size on this rank (intermediate / TP)
    tp: int
    sp: bool
    item: int  # bytes per element of the compute dtype
    fp8: bool = False  # the frozen linears are FP8 (their LoRA takes the block-B path of lora_delta)
    lora_item: int = 0  # bytes per element of the LoRA branches' compute dtype (0: the compute dtype's)
    experts: Experts | None = None  # a mixture-of-experts layer's experts (None: a dense MLP)
    qk_norm: str | None = None  # RMSNorm on q and k before RoPE: per head ("head", Qwen3) or over all ("full")
    rotary_dim: int = 0  # the head dims RoPE rotates (0: all of head_dim; GLM-4.5 rotates half)
    mla: object = None  # multi-latent attention's dims (mlora.formats.hf_config.MLASpec; DeepSeek-V3), else None
    sinks: bool = False  # gpt-oss's attention sinks (SDPA with one key more: mlora.models.attention)
    window: int | None = None  # this layer's own sliding window (gpt-oss), applied by its attention

    @property
    def branch_item(self) -> int:
        return self.lora_item or self.item

    @property
    def separate_branch(self) -> bool:
        """The LoRA branches run as autograd GEMMs of their own (:func:`mlora.lora.layers.lora_delta`): on an
        FP8 base, or in another dtype than the base (float32 branches on bf16, with their own input copy)."""
        return self.fp8 or self.branch_item != self.item

    @property
    def tokens(self) -> int:
        """Tokens of the micro-batch (whole sequences)."""
        return self.batch * self.seq

    @property
    def stream_tokens(self) -> int:
        """Tokens of the residual stream on this rank: split over TP under sequence parallelism."""
        return self.tokens // self.tp if self.sp else self.tokens

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def qkv_width(self) -> int:
        return self.q_width + 2 * self.kv_width

    @property
    def scores(self) -> int:
        """Elements of one ``[b, heads, s, s]`` attention-score tensor on this rank."""
        return self.batch * self.heads * self.seq * self.seq


@dataclass(frozen=True)
class LayerLora:
    """The trainable LoRA of one layer: how many projections each site adapts (``qkv``: q, k, v; ``proj``: o;
    ``fc1``: gate, up; ``fc2``: down; a shared expert's ``shared_fc1``/``shared_fc2``; a MoE ``router``), the rank
    and the experts' rank."""

    sites: Mapping[str, int]
    rank: int
    expert_rank: int | None = None  # of a sparse layer's experts (None: rank)

    def k(self, site: str) -> int:
        return self.sites.get(site, 0)


def _norm_saved(g: Geometry) -> int:
    """RMSNorm (float32 math): the float32 input (a copy unless the dtype is float32) and ``rsqrt``."""
    return g.stream_tokens * (g.hidden + 1) * F32


def _lora_saved(g: Geometry, k: int, rank: int, out_width: int, tokens: int | None = None, blocks: int = 1) -> int:
    """A trainable branch besides its input: ``x·Aᵀ`` ``[tokens, k·r]``; when the branch runs as two
    autograd GEMMs (:attr:`Geometry.separate_branch`) also the block ``s·B`` ``[out, k·r]`` (one per
    expert: ``blocks``); in the branch's dtype. ``tokens``: the rows it reads (default the micro-batch's)."""
    rows = g.tokens if tokens is None else tokens
    return (rows + (blocks * out_width if g.separate_branch else 0)) * k * rank * g.branch_item


def _branch_input(g: Geometry, width: int, kept: bool = False, tokens: int | None = None) -> int:
    """The input a trainable branch's A GEMM keeps: the layer's (nothing more when ``kept`` already), or
    its own copy in the branch dtype when that differs from the compute dtype."""
    rows = g.tokens if tokens is None else tokens
    if g.branch_item != g.item:
        return rows * width * g.branch_item
    return 0 if kept else rows * width * g.item


def _experts_saved(g: Geometry, lora: LayerLora, grad: bool) -> tuple[int, bool]:
    """What a mixture-of-experts layer keeps (the module docstring's list), and whether its output requires
    grad; ``grad``: its input (the pre-MLP norm's output) does."""
    x, e, t = g.experts, g.item, g.stream_tokens
    n, ri = x.received(t), _router_item(g)
    total = 0
    k1, k2, r, kr = lora.k("fc1"), lora.k("fc2"), lora.expert_rank or lora.rank, lora.k("router")
    route_grad = grad or kr > 0  # the routing weights require grad through the router's input or its LoRA
    if grad:
        total += t * g.hidden * e  # the gating GEMM's input
    if kr:  # the router's LoRA (lora_delta: two GEMMs): its input, x·Aᵀ [t, r] and s·B [E, r], in the branch dtype
        total += _branch_input(g, g.hidden, kept=grad, tokens=t) + (t + x.num_experts) * lora.rank * g.branch_item
    if route_grad:
        total += _routing_saved(x, t, ri)
        total += t * x.num_experts * (1 + ri)  # the permutation's routing map and probabilities
    if route_grad or k1 or k2:
        total += t * x.top_k * I64  # the sorted indices the experts' outputs are scattered back with
    if k1:  # the received tokens (one storage, split per expert) and x·Aᵀ; one s·B block per local expert
        total += _branch_input(g, g.hidden, tokens=n) + _expert_lora_saved(g, k1, r, g.hidden, 2 * x.ffn, n, grad)
    mlp_grad = grad or k1 > 0
    if mlp_grad:  # [gate; up], silu(gate), (sequential) up + 0, and the routing weight the GLU output is scaled by
        # gpt-oss: [gate; up] + bias (both clamps keep it), the clamped gate, its quick_gelu, up clamped + 1
        total += n * (5 if x.clamped else 4 if g.fp8 else 3) * x.ffn * e + n * ri
    if route_grad:
        total += n * x.ffn * e  # the GLU output itself, for the routing weight's gradient
    if k2:
        total += _branch_input(g, x.ffn, tokens=n) + _expert_lora_saved(g, k2, r, x.ffn, g.hidden, n,
                                                                         mlp_grad or route_grad)
    if (mlp_grad or route_grad or k2) and not (g.fp8 or x.clamped):
        total += x.local * I32  # the grouped GEMMs' offsets
    shared, shared_grad = _shared_expert_saved(g, lora, grad)
    return total + shared, mlp_grad or route_grad or k2 > 0 or shared_grad


def _expert_lora_saved(g: Geometry, k: int, rank: int, in_width: int, out_width: int, tokens: int,
                       input_grad: bool) -> int:
    """An expert LoRA branch's ``x·Aᵀ`` and, computed grouped (not FP8), the block-diagonal ``s·B``
    ``[E, out, k·r]`` of the local experts and, when the input requires grad, their stacked A ``[E, k·r, in]``,
    ranks padded; sequential, one ``s·B`` block per expert where the branch runs as two autograd GEMMs
    (:func:`_lora_saved`)."""
    if g.fp8 or g.experts.clamped:  # computed one expert after another
        return _lora_saved(g, k, rank, out_width, tokens, g.experts.local)
    rows = tokens + g.experts.local * ((in_width if input_grad else 0) + out_width)
    return rows * k * padded_rank(rank, g.branch_item) * g.branch_item


def _router_item(g: Geometry) -> int:
    """Bytes per element of the router's logits and routing weights: float32, or the model's dtype."""
    return F32 if g.experts.router_fp32 else g.item


def _routing_saved(x: Experts, t: int, ri: int) -> int:
    """What megatron's top-k routing of ``t`` tokens keeps (``ri``: bytes per element of the router's logits): the
    top-k indices and the float32 softmax output (over the k or all E logits); or, sigmoid routing, its float32 [t, E]
    scores, the k it picked (indices and scores) and their sum (the renormalisation). The choice itself (the
    correction bias, the group-limited top-k) is a branch of the graph that ends in indices: what it saves is freed
    as soon as the router returns."""
    if not x.sigmoid:  # megatron's softmax runs in float32 whatever the logits' dtype
        return t * x.top_k * I64 + t * (x.top_k if x.topk_softmax else x.num_experts) * F32
    return t * x.num_experts * F32 + t * x.top_k * (I64 + ri) + t * ri


def _shared_expert_saved(g: Geometry, lora: LayerLora, grad: bool) -> tuple[int, bool]:
    """A shared expert (megatron's SharedExpertMLP, Qwen2-MoE, GLM-4.5): a dense MLP of its own width (its LoRA at the
    ``shared_fc1``/``shared_fc2`` sites, in the adapter's rank), then, where it is gated, ``sigmoid(x·gate)`` times
    its output: the sigmoid's result (which the product keeps too) and, for the gate's gradient, the MLP output."""
    ffn, e, t = g.experts.shared_ffn, g.item, g.stream_tokens
    if not ffn:
        return 0, False
    total = 0
    k1, k2 = lora.k("shared_fc1"), lora.k("shared_fc2")
    if k1:
        total += _branch_input(g, g.hidden) + _lora_saved(g, k1, lora.rank, 2 * ffn)
    mlp_grad = grad or k1 > 0
    if mlp_grad:
        total += g.tokens * 4 * ffn * e  # fc1 output [gate; up], silu(gate), up + 0 (megatron's glu)
    if k2:
        total += _branch_input(g, ffn) + _lora_saved(g, k2, lora.rank, g.hidden)
    out_grad = mlp_grad or k2 > 0
    if not g.experts.shared_gate:
        return total, out_grad
    if grad or out_grad:
        total += t * e  # the sigmoid's output
    if grad:
        total += t * g.hidden * e  # the MLP output, for the gate's gradient
    return total, out_grad


def _qk_norm_saved(g: Geometry) -> int:
    """The q/k RMSNorms (float32 math, as :func:`_norm_saved`): float32 copies of their inputs and ``rsqrt``
    per normalised row. q is reshaped out of the fused QKV output, a copy even in float32; per head, k is a
    view of that output, kept already unless upcast; over all heads (OLMoE) k is a copy too."""
    if g.qk_norm is None:
        return 0
    if g.qk_norm == "full":
        return g.tokens * (g.q_width + g.kv_width + 2) * F32
    k_copy = g.kv_width if g.item != F32 else 0
    return g.tokens * (g.q_width + k_copy + g.heads + g.kv_heads) * F32


def _attention_saved(g: Geometry, attention: str, selective: bool) -> tuple[int, bool]:
    """Bytes core attention keeps (RoPE's cos/sin included) and whether its output is among them."""
    rope = 4 * g.seq * (g.rotary_dim or g.head_dim) * g.item  # cos and sin, for q and for k, [s, 1, 1, rotary dims]
    q, k, qkv = g.tokens * g.q_width, g.tokens * g.kv_width, g.tokens * g.qkv_width
    if selective:  # megatron's checkpoint keeps the core attention's inputs: q, k, v (a view of QKV) and
        return rope + (q + k + qkv) * g.item + 4, False  # the mask type as an int32 tensor
    if attention == "sdpa" and g.sinks:
        return rope + _sink_attention_saved(g), False
    if attention == "sdpa":
        lse = g.batch * g.heads * g.seq * F32
        return rope + (q + k + qkv + q) * g.item + lse, True
    gqa = g.heads > g.kv_heads
    keys = q if gqa else k  # K repeated to every query head under GQA
    values = q if gqa else qkv  # V repeated, or a view of the QKV output
    probs = g.scores * (F32 + (g.item if g.item != F32 else 0))  # float32 softmax (+ its dtype copy)
    return rope + (q + keys + values) * g.item + probs, False


def _sink_attention_saved(g: Geometry) -> int:
    """SDPA with the sinks as one key more (:func:`mlora.models.attention._with_sink_key`): its q, k, v and output
    with one row more and the head dim padded past a multiple of 8, its float32 log-sum-exp, and on a windowed layer
    the padded window mask (the unpadded one, ``[1, 1, s, s]``, is shared by every windowed layer and not counted);
    the output it hands on is a copy (sliced off the padding)."""
    rows, dim = g.seq + 1, sink_key_dim(g.head_dim)
    tensors = g.batch * rows * dim * (2 * g.heads + 2 * g.kv_heads)
    mask = rows * rows if g.window is not None and g.window < g.seq else 0
    return (tensors + mask) * g.item + g.batch * g.heads * rows * F32


def layer_saved(g: Geometry, lora: LayerLora, attention: str, input_requires_grad: bool,
                selective: tuple[str, ...] = ()) -> tuple[int, bool]:
    """Bytes autograd keeps for one layer of one micro-batch, and whether the layer output requires grad.

    ``input_requires_grad``: the layer input carries a graph (a trainable LoRA upstream on this
    stage, a stage input from the previous stage, or the embedding output under recompute).
    """
    h, e, total = g.hidden, g.item, 0
    grad = input_requires_grad
    if grad:
        total += _norm_saved(g)
    if g.mla is not None:
        saved, mid_grad = _mla_saved(g, lora, grad)
        total += saved
    else:
        kq = lora.k("qkv")
        if kq:
            total += _branch_input(g, h) + _lora_saved(g, kq, lora.rank, g.qkv_width)
        attn_grad = grad or kq > 0
        out_kept = False
        if attn_grad:
            saved, out_kept = _attention_saved(g, attention, "core_attn" in selective)
            total += saved + _qk_norm_saved(g)
        ko = lora.k("proj")
        if ko:
            total += _branch_input(g, g.q_width, out_kept) + _lora_saved(g, ko, lora.rank, h)
        mid_grad = attn_grad or ko > 0
    if mid_grad:
        total += _norm_saved(g)
    if g.experts is not None:  # megatron's "mlp" recompute checkpoints dense MLPs only
        saved, out_grad = _experts_saved(g, lora, mid_grad)
        return total + saved, out_grad
    if "mlp" in selective:
        # megatron's checkpoint keeps the MLP input (the norm output, sequence-split under SP)
        total += g.stream_tokens * h * e if (mid_grad or lora.k("fc1") or lora.k("fc2")) else 0
        return total, mid_grad or lora.k("fc1") > 0 or lora.k("fc2") > 0
    k1 = lora.k("fc1")
    if k1:
        total += _branch_input(g, h) + _lora_saved(g, k1, lora.rank, 2 * g.ffn)
    mlp_grad = mid_grad or k1 > 0
    if mlp_grad:
        total += g.tokens * 4 * g.ffn * e  # fc1 output [gate; up], silu(gate), up + 0 (megatron's glu)
    k2 = lora.k("fc2")
    if k2:
        total += _branch_input(g, g.ffn) + _lora_saved(g, k2, lora.rank, h)
    return total, mlp_grad or k2 > 0


def _mla_saved(g: Geometry, lora: LayerLora, grad: bool) -> tuple[int, bool]:
    """What multi-latent attention keeps (:mod:`mlora.models.mla`, SDPA's fused kernel), and whether its output
    requires grad; ``grad``: its input (the input norm's output) does. The q and kv down projections read this rank's
    stream tokens; their RMSNorms keep float32 inputs and ``rsqrt``; the up projections read the whole sequence;
    RoPE keeps cos and sin for the side (query, key) that requires grad; SDPA keeps q, k, the values padded to the
    query's head dim, its output (as wide) and the log-sum-exp; o_proj's LoRA reads a copy of the output."""
    m, t, s = g.mla, g.stream_tokens, g.seq
    qk, total = m.qk_head_dim, 0
    kqa, kqb, kq, kkva, kkvb, ko = (lora.k(site) for site in ("q_a", "q_b", "qkv", "kv_a", "kv_b", "proj"))
    if kqa or kkva:  # the down projections' LoRA: the norm output they share (or each its own copy in the branch
        # dtype), and each its x·Aᵀ
        copies = (kqa > 0) + (kkva > 0) if g.branch_item != g.item else 1
        total += copies * _branch_input(g, g.hidden, tokens=t)
        total += sum(_lora_saved(g, k, lora.rank, width, tokens=t)
                     for k, width in ((kqa, m.q_lora_rank or 0), (kkva, m.kv_lora_rank + m.qk_rope_head_dim)) if k)
    q_grad, kv_grad = grad or kqa > 0, grad or kkva > 0
    if m.q_lora_rank is not None:
        if q_grad:
            total += t * (m.q_lora_rank + 1) * F32
        if kqb:
            total += _branch_input(g, m.q_lora_rank) + _lora_saved(g, kqb, lora.rank, g.heads * qk)
        q_grad = q_grad or kqb > 0
    elif kq:
        total += _branch_input(g, g.hidden, kept=grad) + _lora_saved(g, kq, lora.rank, g.heads * qk)
        q_grad = q_grad or kq > 0
    if kv_grad:  # in float32 the norm keeps its input itself: a view of the down projection's whole output
        total += t * (m.kv_lora_rank + (m.qk_rope_head_dim if g.item == F32 else 0) + 1) * F32
    if kkvb:
        total += _branch_input(g, m.kv_lora_rank) + _lora_saved(g, kkvb, lora.rank,
                                                                 g.heads * (m.qk_nope_head_dim + m.v_head_dim))
    k_grad = kv_grad or kkvb > 0
    attn_grad = q_grad or k_grad
    if attn_grad:
        total += 2 * s * m.qk_rope_head_dim * g.item * (q_grad + kv_grad)  # cos and sin per side
        total += 4 * g.tokens * g.heads * qk * g.item + g.batch * g.heads * s * F32
    if ko:
        total += _branch_input(g, g.heads * m.v_head_dim) + _lora_saved(g, ko, lora.rank, g.hidden)
    return total, attn_grad or ko > 0


def mask_bytes(g: Geometry, attention: str) -> int:
    """The ``[b, 1, s, s]`` boolean mask of one micro-batch (unfused attention only; SDPA runs causal)."""
    return g.batch * g.seq * g.seq if attention == "unfused" else 0


def forward_workspace(g: Geometry, attention: str) -> int:
    """Largest set of live temporaries inside one layer of a no-grad forward pass: the residual and
    norm outputs, then the larger of attention (QKV output, q and k after RoPE and their RoPE
    temporaries, output; unfused: scores, masked scores, softmax) and the MLP (fc1 output, silu,
    up + 0, product; in a MoE layer the router's and the dispatcher's buffers and one expert's MLP)."""
    e = g.item
    stream = 2 * g.stream_tokens * g.hidden * e + g.tokens * g.hidden * e
    attn = g.tokens * (g.qkv_width + 3 * g.q_width + 2 * g.kv_width) * e
    if g.mla is not None:
        attn = _mla_workspace(g)
    elif attention == "unfused":
        attn += g.scores * (e + 2 * F32)
    elif g.sinks:  # SDPA's extended q, k, v, output and mask (an account, not measured)
        attn += _sink_attention_saved(g)
    mlp = g.tokens * 5 * g.ffn * e
    if g.experts is not None:
        x, t = g.experts, g.stream_tokens
        mlp = (t * x.num_experts * (2 * _router_item(g) + 1)  # router logits and probabilities, the routing map
               + t * x.top_k * g.hidden * e  # the permuted copies sent, alive until the layer returns
               + 3 * x.received(t) * g.hidden * e  # received (sorted by expert), the outputs, their concatenation
               + _mlp_copies(g, t) * x.ffn * (5 * e + F32))  # the experts' MLP, its float32 product with the weight
    return stream + max(attn, mlp)


def _mla_workspace(g: Geometry) -> int:
    """Multi-latent attention's live temporaries (not measured yet, an account of the forward): the down projections'
    outputs and their norms (this rank's stream tokens, float32 norms), the whole sequence's latents, q and kv, the
    query and key with RoPE, the padded values, SDPA's padded output and the output's copy."""
    m, e = g.mla, g.item
    qk = m.qk_head_dim
    down = (m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim
    return (g.stream_tokens * down * (e + F32) + g.tokens * down * e
            + g.tokens * g.heads * (5 * qk + m.qk_nope_head_dim + 2 * m.v_head_dim) * e)


def _mlp_copies(g: Geometry, tokens: int) -> int:
    """The token copies whose expert MLP terms are alive at once: every received one when the experts run grouped,
    one expert's share on the sequential path (FP8 weights, gpt-oss's biased experts)."""
    return g.experts.per_expert(tokens) if g.fp8 or g.experts.clamped else g.experts.received(tokens)


def backward_workspace(g: Geometry, attention: str) -> int:
    """Largest set of gradients in flight inside one layer's backward, beyond what is kept: the
    incoming gradient of the residual stream, then the larger of the MLP's (two ``[tokens, ffn]``:
    the gradients of silu(gate) and of up, or of the product's base and LoRA paths) and attention's
    (the output's, q's, k's and v's gradients and the QKV gradient they are gathered into; unfused:
    the softmax gradient and the score gradient, float32, while the softmax output is still kept).
    An FP8 linear's input gradient multiplies by a dtype copy of its weight (:class:`mlora.fp8.quant._FP8Linear`):
    the largest one, fc1's, and its row-scaled output gradient are added. A MoE layer's MLP gradients are the
    router's, the dispatched copies' (both sides of the all-to-all) and one expert's at a time."""
    e = g.item
    mlp = g.tokens * 2 * g.ffn * e
    if g.fp8:
        mlp += 2 * g.ffn * g.hidden * e + g.tokens * 2 * g.ffn * e
    if g.experts is not None:
        x, t = g.experts, g.stream_tokens
        mlp = (t * x.num_experts * 2 * _router_item(g)  # gradients of the router's probabilities and logits
               + t * x.top_k * g.hidden * e  # the gradient of the copies sent, on this side of the all-to-all
               + 3 * x.received(t) * g.hidden * e  # of the received copies: outputs', inputs', their concatenation
               + _mlp_copies(g, t) * x.ffn * (2 * e + F32))  # the experts': silu(gate), up, the float32 product
    attn = g.tokens * (g.q_width + g.qkv_width) * e
    if g.mla is not None:  # the gradients of SDPA's padded output, q, k and padded v, then of q and kv (not measured)
        m = g.mla
        qk = m.qk_head_dim
        attn = g.tokens * g.heads * (5 * qk + m.qk_nope_head_dim + m.v_head_dim) * e
    elif attention == "unfused":
        attn += g.scores * (e + F32 + (F32 if e != F32 else 0))
    elif g.sinks:  # the gradients of SDPA's extended q, k, v (an account, not measured)
        rows, dim = g.seq + 1, sink_key_dim(g.head_dim)
        attn += g.batch * rows * dim * (g.heads + 2 * g.kv_heads) * e
    return g.stream_tokens * g.hidden * e + max(mlp, attn)
