"""Gradient reduction and clipping across TP, PP and DP, once per optimizer step.

- Parameters with partial gradients per TP rank (A of column layers, B of row layers) are
  summed over TP *and* DP in one all-reduce over the TP×DP group.
- An expert's factors (MoE layers; whole on the ranks holding the expert) are summed over the expert-
  data-parallel group: the ranks that hold the same experts and routed other tokens through them.
- Every other trainable parameter (TP-sharded factors, heads) is summed over DP.
Losses are normalised by global counts, so a plain sum gives the gradient of the global loss.
The global grad norm counts each distinct parameter once: TP-replicated ones on TP rank 0 only,
sharded ones on every TP rank, every PP stage, experts on one rank of each expert-data-parallel group
(megatron's rule: their squares are summed over the expert-model-parallel ranks); DP replicas are
identical after reduction.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from mlora.lora.layers import has_tp_partial_grad, is_expert_param, is_tp_replicated


def all_reduce_grads(params: Iterable[torch.nn.Parameter], group) -> None:
    """Sum the gradients of ``params`` over ``group`` in one flat bucket.

    The bucket holds every parameter that requires grad, whether or not it has a gradient on this rank, so
    that its layout is the same on every rank: an adapter routed to rows of one DP rank's micro-batches
    only (:mod:`mlora.lora.routing`) has a gradient there and none on the others. A parameter without one
    counts as zeros and gets the sum if any rank had a gradient (one flag per parameter, summed in the same
    bucket, says so); if none had, it stays without one, and an optimizer skips it as on a single rank.
    """
    params = [p for p in params if p.requires_grad]
    if not params or group is None or dist.get_world_size(group) == 1:
        return
    dtype, device = params[0].dtype, params[0].device
    had = torch.tensor([p.grad is not None for p in params], dtype=dtype, device=device)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros(p.shape, dtype=dtype, device=device)).reshape(-1)
                      for p in params] + [had])
    dist.all_reduce(flat, group=group)
    had = flat[-len(params):]
    offset = 0
    for p, any_grad in zip(params, had.tolist()):
        summed = flat[offset:offset + p.numel()].view(p.shape)
        offset += p.numel()
        if p.grad is not None:
            p.grad.copy_(summed)
        elif any_grad:
            p.grad = summed.clone()


def finalize_grads(params: list[torch.nn.Parameter]) -> None:
    """Reduce gradients of one optimizer's parameters: TP-partial ones over TP×DP, experts' over expert-DP, the
    rest over DP."""
    from megatron.core import parallel_state as ps

    experts = [p for p in params if is_expert_param(p)]
    params = [p for p in params if not is_expert_param(p)]
    all_reduce_grads([p for p in params if has_tp_partial_grad(p)], ps.get_tensor_and_data_parallel_group())
    all_reduce_grads([p for p in params if not has_tp_partial_grad(p)], ps.get_data_parallel_group())
    if experts:
        all_reduce_grads(experts, ps.get_expert_data_parallel_group())


def global_grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """L2 norm of all gradients of the model (every stage and shard), after :func:`finalize_grads`."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    sq = torch.zeros((), dtype=torch.float64)
    expert_sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        if is_expert_param(p):
            expert_sq += p.grad.detach().double().pow(2).sum().cpu()
        elif tp_rank == 0 or not is_tp_replicated(p):
            sq += p.grad.detach().double().pow(2).sum().cpu()
    device = params[0].device if params else sq.device
    sq = _sum_over(sq, ps.get_model_parallel_group(), device)
    # on every rank, experts or not (a pipeline stage of dense layers has none): a collective of all
    expert_group = ps.get_expert_tensor_model_pipeline_parallel_group(check_initialized=False)
    if expert_group is not None:
        sq = sq + _sum_over(expert_sq, expert_group, device)
    return sq.sqrt().float().cpu()


def _sum_over(value: torch.Tensor, group, device) -> torch.Tensor:
    """``value`` summed over ``group`` (a scalar; on ``device`` for the collective, back on the CPU)."""
    if dist.get_world_size(group) > 1:
        value = value.to(device)
        dist.all_reduce(value, group=group)
    return value.cpu()


def clip_grads(params: list[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Scale gradients so that the global norm is at most ``max_norm``; returns the norm before."""
    norm = global_grad_norm(params)
    if max_norm is not None and max_norm > 0:
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return norm
