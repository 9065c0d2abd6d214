"""A MoE layer's local experts as grouped GEMMs, their LoRA branches included.

megatron's ``SequentialMLP`` runs the local experts one after another: per expert an MLP module, two LoRA linears
and their autograd nodes. :class:`GroupedLoraExperts` keeps its modules, names, parameters and checkpoint layout
(loading, export, PEFT and dist checkpoints see ``local_experts.<i>`` as before) and computes the layer as one
chain over every local expert: ``torch.nn.functional.grouped_mm`` over the tokens sorted by expert for the frozen
fc1 and fc2 (their weights stacked once: each expert's weight becomes a view of the stack, so loading into the
parameters writes the stack) and for each adapter's A and B factors (stacked per forward: small), the SwiGLU and
the routing weights once for all tokens. On CUDA that is one grouped kernel per GEMM; on CPU it removes the Python
and autograd work per expert (``bench/moe_lora.py``).

The grouped path computes what the sequential one does (``tests/test_grouped_experts.py``): an adapter routed to
some of the experts' tokens (mixed-adapter micro-batches, :mod:`mlora.models.moe_routes`) has its delta masked to
those tokens, which adds zeros where the sequential path adds nothing. Where the layer has what it does not cover
(FP8 weights, biases, another activation, an adapter on some local experts only or on other projections of some,
a torch without ``grouped_mm``) the layer runs megatron's sequential loop, unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from mlora.lora.routing import EXPERT_TOKENS

GROUPED_MM = getattr(F, "grouped_mm", None)  # a torch without the public grouped_mm runs the experts sequentially
GROUPED_MM_ALIGN = 16  # bytes: grouped_mm takes strides of whole 16-byte units only


class GroupedLoraExperts(SequentialMLP):
    """``SequentialMLP`` whose forward groups the local experts' GEMMs (see the module's docstring). ``grouped``:
    False runs megatron's sequential loop (the reference the grouped path is tested and benchmarked against)."""

    grouped = True

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        adapters = (self._grouped_adapters() if self.grouped and self.num_local_experts > 1 and GROUPED_MM is not None
                    else None)
        if adapters is None:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        counts = tokens_per_expert.to(device=x.device, dtype=torch.int64)
        offs = counts.cumsum(0).to(torch.int32)
        w1, w2 = self._stacked_weights()
        fc1, fc2 = self.local_experts[0].linear_fc1, self.local_experts[0].linear_fc2
        h = GROUPED_MM(x, w1.transpose(1, 2), offs=offs)
        h = _add_deltas(h, x, adapters["fc1"], fc1.lora_site, offs)
        gate, up = torch.chunk(h, 2, dim=-1)
        z = self.config.activation_func(gate) * up
        z = (z * permuted_probs.unsqueeze(-1)).to(z.dtype)  # megatron's MLP: the routing weight after the GLU
        out = GROUPED_MM(z, w2.transpose(1, 2), offs=offs)
        return _add_deltas(out, z, adapters["fc2"], fc2.lora_site, offs), None

    def _grouped_adapters(self) -> dict[str, list] | None:
        """Per linear (``fc1``, ``fc2``): ``(name, branches of every local expert)`` of each active adapter, or None
        when the grouped path does not cover this layer (see the module's docstring)."""
        config = self.config
        if (not config.gated_linear_unit or config.activation_func is not F.silu or config.add_bias_linear
                or config.moe_apply_probs_on_input or config.activation_func_clamp_value is not None
                or config.glu_linear_offset != 0.0):
            return None
        unit = GROUPED_MM_ALIGN // self.local_experts[0].linear_fc1.weight.element_size()
        if config.hidden_size % unit or config.moe_ffn_hidden_size % unit:
            return None
        out = {}
        for attr in ("linear_fc1", "linear_fc2"):
            linears = [getattr(expert, attr) for expert in self.local_experts]
            if any(getattr(lin, "weight_scale", None) is not None or lin.bias is not None for lin in linears):
                return None
            names = linears[0].active_adapters
            per_name = []
            for name in names:
                branches = [lin.lora[name] if name in lin.lora else None for lin in linears]
                if all(b is None for b in branches):
                    continue
                if any(b is None or b.dropout_active for b in branches):
                    return None
                first = branches[0]
                pattern = _sub_positions(first, linears[0].lora_site)
                if any((b.rank, b.scaling, b.compute_dtype) != (first.rank, first.scaling, first.compute_dtype)
                       or _sub_positions(b, lin.lora_site) != pattern for b, lin in zip(branches, linears)):
                    return None
                per_name.append((name, branches))
            if any(lin.active_adapters != names for lin in linears):
                return None
            out[attr[len("linear_"):]] = per_name
        return out

    def stack_weights(self) -> None:
        """Each local expert's fc1 and fc2 weight becomes a view of its row of one ``[E, out, in]`` tensor per linear
        (the grouped GEMMs' operands), so that loading into the parameters in place writes the stacks. Called once
        the experts are built (:func:`mlora.models.megatron_build.build_gpt_model`), before anything is loaded. Not
        for FP8 weights, which the grouped path leaves to the sequential loop."""
        if any(getattr(e.linear_fc1, "weight_scale", None) is not None for e in self.local_experts):
            return
        stacks = []
        for attr in ("linear_fc1", "linear_fc2"):
            params = [getattr(e, attr).weight for e in self.local_experts]
            stack = torch.stack([p.detach() for p in params])
            for i, p in enumerate(params):
                p.data = stack[i]
            stacks.append(stack)
        self._weight_stacks = tuple(stacks)

    def _stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacks of :meth:`stack_weights`, made again when some parameter no longer is a view of them (its
        data replaced since)."""
        stacks = getattr(self, "_weight_stacks", None)
        if stacks is None or not all(_is_view_of(getattr(e, attr).weight, stack, i)
                                     for stack, attr in zip(stacks, ("linear_fc1", "linear_fc2"))
                                     for i, e in enumerate(self.local_experts)):
            self.stack_weights()
        return self._weight_stacks


def padded_rank(rank: int, item: int) -> int:
    """``rank`` rounded up to whole 16-byte units of ``item``-byte elements: ``grouped_mm`` takes no other strides, so
    each projection's A gets zero rows and its B zero columns up to it (they add exact zeros)."""
    return rank + -rank % (GROUPED_MM_ALIGN // item)


def _is_view_of(param: torch.Tensor, stack: torch.Tensor, i: int) -> bool:
    return param.data_ptr() == stack[i].data_ptr() and param.shape == stack.shape[1:]


def _sub_positions(branch, site) -> tuple[int, ...]:
    """Which of the site's projections (by position: gate 0, up 1) the branch adapts: an expert's projections have
    names of their own (``experts.3.gate_proj``), so experts agree by position."""
    return tuple(site.subs.index(sub) for sub in branch.subs)


def _add_deltas(out: torch.Tensor, x: torch.Tensor, adapters: list, site, offs: torch.Tensor) -> torch.Tensor:
    """``out`` plus each adapter's ``s·(x Aₑᵀ) Bₑᵀ`` for every expert e's tokens, written into the columns of the
    projections it adapts, in the output's dtype (as :func:`mlora.lora.layers.add_deltas`), its rows masked to the
    adapter's tokens where a mixed-adapter batch routes it (:func:`mlora.lora.routing.expert_route`'s tokens).
    Two grouped GEMMs per adapter: the stacked A, then B laid out block-diagonally as the fused output's columns."""
    placement = site.placement or ((0, out.shape[-1]),)
    for name, branches in adapters:
        first = branches[0]
        dtype = first.compute_dtype or x.dtype
        r, positions = first.rank, _sub_positions(first, site)
        rp = padded_rank(r, torch.empty((), dtype=dtype).element_size())
        a = torch.stack([b.factors_in(dtype)[0] for b in branches])
        if rp != r:
            a = F.pad(a.unflatten(1, (len(positions), r)), (0, 0, 0, rp - r)).flatten(1, 2)
        hidden = GROUPED_MM(x.to(dtype), a.transpose(1, 2), offs=offs)
        rows = []  # [E, size, n·rp] per output block: s·Bₖ in its projection's columns, zeros elsewhere
        for position, (_, size) in enumerate(placement):
            if position in positions:
                k = positions.index(position)
                b = torch.stack([br.factors_in(dtype)[1][k] for br in branches]) * first.scaling
                rows.append(F.pad(b, (k * rp, (len(positions) - k) * rp - r)))
            else:
                rows.append(hidden.new_zeros(len(branches), size, len(positions) * rp))
        block = rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)
        delta = GROUPED_MM(hidden, block.transpose(1, 2), offs=offs)
        mask = _token_mask(name, delta)
        out = out + (delta if mask is None else delta * mask).to(out.dtype)
    return out


def _token_mask(name: str, like: torch.Tensor) -> torch.Tensor | None:
    """``[tokens, 1]`` 0/1: the dispatched tokens adapter ``name`` applies to, while a mixed-adapter batch routes
    adapters through the experts (:func:`mlora.lora.routing.dispatched_tokens`); None for every token."""
    if not EXPERT_TOKENS or name not in EXPERT_TOKENS["names"]:
        return None
    column = EXPERT_TOKENS["masks"][:, EXPERT_TOKENS["names"].index(name)]
    if bool(column.all()):
        return None
    return column.to(like.dtype).unsqueeze(-1)
