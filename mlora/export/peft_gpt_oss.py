"""gpt-oss adapters in PEFT's layout: the experts' LoRA on transformers' stacked parameters (``target_parameters``).

gpt-oss's experts exist only stacked (``mlp.experts.gate_up_proj`` ``[E, hidden, 2·ffn]``, gate and up columns
interleaved; ``mlp.experts.down_proj`` ``[E, ffn, hidden]``), so PEFT 0.21 adapts them with its ``ParamWrapper``:
``lora_A`` ``[r·E, in]``, ``lora_B`` ``[out, r·E]``, expert e's delta ``s · B_e · A_e`` with ``A_e`` its rows
``e·r:(e+1)·r`` and ``B_e = lora_B.reshape(out, r, E)[..., e]`` (:mod:`mlora.export.peft_fused`). mlora gives each
expert's gate, up and down a LoRA of rank r of its own; gate and up share gate_up_proj's one A in PEFT, so they go
there at rank 2r, exactly: ``A_e = [A_gate; A_up]`` and ``B_e`` block-diagonal in gate_up's interleaved rows (row 2j
``[B_gate[j], 0]``, row 2j + 1 ``[0, B_up[j]]``), with ``alpha_pattern`` keeping PEFT's scaling mlora's (2·alpha,
``√2·alpha`` with rslora), as PEFT's own conversion of per-expert adapters does. A router's LoRA is a
``target_parameters`` entry too (``mlp.router.weight``): PEFT adapts no ``GptOssTopKRouter`` module.

PEFT names the factors by the experts module, the first parameter it wraps (gate_up_proj, in the module's parameter
order) one ``base_layer`` deeper when both are adapted.
"""

from __future__ import annotations

import math
import re

import torch

from mlora.formats.fused_experts import DOWN, GATE_UP, fused_expert_name
from mlora.lora.config import LoraConfig
from mlora.lora.targets import expert_of, hf_module_name, is_router


def stacked_names(layer: int, params: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """``{param: (lora_A name, lora_B name)}`` PEFT saves for the stacked parameters ``params`` of one layer."""
    out = {}
    for param in params:
        nest = ".base_layer" if param == GATE_UP and DOWN in params else ""
        stem = f"base_model.model.model.layers.{layer}.mlp.experts{nest}"
        out[param] = (f"{stem}.lora_A.weight", f"{stem}.lora_B.weight")
    return out


def adapted_params(modules) -> dict[int, tuple[str, ...]]:
    """Per MoE layer, the stacked parameters an adapter of (layer, projection) ``modules`` adapts (gate_up_proj when
    its experts' gate and up are, down_proj when their down is; :func:`mlora.facade.adapters.peft_refusals` has
    checked that every expert is, or none)."""
    out: dict[int, set[str]] = {}
    for layer, proj in modules:
        if expert_of(proj) is not None:
            out.setdefault(layer, set()).add(DOWN if proj.endswith("down_proj") else GATE_UP)
    return {layer: tuple(p for p in (GATE_UP, DOWN) if p in params) for layer, params in sorted(out.items())}


def peft_config_fields(config: LoraConfig, modules, num_layers: int, sparse_layers) -> dict:
    """``target_parameters``, ``rank_pattern`` and ``alpha_pattern`` of a gpt-oss adapter: the stacked experts' (and
    routers') paths, short where every MoE layer has them, with gate_up_proj at twice the experts' rank."""
    params = adapted_params(modules)
    routers = sorted(layer for layer, proj in modules if is_router(proj))
    targets, ranks, alphas = [], {}, {}
    expert_rank = config.rank_of(True)
    for param in (GATE_UP, DOWN):
        layers = [i for i, ps in params.items() if param in ps]
        if not layers:
            continue
        every = layers == list(sparse_layers)
        targets += [f"mlp.experts.{param}"] if every else [fused_expert_name(i, param) for i in layers]
        wide = 2 if param == GATE_UP else 1
        for i in layers:
            key = re.escape(fused_expert_name(i, param))
            ranks[key] = wide * expert_rank
            alpha = config.alpha * (math.sqrt(wide) if config.use_rslora else wide)
            if alpha != config.alpha:
                alphas[key] = alpha if not float(alpha).is_integer() else int(alpha)
    if routers:
        every = routers == list(sparse_layers)
        targets += ["mlp.router.weight"] if every else [f"{hf_module_name(i, 'mlp.router')}.weight" for i in routers]
        for i in routers:
            ranks[re.escape(f"{hf_module_name(i, 'mlp.router')}.weight")] = config.rank
    return {"target_parameters": targets, "rank_pattern": ranks, "alpha_pattern": alphas}


def stack_gate_up(a_gate: torch.Tensor, b_gate: torch.Tensor, a_up: torch.Tensor, b_up: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's gate and up LoRA (``A [r, hidden]``, ``B [ffn, r]`` each) as gate_up_proj's at rank 2r:
    ``A [2r, hidden]``, ``B [2·ffn, 2r]`` block-diagonal in the interleaved rows."""
    r, ffn = a_gate.shape[0], b_gate.shape[0]
    b = b_gate.new_zeros(2 * ffn, 2 * r)
    b[0::2, :r] = b_gate
    b[1::2, r:] = b_up
    return torch.cat([a_gate, a_up]), b


def peft_stacked(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's ``A_e [r, in]`` and ``B_e [out, r]`` (in expert order) as PEFT's ``lora_A [r·E, in]`` and
    ``lora_B [out, r·E]`` (``lora_B.reshape(out, r, E)[..., e] = B_e``)."""
    return torch.cat(a), torch.stack(b, dim=-1).flatten(1)


def stacked_layout(modules, spec, rank: int, dtype: torch.dtype) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The stacked factors' PEFT names -> (dtype, shape) of an adapter of ``modules`` whose experts have ``rank``."""
    experts, ffn, hidden = spec.moe.num_experts, spec.moe.ffn_size, spec.hidden_size
    out = {}
    for layer, params in adapted_params(modules).items():
        for param, (a, b) in stacked_names(layer, params).items():
            r, fan_in, fan_out = (2 * rank, hidden, 2 * ffn) if param == GATE_UP else (rank, ffn, hidden)
            out[a], out[b] = (dtype, (r * experts, fan_in)), (dtype, (fan_out, r * experts))
    return out
