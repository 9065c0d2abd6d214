"""megatron's MoE layer carrying mixed-adapter routes through its token dispatcher.

In a mixed-adapter micro-batch each adapter applies to some rows only (:mod:`mlora.lora.routing`). The
attention's linears index those rows' tokens directly; an expert's input is tokens the dispatcher permuted
and gathered from every EP rank. So the layer appends one 0/1 column per routed adapter to the hidden states
before the dispatch: the permutation, the all-to-all over EP (and the gather over expert TP) move the columns
with their tokens, and the experts then read which of their tokens belong to which adapter. The columns are
stripped before the experts compute; the combine step is megatron's, untouched. Routing itself (the router,
top-k) never sees the columns, so an adapter's tokens reach the same experts as in a run of that adapter alone.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

from mlora.lora.routing import EXPERT_ADAPTERS, dispatched_tokens, sequence_slice, token_masks


class AdapterRoutedMoELayer(MoELayer):
    """:class:`MoELayer` whose dispatcher also carries the adapter columns while
    :data:`mlora.lora.routing.EXPERT_ADAPTERS` is set (a forward of mixed-adapter micro-batches)."""

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        names = tuple(EXPERT_ADAPTERS)  # the same for the whole forward_backward call, recomputes included
        if not names:
            return super().preprocess(hidden_states, probs, routing_map)
        # routes index the flattened [s, b] tokens of the whole sequence; under SP this rank holds a slice of s
        local = hidden_states.shape[0] * hidden_states.shape[1]
        tokens, at = sequence_slice(local, self.attn_tp_group, self.config.sequence_parallel)
        masks = token_masks(names, tokens, at, at + local, hidden_states).view(*hidden_states.shape[:-1], -1)
        out, probs = super().preprocess(torch.cat([hidden_states, masks], dim=-1), probs, routing_map)
        # the combine step rebuilds the layer's output in these shapes: without the columns
        dispatcher = self.token_dispatcher
        dispatcher.hidden_shape = hidden_states.shape
        dispatcher.hidden_shape_before_permute = torch.Size((local, hidden_states.shape[-1]))
        return out, probs

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        columns = len(EXPERT_ADAPTERS)  # those preprocess appended
        if not columns:
            return super().routed_experts_compute(hidden_states, probs)
        dispatcher = self.token_dispatcher
        dispatched, tokens_per_expert, permuted_probs = dispatcher.dispatch_postprocess(hidden_states, probs)
        tokens, masks = dispatched[:, :-columns].contiguous(), dispatched[:, -columns:].detach()
        counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
        with dispatched_tokens(masks, counts, self.local_expert_indices[0]):
            expert_output, mlp_bias = self.experts(tokens, tokens_per_expert, permuted_probs)
        return dispatcher.combine_preprocess(expert_output), mlp_bias
