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
"""

from __future__ import annotations

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


class LoraBranch(torch.nn.Module):
    """One adapter on one parallel linear: stacked A ``[n·r, in_local]`` and one B per projection.

    Column-parallel sites replicate A, row-parallel sites replicate B (marked TP-replicated).
    """

    def __init__(self, subs: tuple[str, ...], rank: int, scaling: float, dropout: float,
                 lora_a: torch.Tensor, lora_b: list[torch.Tensor], trainable: bool, parallel: str = "column") -> None:
        super().__init__()
        self.subs, self.rank, self.scaling = subs, rank, scaling
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.lora_A = torch.nn.Parameter(lora_a, requires_grad=trainable)
        self.lora_B = torch.nn.ParameterList([torch.nn.Parameter(b, requires_grad=trainable) for b in lora_b])
        for p in ([self.lora_A] if parallel == "column" else list(self.lora_B)):
            mark_tp_replicated(p)

    def a_of(self, k: int, grad: bool = False) -> torch.Tensor:
        """Projection ``k``'s A (or its gradient): rows ``k·r:(k+1)·r`` of the stacked A."""
        a = self.lora_A.grad if grad else self.lora_A
        return a[k * self.rank:(k + 1) * self.rank]


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


def _column_delta(branch: LoraBranch, x: torch.Tensor, site: LoraSite) -> torch.Tensor:
    """The branch's contribution to a column-parallel output: one A GEMM, one B GEMM."""
    return F.linear(F.linear(branch.dropout(x), branch.lora_A), stacked_b(branch, site))


def _base_plus(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               deltas: list[torch.Tensor]) -> torch.Tensor:
    """``x Wᵀ + bias + Σ deltas``, the base GEMM accumulating into the deltas (beta = 1): no extra
    pass over the output and, W being frozen, no weight gradient."""
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


class _LoraHost:
    """Adapter registry shared by both linears (PEFT's ``LoraLayer`` idea on a parallel linear)."""

    def _init_lora(self) -> None:
        self.lora = torch.nn.ModuleDict()
        self.active_adapters: tuple[str, ...] = ()
        self.lora_site: LoraSite | None = None

    def _branches(self):
        for name in self.active_adapters:
            branch = self.lora[name] if name in self.lora else None
            if branch is not None:
                yield branch


class LoraColumnParallelLinear(_LoraHost, tensor_parallel.ColumnParallelLinear):
    """megatron's ColumnParallelLinear with LoRA branches inside its single TP collective."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_lora()

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None):
        weight = self.weight if weight is None else weight
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(input_, group=self.tp_group)
        else:
            x = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        deltas = [_column_delta(branch, x, self.lora_site) for branch in self._branches()]
        out = _base_plus(x, weight, bias, deltas)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)


class LoraRowParallelLinear(_LoraHost, tensor_parallel.RowParallelLinear):
    """megatron's RowParallelLinear with the LoRA partial added before its one reduction."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_lora()

    def forward(self, input_: torch.Tensor):
        deltas = []
        for branch in self._branches():
            # input_ is this rank's slice of the features: dropout draws from the TP-rank stream
            with tensor_parallel.get_cuda_rng_tracker().fork():
                x = branch.dropout(input_)
            deltas.append(F.linear(F.linear(x, branch.lora_A), stacked_b(branch, self.lora_site)))
        out = _base_plus(input_, self.weight, None, deltas)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
        else:
            out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None


LORA_LINEARS = (LoraColumnParallelLinear, LoraRowParallelLinear)
