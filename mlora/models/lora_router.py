"""megatron's MoE router with LoRA on its gating linear (a MoE layer's router as a LoRA target).

The router is a ``[E, hidden]`` linear held whole by every rank and computed in the dtype transformers and vLLM compute
it in (megatron's ``moe_router_dtype``: the model's, float32 for GLM-4.5); under sequence parallelism each TP rank
routes its own slice of the sequence. Its adapter follows suit: A and B whole on every rank, their gradients partial per
TP rank (summed over TP × DP, :mod:`mlora.lora.grads`), the delta ``s·(x Aᵀ) Bᵀ`` added to the logits before the score
function and top-k, as PEFT adds it to transformers' router (and vLLM's LoRA to its ``GateLinear``). So the routing
itself, which experts a token reaches and with what weight, moves with the adapter; the top-k choice is not
differentiable, the weights are.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter

from mlora.lora.layers import LoraHost, add_deltas, branch_deltas


class LoraTopKRouter(TopKRouter, LoraHost):
    """:class:`TopKRouter` with an adapter registry (swapped in after the build, see
    :func:`mlora.models.megatron_build.route_through_experts`; megatron's class first, so that a built router can
    take this class: Python refuses the swap when a plain mixin precedes an ABC)."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        logits = super().gating(input)
        branches, routes = self._slice_routed_branches(input)
        if not branches:
            return logits
        # the branches compute in their dtype (the input's unless set) like every LoRA site; the delta joins the
        # logits in their dtype
        return add_deltas(logits, branch_deltas(branches, input, self.lora_site, routes))


def lora_router(router: TopKRouter) -> LoraTopKRouter:
    """``router`` as a :class:`LoraTopKRouter` (in place: same parameters, no adapters yet)."""
    router.__class__ = LoraTopKRouter
    router._init_lora()
    router.weight_scale = None  # the router's weight is never FP8 (see LoraHost._init_fp8)
    return router
