"""LoRA-capable column- and row-parallel linears for megatron-core's layer spec.

Column-parallel base (``linear_qkv``, ``linear_fc1``; W split on the output dim): A replicated
``[r, in]``, B split on the output dim exactly like W, ``y_i = x W_iᵀ + s·(x Aᵀ) B_iᵀ``. Both
branches read the input after the layer's one copy / sequence-parallel all-gather, so autograd
sums their input-gradients before the single backward all-reduce / reduce-scatter.

Row-parallel base (``linear_proj``, ``linear_fc2``; W split on the input dim): A split on the
input dim ``[r, in/TP]``, B replicated; the LoRA partial is added before the layer's own
all-reduce / reduce-scatter, so one collective carries both.

Fused layers hold one adapter per HF projection (q, k, v; gate, up): their A factors are
stacked into one GEMM; each projection's B GEMM accumulates (beta 1) into its own columns of the
frozen base GEMM's output, per query group where q/k/v interleave (:class:`_LoraLinear`, whose
hand-written backward never computes a weight gradient for the frozen base). The FP8 and
Transformer Engine linears add one block-structured B GEMM's output instead (:func:`lora_delta`).

LoRA dropout follows PEFT: each projection has its own mask on its own copy of the input, so with
dropout active (training mode, p > 0) a fused layer does one A GEMM per projection; otherwise the
stacked GEMM. Masks do not depend on the TP/PP layout: each is drawn for the full, unsharded
input from a generator keyed by (seed, adapter, layer, projection, DP rank, forward call), so the
column-parallel ranks (replicated input) draw the same mask and a row-parallel rank keeps its
slice of the full-input mask. See :class:`DropoutKey`.

An adapter may be routed to some rows of a micro-batch (:mod:`mlora.lora.routing`): the base GEMM
still runs once over every token, the branch's GEMMs over its rows' tokens only, and with dropout its
masks are drawn for those tokens (gathered in route order).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from torch.autograd.function import once_differentiable

from mlora.lora.config import derive_seed
from mlora.lora.routing import (
    EXPERT_TOKENS,
    ROUTES,
    Route,
    expert_route,
    local_route,
    route_index,
    route_parts,
    sequence_slice,
)

# Elements of a full-width dropout mask drawn per generator (64 MiB of float32 scratch). A function
# of the full input width only, so every mesh splits the draws into the same chunks.
MASK_CHUNK = 1 << 24


@dataclass(frozen=True)
class LoraSite:
    """Geometry of one parallel linear as LoRA sees it.

    The local output is viewed as ``[..., groups, block]``; projection ``subs[k]`` owns the
    columns ``placement[k] = (offset, size)`` of each block (q/k/v query-group interleaving,
    the per-rank ``[gate; up]`` split).
    """

    layer: int
    # "column", "row", "router" (a MoE router: replicated, reading its SP slice of the tokens) or "duplicated" (a
    # replicated linear reading its SP slice: multi-latent attention's down projections)
    parallel: str
    subs: tuple[str, ...]
    in_local: int
    in_full: int
    out_full: tuple[int, ...]  # HF output size of each sub
    groups: int = 1
    block: int = 0
    placement: tuple[tuple[int, int], ...] = ()
    expert: int | None = None  # a MoE expert's linear (global index): whole on its EP rank, never TP-split


# Attributes on parameters that every TP rank holds whole:
TP_REPLICATED = "_mlora_tp_replicated"  # same value on every TP rank: counted once in norms
TP_PARTIAL_GRAD = "_mlora_tp_partial_grad"  # and its gradient is partial per TP rank: summed over TP
# A factor of an expert's adapter: held by the ranks of its expert-data-parallel group, each of which routed
# other tokens through the expert, so its gradient is summed over that group (not over TP or DP).
EXPERT = "_mlora_expert"


def mark_tp_replicated(param: torch.nn.Parameter, partial_grad: bool = True) -> torch.nn.Parameter:
    """Flag a parameter held whole by every TP rank.

    ``partial_grad``: each rank's gradient is only its share (LoRA factors meeting a sharded
    input or output), so gradients are summed over TP. A head on TP-replicated hidden states
    gets the full gradient on every rank instead (``partial_grad=False``).
    """
    setattr(param, TP_REPLICATED, True)
    setattr(param, TP_PARTIAL_GRAD, partial_grad)
    return param


def is_tp_replicated(param: torch.Tensor) -> bool:
    return getattr(param, TP_REPLICATED, False)


def has_tp_partial_grad(param: torch.Tensor) -> bool:
    return getattr(param, TP_PARTIAL_GRAD, False)


def is_expert_param(param: torch.Tensor) -> bool:
    return getattr(param, EXPERT, False)


@dataclass(frozen=True)
class DropoutKey:
    """Where a branch's dropout masks come from and which part of them this rank applies.

    The mask of projection ``sub`` at forward call ``call`` is drawn over the full input width
    ``in_full`` in row chunks of ``MASK_CHUNK // in_full`` tokens, chunk ``c`` from a generator
    seeded by ``derive_seed(seed, adapter, layer, sub, "dropout", stream, call, c)``; this rank
    applies features ``[in_offset, in_offset + local width)`` of it (the whole mask on a
    column-parallel layer, whose input is replicated over TP; its TP slice on a row-parallel one).
    ``stream`` is the DP rank: replicas that see different data must not share masks. DP ranks
    therefore draw different masks than a DP=1 run would for the same samples; only TP and PP
    leave the masks unchanged.
    """

    seed: int = 0
    adapter: str = ""
    layer: int = 0
    stream: int = 0
    in_full: int = 0
    in_offset: int = 0


def dropout_mask(key: DropoutKey, sub: str, call: int, p: float, x: torch.Tensor) -> torch.Tensor:
    """The multiplier ``keep / (1 - p)`` (dtype and shape of ``x``) for projection ``sub``."""
    width = x.shape[-1]
    if key.in_offset + width > key.in_full:
        raise ValueError(f"LoRA dropout: input features [{key.in_offset}, {key.in_offset + width}) do not fit "
                         f"in the full input width {key.in_full}")
    rows = x.numel() // width
    chunk = max(1, MASK_CHUNK // key.in_full)
    keep = torch.empty(rows, width, dtype=torch.bool, device=x.device)
    for c, start in enumerate(range(0, rows, chunk)):
        n = min(chunk, rows - start)
        g = torch.Generator(device=x.device).manual_seed(
            derive_seed(key.seed, key.adapter, key.layer, sub, "dropout", key.stream, call, c))
        full = torch.rand(n, key.in_full, generator=g, device=x.device)
        keep[start:start + n] = full[:, key.in_offset:key.in_offset + width] >= p
    return (keep.to(x.dtype) * (1.0 / (1.0 - p))).view(x.shape)


# The dropout call counter of every LoRA branch ever built (one slot each, see LoraBranch.dropout_calls).
# One flat list so that an activation checkpoint saves and restores all of them with one copy, the way it
# saves megatron's RNG states.
DROPOUT_CALLS: list[int] = []


class LoraBranch(torch.nn.Module):
    """One adapter on one parallel linear: stacked A ``[n·r, in_local]`` and one B per projection.

    Column-parallel sites replicate A, row-parallel sites replicate B (marked TP-replicated); an expert's
    factors are whole on their EP rank and marked as expert parameters instead (``parallel="expert"``).
    ``dropout_key`` keys the dropout masks and places this rank's input in the full input
    (default: seed 0, no adapter name, layer 0, the input whole).
    """

    def __init__(self, subs: tuple[str, ...], rank: int, scaling: float, dropout: float,
                 lora_a: torch.Tensor, lora_b: list[torch.Tensor], trainable: bool, parallel: str = "column",
                 dropout_key: DropoutKey | None = None, compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.subs, self.rank, self.scaling = subs, rank, scaling
        # The factors are the float32 masters under a 16-bit base; the branch computes in compute_dtype
        # (None: the input's dtype): float32 reads a bf16 input upcast, as PEFT does; bfloat16 casts the
        # masters down per forward, and their gradients come back float32 through the cast.
        self.compute_dtype = compute_dtype
        self.dropout_p = float(dropout)
        self.dropout_key = dropout_key or DropoutKey(in_full=lora_a.shape[1])
        self._calls_slot = len(DROPOUT_CALLS)  # this branch's counter in DROPOUT_CALLS
        DROPOUT_CALLS.append(0)
        self.lora_A = torch.nn.Parameter(lora_a, requires_grad=trainable)
        self.lora_B = torch.nn.ParameterList([torch.nn.Parameter(b, requires_grad=trainable) for b in lora_b])
        if parallel == "expert":
            for p in self.parameters():
                setattr(p, EXPERT, True)
        else:
            replicated = {"column": [self.lora_A], "row": list(self.lora_B)}.get(parallel, list(self.parameters()))
            for p in replicated:
                mark_tp_replicated(p)

    @property
    def dropout_calls(self) -> int:
        """Forward calls that drew masks: advances once per forward in training mode with p > 0 and
        keys the masks of the next call. An activation recompute replays a forward, so it must draw
        the masks of the call index that forward ran with: the counter lives in
        :data:`DROPOUT_CALLS`, which recompute saves and restores with megatron's RNG states
        (:func:`mlora.models.recompute.install_dropout_replay`)."""
        return DROPOUT_CALLS[self._calls_slot]

    @dropout_calls.setter
    def dropout_calls(self, value: int) -> None:
        DROPOUT_CALLS[self._calls_slot] = value

    def factors_in(self, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A and the B factors in ``dtype`` (the parameters themselves when they already are; otherwise
        differentiable casts, so gradients reach the masters in their own dtype)."""
        a = self.lora_A if self.lora_A.dtype == dtype else self.lora_A.to(dtype)
        return a, [b if b.dtype == dtype else b.to(dtype) for b in self.lora_B]

    def a_of(self, k: int, grad: bool = False) -> torch.Tensor:
        """Projection ``k``'s A (or its gradient): rows ``k·r:(k+1)·r`` of the stacked A."""
        a = self.lora_A.grad if grad else self.lora_A
        return a[k * self.rank:(k + 1) * self.rank]

    @property
    def dropout_active(self) -> bool:
        """Whether dropout applies now (training mode and p > 0)."""
        return self.training and self.dropout_p > 0

    def dropout_masks(self, x: torch.Tensor, call: int) -> list[torch.Tensor]:
        """Each projection's dropout multiplier for input ``x`` at forward call ``call``."""
        return [dropout_mask(self.dropout_key, sub, call, self.dropout_p, x) for sub in self.subs]

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """``x Aₖᵀ`` of every projection, concatenated ``[..., n·r]``.

        Without dropout one stacked GEMM; with it each projection reads its own masked input
        (PEFT's per-module ``lora_dropout``), one GEMM each.
        """
        a = self.factors_in(x.dtype)[0]
        if not self.dropout_active:
            return F.linear(x, a)
        call, self.dropout_calls = self.dropout_calls, self.dropout_calls + 1
        masks = self.dropout_masks(x, call)
        r = self.rank
        return torch.cat([F.linear(x * m, a[k * r:(k + 1) * r]) for k, m in enumerate(masks)], dim=-1)


def stacked_b(branch: LoraBranch, site: LoraSite) -> torch.Tensor:
    """``s·B`` in the layer's output layout, so that ``(x Aᵀ) @ stacked_bᵀ`` is the LoRA delta and
    ``stacked_b @ A`` the weight delta.

    A row-parallel layer has one projection: ``s·B``. A fused column-parallel layer gets one
    block-structured ``[out_local, n·r]`` matrix: the rows of projection k (placed as in the
    fused output) hold ``s·B_k`` in columns ``k·r:(k+1)·r`` and zeros elsewhere, so one GEMM
    writes every projection's delta straight into the fused layout. Built per call from the
    canonical factors (small).
    """
    return _block_b(list(branch.lora_B), branch.scaling, branch.subs, site)


def _block_b(bs, scaling: float, subs: tuple[str, ...], site: LoraSite) -> torch.Tensor:
    """:func:`stacked_b` from the B factors ``bs`` of projections ``subs``."""
    if site.parallel != "column":
        return bs[0] * scaling
    r, n = bs[0].shape[1], len(subs)
    pieces = []
    for sub, (_, size) in zip(site.subs, site.placement):
        if sub in subs:
            k = subs.index(sub)
            pieces.append(F.pad((bs[k] * scaling).view(site.groups, size, r), (k * r, (n - 1 - k) * r)))
        else:
            pieces.append(bs[0].new_zeros(site.groups, size, n * r))
    return torch.cat(pieces, dim=1).reshape(site.groups * site.block, n * r)


def lora_delta(branch: LoraBranch, x: torch.Tensor, site: LoraSite) -> torch.Tensor:
    """The branch's contribution to the layer's local output: the A GEMM(s), one B GEMM, in the branch's
    compute dtype (the caller casts it to the output's). ``x`` is the column-parallel layer's gathered
    input, or the row-parallel layer's slice of the features (the partial then joins the layer's
    reduction)."""
    dtype = branch.compute_dtype or x.dtype
    bs = branch.factors_in(dtype)[1]
    return F.linear(branch.hidden(x.to(dtype)), _block_b(bs, branch.scaling, branch.subs, site))


def column_input(input_: torch.Tensor, sequence_parallel: bool, group) -> torch.Tensor:
    """A column-parallel layer's one input collective: the sequence-parallel all-gather, or the
    identity whose backward all-reduces; base GEMM and LoRA branches both read its result."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(input_, group=group)
    return copy_to_tensor_model_parallel_region(input_, group=group)


def row_output(out: torch.Tensor, sequence_parallel: bool, group) -> torch.Tensor:
    """A row-parallel layer's one reduction of base + LoRA partials: reduce-scatter (SP) or all-reduce."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(out, group=group)
    return reduce_from_tensor_model_parallel_region(out, group=group)


@functools.lru_cache(maxsize=None)
def _placements(site: LoraSite, subs: tuple[str, ...], out_local: int) -> tuple[tuple[int, int, int], ...]:
    """``(k, offset, size)`` of each projection of a branch with ``subs``: in every one of the
    site's ``groups`` output blocks, projection k owns columns ``offset:offset+size``."""
    if site.parallel != "column":
        return ((0, 0, out_local),)
    return tuple((subs.index(sub), offset, size) for sub, (offset, size) in zip(site.subs, site.placement)
                 if sub in subs)


def _add_b(parts, bs, subs: tuple[str, ...], r: int, scaling: float, site: LoraSite, groups: int) -> None:
    """``out += s·h Bₖᵀ`` into each projection's columns, for every ``(out, h)`` of ``parts`` (the whole
    output, or a routed branch's token slices of it with their hidden rows), accumulating (beta 1)."""
    block = _block_b(bs, scaling, subs, site).t() if groups > 1 else None
    for out, h in parts:
        if block is not None:
            out.addmm_(h, block)
        else:
            for k, offset, size in _placements(site, subs, out.shape[-1]):
                out[:, offset:offset + size].addmm_(h[:, k * r:(k + 1) * r], bs[k].t(), alpha=scaling)


def _b_grads(site: LoraSite, groups: int, g: torch.Tensor, h: torch.Tensor, bs, subs: tuple[str, ...], r: int,
             scaling: float, need_h: bool, need_bs) -> tuple[torch.Tensor | None, list]:
    """The hidden's gradient ``[tokens, n·r]`` (if ``need_h``) and each B's (if asked) from the output
    gradient ``g`` of the tokens of ``h`` (a 2-D view with unit column stride: the whole gradient or a
    routed branch's token slice of it), both scaled by ``s``."""
    n, tokens = len(subs), g.shape[0]
    g3 = g.view(tokens, groups, -1) if groups > 1 else None  # (an expert may get no token: no view of 0 rows)
    grad_h = [None] * n
    grad_bs = [None] * n
    for k, offset, size in _placements(site, subs, g.shape[-1]):
        h_k = h[:, k * r:(k + 1) * r]
        if groups == 1:
            g_k = g[:, offset:offset + size]
            grad_h[k] = torch.mm(g_k, bs[k]) if need_h else None
            grad_bs[k] = torch.mm(g_k.t(), h_k) if need_bs[k] else None
        else:  # [groups, tokens, size]: a batch of strided blocks, no copy
            g_k = g3[:, :, offset:offset + size].transpose(0, 1)
            grad_h[k] = torch.bmm(g_k, bs[k].view(groups, size, r)).sum(0) if need_h else None
            grad_bs[k] = (torch.bmm(g_k.transpose(1, 2), h_k.expand(groups, tokens, r)).view(bs[k].shape)
                          if need_bs[k] else None)
        if grad_bs[k] is not None:
            grad_bs[k].mul_(scaling)
    gh = None
    if need_h:
        # a projection the branch does not place (no such sub on this site) gets zeros
        gh = torch.cat([t if t is not None else h.new_zeros(tokens, r) for t in grad_h], dim=1).mul_(scaling)
    return gh, grad_bs


class _LoraLinear(torch.autograd.Function):
    """``x Wᵀ + bias + Σ s·(x Aᵀ) Bᵀ`` over a layer's active branches, with a hand-written backward.

    On CPU, LoRA's cost next to the frozen GEMM is not its FLOPs (~2%) but fresh output-sized
    buffers (the first-touch page faults of a new 100 MB tensor cost more than a GEMM pass over
    it), the zeros of a block-structured B (n× the FLOPs of the q/k/v and gate/up B GEMMs) and, on
    a loaded machine, each extra GEMM call (a parallel region whose threads must all get a core).
    So the base GEMM allocates the only output-sized buffer and the B GEMMs accumulate into it
    (beta 1); the backward reads each projection's columns of the incoming gradient in place with
    one GEMM (batched over query groups) each for the hidden's and B's gradients, and the LoRA
    input gradient accumulates into the base's (beta 1) instead of autograd adding two new ones.
    Only the forward q/k/v B GEMM over several interleaved query groups stays block-structured:
    per projection it would be one GEMM per group, and on a loaded machine zeros cost less than calls.

    A routed branch (:mod:`mlora.lora.routing`) does the same on each slice of its route: strided 2-D
    views of the flattened input, output and gradients (``x2[seg]``, ``out[seg]``), no copies; its hidden
    holds the route's tokens only, gathered in order.

    ``specs``: per branch ``(hidden_given, subs, r, scaling, route)`` (``route`` None: every token);
    ``factors``: per branch A (or, with ``hidden_given``, the hidden ``x Aᵀ`` that autograd computed from
    dropout-masked inputs, of the route's tokens), then its B factors.
    """

    @staticmethod
    def forward(ctx, site, specs, x, weight, bias, *factors):
        x2 = x.reshape(-1, x.shape[-1])
        out = torch.mm(x2, weight.t()) if bias is None else torch.addmm(bias, x2, weight.t())
        groups = site.groups if site.parallel == "column" else 1
        hiddens, i = [], 0
        for hidden_given, subs, r, scaling, route in specs:
            n = len(subs)
            first, bs = factors[i], factors[i + 1:i + 1 + n]
            i += 1 + n
            if route is None:
                h = first.reshape(-1, n * r) if hidden_given else torch.mm(x2, first.t())
                _add_b(((out, h),), bs, subs, r, scaling, site, groups)
            else:
                parts = route_parts(route, x2.shape[0])
                if hidden_given:
                    h = first.reshape(-1, n * r)
                else:
                    h = x2.new_empty(parts[-1][2], n * r)
                    for seg, start, stop in parts:
                        torch.mm(x2[seg], first.t(), out=h[start:stop])
                _add_b([(out[seg], h[start:stop]) for seg, start, stop in parts], bs, subs, r, scaling, site, groups)
            hiddens.append(h)
        ctx.site, ctx.specs, ctx.x_shape = site, specs, x.shape
        keep_x = weight.requires_grad or not all(spec[0] for spec in specs)
        ctx.save_for_backward(x2 if keep_x else None, weight, *hiddens, *factors)
        # not a view where none is needed: an expert's output (2-D) gets its bias added in place (megatron's MLP)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x2, weight, *saved = ctx.saved_tensors
        site, specs, need = ctx.site, ctx.specs, ctx.needs_input_grad
        hiddens, factors = saved[:len(specs)], saved[len(specs):]
        g = grad.reshape(-1, grad.shape[-1])
        if not g.is_contiguous():  # e.g. expanded from a sum: the GEMMs below read column blocks of it
            g = g.contiguous()
        grad_x = torch.mm(g, weight) if need[2] else None
        grad_w = torch.mm(g.t(), x2) if need[3] else None
        grad_bias = g.sum(0) if need[4] else None
        groups = site.groups if site.parallel == "column" else 1
        grads, i = [], 0
        for (hidden_given, subs, r, scaling, route), h in zip(specs, hiddens):
            n = len(subs)
            first, bs = factors[i], factors[i + 1:i + 1 + n]
            need_first, need_bs = need[5 + i], need[6 + i:6 + i + n]
            i += 1 + n
            need_h = need_first or (grad_x is not None and not hidden_given)
            if route is not None:
                grads += _routed_grads(site, groups, g, x2, h, first, bs, (hidden_given, subs, r, scaling, route),
                                       need_first, need_bs, need_h, grad_x)
                continue
            gh, grad_bs = _b_grads(site, groups, g, h, bs, subs, r, scaling, need_h, need_bs)
            if hidden_given:
                grads.append(gh.view(first.shape) if need_first else None)
            else:
                grads.append(torch.mm(gh.t(), x2) if need_first else None)
                if grad_x is not None:
                    grad_x.addmm_(gh, first)
            grads += [torch.zeros_like(b) if nb and gb is None else gb for b, gb, nb in zip(bs, grad_bs, need_bs)]
        return (None, None, None if grad_x is None else grad_x.view(ctx.x_shape), grad_w, grad_bias, *grads)


def _routed_grads(site, groups, g, x2, h, first, bs, spec, need_first, need_bs, need_h, grad_x) -> list:
    """A routed branch's part of :meth:`_LoraLinear.backward`: per slice of its route, the gradients from
    that slice of ``g``; B's and A's summed over the slices, the hidden's gathered in order, the input's
    accumulated into ``grad_x`` (beta 1). Returns the gradients of the branch's ``first`` and B factors."""
    hidden_given, subs, r, scaling, route = spec
    grad_first, grad_bs, ghs = None, [None] * len(subs), []
    for seg, start, stop in route_parts(route, g.shape[0]):
        gh, part_bs = _b_grads(site, groups, g[seg], h[start:stop], bs, subs, r, scaling, need_h, need_bs)
        grad_bs = [p if acc is None else acc.add_(p) for acc, p in zip(grad_bs, part_bs)]
        if hidden_given:
            ghs.append(gh)
            continue
        if need_first:
            grad_first = torch.mm(gh.t(), x2[seg]) if grad_first is None else grad_first.addmm_(gh.t(), x2[seg])
        if grad_x is not None:
            grad_x[seg].addmm_(gh, first)
    if hidden_given and need_first:
        grad_first = torch.cat(ghs).view(first.shape)
    return [grad_first, *(torch.zeros_like(b) if nb and gb is None else gb
                          for b, gb, nb in zip(bs, grad_bs, need_bs))]


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, branches: list[LoraBranch],
                site: LoraSite | None, weight_scale: torch.Tensor | None = None, fp8_group=None,
                routes: Sequence[Route | None] | None = None) -> torch.Tensor:
    """``x Wᵀ + bias`` plus every branch's delta on this rank's local output (see :class:`_LoraLinear`).

    An FP8 weight (``weight_scale`` given: float32 per output row) multiplies through
    :func:`mlora.fp8.fp8_linear` (input quantized per token, ``torch._scaled_mm``; its input
    gradient uses the dequantized weight); the deltas are computed from the unquantized ``x``.
    ``fp8_group``: a row-parallel input's TP group, over which the per-token scale is all-reduced.
    ``routes``: per branch, the tokens of the flattened ``x`` it applies to (:mod:`mlora.lora.routing`: a
    route of slices, or an expert's int64 token indices; None, or None for a branch: every token)."""
    if weight_scale is not None:
        return _fp8_base_plus(x, weight, weight_scale, bias, branch_deltas(branches, x, site, routes), fp8_group)
    if not branches:
        return F.linear(x, weight, bias)
    if any(b.compute_dtype not in (None, x.dtype) for b in branches) or any(
            isinstance(r, torch.Tensor) for r in routes or ()):
        # a branch in another dtype than the base (float32 on bf16, PEFT's mixed precision) cannot
        # accumulate into the base GEMM's buffer: its delta is added in the output's dtype instead; nor can
        # an expert's branch routed to scattered token indices (the index path gathers and scatters them)
        return add_deltas(F.linear(x, weight, bias), branch_deltas(branches, x, site, routes))
    specs, factors = [], []
    for branch, route in zip(branches, routes or itertools.repeat(None)):
        # with dropout each projection reads its own masked input: LoraBranch.hidden draws the masks
        given = branch.dropout_active
        specs.append((given, branch.subs, branch.rank, branch.scaling, route))
        a, bs = branch.factors_in(x.dtype)
        if given:  # a routed branch draws masks for its own tokens only, gathered in route order
            a = branch.hidden(x if route is None else _route_input(x, route))
        factors += [a, *bs]
    return _LoraLinear.apply(site, tuple(specs), x, weight, bias, *factors)


def _route_input(x: torch.Tensor, route: Route) -> torch.Tensor:
    """The tokens of ``route`` from ``x`` (``[..., in]``), gathered in order into ``[tokens, in]``
    (differentiable: one index_select, whose backward is one index_add)."""
    x2 = x.reshape(-1, x.shape[-1])
    index = route if isinstance(route, torch.Tensor) else route_index(route, x2.shape[0], x2.device)
    return x2.index_select(0, index)


def branch_deltas(branches: list[LoraBranch], x: torch.Tensor, site: LoraSite | None,
                  routes: Sequence[Route | None] | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Every branch's :func:`lora_delta` with the flattened token indices it belongs to (None: every token;
    see :func:`add_deltas`). The input is cast once per compute dtype: the unrouted branches of a layer
    (actor and critic, K experiments) then save one float32 copy of a bf16 input between them, which is
    what ``mlora plan --memory`` counts; a routed branch gathers its tokens (``routes``, see
    :func:`lora_linear`) and casts those."""
    cast: dict[torch.dtype, torch.Tensor] = {}
    out = []
    for branch, route in zip(branches, routes or itertools.repeat(None)):
        dtype = branch.compute_dtype or x.dtype
        if route is not None:
            index = route if isinstance(route, torch.Tensor) else route_index(route, x.numel() // x.shape[-1],
                                                                              x.device)
            out.append((lora_delta(branch, _route_input(x, route).to(dtype), site), index))
            continue
        if dtype not in cast:
            cast[dtype] = x.to(dtype)
        out.append((lora_delta(branch, cast[dtype], site), None))
    return out


def add_deltas(out: torch.Tensor, deltas: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """``out`` plus each delta of :func:`branch_deltas` in ``out``'s dtype: on every token, or into the rows
    ``index`` of the flattened output (``index_add`` through autograd: a routed delta is never computed for,
    nor masked off, the other tokens)."""
    for delta, index in deltas:
        if index is None:
            out = out + delta.to(out.dtype)
        else:
            out = out.reshape(-1, out.shape[-1]).index_add(0, index, delta.to(out.dtype)).view(out.shape)
    return out


def _fp8_base_plus(x, weight, weight_scale, bias, deltas, group=None):
    from mlora.fp8.quant import fp8_linear

    out = add_deltas(fp8_linear(x, weight, weight_scale, group), deltas)
    return out if bias is None else out + bias


FP8_CONFIG_ATTR = "mlora_fp8"  # on megatron's TransformerConfig: the fp8 backend of the frozen linears


@contextlib.contextmanager
def _weight_allocation(config):
    """With ``fp8="torch"`` on the config, megatron allocates the linear's weight (and bias, fixed
    up in :meth:`LoraHost._init_fp8`) directly in float8_e4m3fn: no dtype copy of the stage exists."""
    if getattr(config, FP8_CONFIG_ATTR, None) != "torch":
        yield
        return
    from mlora.fp8.quant import FP8_DTYPE

    saved = config.params_dtype
    config.params_dtype = FP8_DTYPE
    try:
        yield
    finally:
        config.params_dtype = saved


class LoraHost:
    """Adapter registry shared by both linears (PEFT's ``LoraLayer`` idea on a parallel linear)."""

    def _init_fp8(self, config) -> None:
        """``weight_scale``: None, or with an FP8 weight (``fp8="torch"``) a float32 buffer per output
        row (filled by the loader); the bias then goes back to the compute dtype."""
        if getattr(config, FP8_CONFIG_ATTR, None) != "torch":
            self.weight_scale = None
            return
        if self.bias is not None:
            self.bias.data = torch.empty(self.bias.shape, dtype=config.params_dtype, device=self.bias.device)
        self.register_buffer("weight_scale", torch.ones(self.weight.shape[0], dtype=torch.float32,
                                                         device=self.weight.device), persistent=False)

    def _init_lora(self) -> None:
        self.lora = torch.nn.ModuleDict()
        self.active_adapters: tuple[str, ...] = ()
        self.lora_site: LoraSite | None = None

    def _branches(self):
        for name in self.active_adapters:
            branch = self.lora[name] if name in self.lora else None
            if branch is not None:
                yield branch

    def _routed_branches(self) -> tuple[list[LoraBranch], list[Route | None] | None]:
        """The active branches and, while routes are set (:data:`mlora.lora.routing.ROUTES`), each one's
        route (None: every token); a branch routed to no token is left out. Without routes: ``(branches,
        None)``, the unrouted path."""
        expert = self.lora_site.expert if self.lora_site is not None else None
        if expert is not None and EXPERT_TOKENS:
            return self._expert_routed_branches(expert)
        if not ROUTES:
            return list(self._branches()), None
        if expert is not None and any(self._branches()):
            # the dispatcher permutes tokens and sends them to other EP ranks: row routes no longer index them
            raise NotImplementedError(
                f"mixed-adapter micro-batches route adapters by rows, but adapters {sorted(ROUTES)} reach the "
                f"experts of MoE layer {self.lora_site.layer}, whose MoE layer does not carry the routes through its "
                "dispatcher (mlora.models.moe_routes.AdapterRoutedMoELayer does)")
        branches, routes = [], []
        for name in self.active_adapters:
            route = ROUTES.get(name)
            if name in self.lora and route != ():
                branches.append(self.lora[name])
                routes.append(route)
        return branches, routes

    def _slice_routed_branches(self, x: torch.Tensor) -> tuple[list[LoraBranch], list | None]:
        """The active branches of a replicated linear that reads its TP rank's slice of the sequence under SP (a MoE
        router, multi-latent attention's down projections), each with the tokens of this rank's input it applies to
        while routes are set (:mod:`mlora.lora.routing`: routes index the whole sequence)."""
        if not ROUTES:
            return list(self._branches()), None
        local = x.numel() // x.shape[-1]
        tokens, lo = sequence_slice(local, self.tp_group, self.config.sequence_parallel)
        branches, routes = [], []
        for name in self.active_adapters:
            if name not in self.lora:
                continue
            route = local_route(name, tokens, lo, lo + local, x.device)
            if route != ():
                branches.append(self.lora[name])
                routes.append(route)
        return branches, routes

    def _expert_routed_branches(self, expert: int) -> tuple[list[LoraBranch], list | None]:
        """An expert linear's active branches with the token indices of its input each applies to
        (:func:`mlora.lora.routing.expert_route`); ``(branches, None)`` when every branch takes every token."""
        branches, routes = [], []
        for branch, name in ((self.lora[n], n) for n in self.active_adapters if n in self.lora):
            route = expert_route(name, expert)
            if not isinstance(route, tuple):  # () routes the branch to none of this expert's tokens
                branches.append(branch)
                routes.append(route)
        return branches, (routes if any(r is not None for r in routes) else None)


class LoraColumnParallelLinear(LoraHost, tensor_parallel.ColumnParallelLinear):
    """megatron's ColumnParallelLinear with LoRA branches inside its single TP collective."""

    def __init__(self, *args, **kwargs) -> None:
        with _weight_allocation(kwargs.get("config")):
            super().__init__(*args, **kwargs)
        self._init_lora()
        self._init_fp8(kwargs.get("config"))

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None):
        weight = self.weight if weight is None else weight
        # an expert's input comes from the MoE token dispatcher, which did the collectives (megatron's rule)
        x = input_ if self.explicit_expert_comm else column_input(input_, self.sequence_parallel, self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        branches, routes = self._routed_branches()
        out = lora_linear(x, weight, bias, branches, self.lora_site,
                          self.weight_scale if weight is self.weight else None, routes=routes)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)


class LoraRowParallelLinear(LoraHost, tensor_parallel.RowParallelLinear):
    """megatron's RowParallelLinear with the LoRA partial added before its one reduction."""

    def __init__(self, *args, **kwargs) -> None:
        with _weight_allocation(kwargs.get("config")):
            super().__init__(*args, **kwargs)
        self._init_lora()
        self._init_fp8(kwargs.get("config"))

    def forward(self, input_: torch.Tensor):
        # input_ is this rank's slice of the features; dropout applies this slice of the full mask
        # FP8: the per-token input scale covers the whole row, not this rank's slice (mesh independence)
        group = self.tp_group if self.weight_scale is not None and self.tp_group.size() > 1 else None
        branches, routes = self._routed_branches()
        out = lora_linear(input_, self.weight, None, branches, self.lora_site, self.weight_scale, group, routes)
        # an expert's output goes back through the dispatcher unreduced; one rank reduces nothing (megatron's
        # identity Function would return a view, which an expert's in-place bias addition then refuses)
        if not self.explicit_expert_comm and (self.sequence_parallel or self.tp_group.size() > 1):
            out = row_output(out, self.sequence_parallel, self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None
