"""LoRA-capable column- and row-parallel linears for megatron-core's layer spec.

Column-parallel base (``linear_qkv``, ``linear_fc1``; W split on the output dim): A replicated
``[r, in]``, B split on the output dim exactly like W, ``y_i = x W_iᵀ + s·(x Aᵀ) B_iᵀ``. Both
branches read the input after the layer's one copy / sequence-parallel all-gather, so autograd
sums their input-gradients before the single backward all-reduce / reduce-scatter.

Row-parallel base (``linear_proj``, ``linear_fc2``; W split on the input dim): A split on the
input dim ``[r, in/TP]``, B replicated; the LoRA partial is added before the layer's own
all-reduce / reduce-scatter, so one collective carries both.

Fused layers hold one adapter per HF projection (q, k, v; gate, up): their A factors are
stacked into one GEMM and their B factors into one block-structured GEMM that writes the fused
output layout directly. The frozen base GEMM then accumulates into the LoRA delta (addmm with
beta 1), and no weight gradient is ever computed for it.

LoRA dropout follows PEFT: each projection has its own mask on its own copy of the input, so with
dropout active (training mode, p > 0) a fused layer does one A GEMM per projection; otherwise the
stacked GEMM. Masks do not depend on the TP/PP layout: each is drawn for the full, unsharded
input from a generator keyed by (seed, adapter, layer, projection, DP rank, forward call), so the
column-parallel ranks (replicated input) draw the same mask and a row-parallel rank keeps its
slice of the full-input mask. See :class:`DropoutKey`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

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

from mlora.lora.config import derive_seed

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
    parallel: str  # "column" or "row"
    subs: tuple[str, ...]
    in_local: int
    in_full: int
    out_full: tuple[int, ...]  # HF output size of each sub
    groups: int = 1
    block: int = 0
    placement: tuple[tuple[int, int], ...] = ()


# Attributes on parameters that every TP rank holds whole:
TP_REPLICATED = "_mlora_tp_replicated"  # same value on every TP rank: counted once in norms
TP_PARTIAL_GRAD = "_mlora_tp_partial_grad"  # and its gradient is partial per TP rank: summed over TP


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


class LoraBranch(torch.nn.Module):
    """One adapter on one parallel linear: stacked A ``[n·r, in_local]`` and one B per projection.

    Column-parallel sites replicate A, row-parallel sites replicate B (marked TP-replicated).
    ``dropout_key`` keys the dropout masks and places this rank's input in the full input
    (default: seed 0, no adapter name, layer 0, the input whole).
    """

    def __init__(self, subs: tuple[str, ...], rank: int, scaling: float, dropout: float,
                 lora_a: torch.Tensor, lora_b: list[torch.Tensor], trainable: bool, parallel: str = "column",
                 dropout_key: DropoutKey | None = None) -> None:
        super().__init__()
        self.subs, self.rank, self.scaling = subs, rank, scaling
        self.dropout_p = float(dropout)
        self.dropout_key = dropout_key or DropoutKey(in_full=lora_a.shape[1])
        # Forward calls that drew masks. It advances once per forward in training mode with p > 0, so
        # an activation recompute of a forward must replay the call index it ran with.
        self.dropout_calls = 0
        self.lora_A = torch.nn.Parameter(lora_a, requires_grad=trainable)
        self.lora_B = torch.nn.ParameterList([torch.nn.Parameter(b, requires_grad=trainable) for b in lora_b])
        for p in ([self.lora_A] if parallel == "column" else list(self.lora_B)):
            mark_tp_replicated(p)

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
        if not self.dropout_active:
            return F.linear(x, self.lora_A)
        call, self.dropout_calls = self.dropout_calls, self.dropout_calls + 1
        masks = self.dropout_masks(x, call)
        return torch.cat([F.linear(x * m, self.a_of(k)) for k, m in enumerate(masks)], dim=-1)


def stacked_b(branch: LoraBranch, site: LoraSite) -> torch.Tensor:
    """``s·B`` in the layer's output layout, so that ``(x Aᵀ) @ stacked_bᵀ`` is the LoRA delta and
    ``stacked_b @ A`` the weight delta.

    A row-parallel layer has one projection: ``s·B``. A fused column-parallel layer gets one
    block-structured ``[out_local, n·r]`` matrix: the rows of projection k (placed as in the
    fused output) hold ``s·B_k`` in columns ``k·r:(k+1)·r`` and zeros elsewhere, so one GEMM
    writes every projection's delta straight into the fused layout. Built per call from the
    canonical factors (small).
    """
    if site.parallel == "row":
        return branch.lora_B[0] * branch.scaling
    r, n = branch.rank, len(branch.subs)
    pieces = []
    for sub, (_, size) in zip(site.subs, site.placement):
        if sub in branch.subs:
            k = branch.subs.index(sub)
            b = (branch.lora_B[k] * branch.scaling).view(site.groups, size, r)
            pieces.append(F.pad(b, (k * r, (n - 1 - k) * r)))
        else:
            pieces.append(branch.lora_A.new_zeros(site.groups, size, n * r))
    return torch.cat(pieces, dim=1).reshape(site.groups * site.block, n * r)


def lora_delta(branch: LoraBranch, x: torch.Tensor, site: LoraSite) -> torch.Tensor:
    """The branch's contribution to the layer's local output: the A GEMM(s), one B GEMM. ``x`` is the
    column-parallel layer's gathered input, or the row-parallel layer's slice of the features (the
    partial then joins the layer's reduction)."""
    return F.linear(branch.hidden(x), stacked_b(branch, site))


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


def _base_plus(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               deltas: list[torch.Tensor], weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x Wᵀ + bias + Σ deltas``, the base GEMM accumulating into the deltas (beta = 1): no extra
    pass over the output and, W being frozen, no weight gradient.

    An FP8 weight (``weight_scale`` given: float32 per output row) multiplies through
    :func:`mlora.fp8.fp8_linear` (input quantized per token, ``torch._scaled_mm``; its input
    gradient uses the dequantized weight); the deltas were computed from the unquantized ``x``."""
    if weight_scale is not None:
        return _fp8_base_plus(x, weight, weight_scale, bias, deltas)
    if not deltas:
        return F.linear(x, weight, bias)
    acc = deltas[0]
    for d in deltas[1:]:
        acc = acc + d
    if bias is not None:
        acc = acc + bias
    lead = x.shape[:-1]
    out = torch.addmm(acc.reshape(-1, acc.shape[-1]), x.reshape(-1, x.shape[-1]), weight.t())
    return out.view(*lead, out.shape[-1])


def _fp8_base_plus(x, weight, weight_scale, bias, deltas):
    from mlora.fp8.quant import fp8_linear

    out = fp8_linear(x, weight, weight_scale)
    for d in deltas:
        out = out + d
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
        x = column_input(input_, self.sequence_parallel, self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        deltas = [lora_delta(branch, x, self.lora_site) for branch in self._branches()]
        out = _base_plus(x, weight, bias, deltas, self.weight_scale if weight is self.weight else None)
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
        deltas = [lora_delta(branch, input_, self.lora_site) for branch in self._branches()]
        out = row_output(_base_plus(input_, self.weight, None, deltas, self.weight_scale), self.sequence_parallel,
                         self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None


LORA_LINEARS = (LoraColumnParallelLinear, LoraRowParallelLinear)
