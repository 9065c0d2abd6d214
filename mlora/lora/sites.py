"""LoRA sites of a whole model computed from its spec alone (no weights, any stage)."""

from __future__ import annotations

import torch

from mlora.formats.weight_map import COLUMNS, REPLICATED, ROWS
from mlora.lora.layers import LoraSite
from mlora.lora.targets import (
    LM_HEAD,
    MEGATRON_MODULES,
    MLP_PROJECTIONS,
    expert_projection,
    router_projection,
    shared_expert_projection,
)

# multi-latent attention's linears (megatron name -> HF projection)
MLA_LINEARS = {name: MEGATRON_MODULES[name][0] for name in ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
                                                             "linear_kv_down_proj", "linear_kv_up_proj")}

# How each factor is split over TP (see mlora.lora.layers): column: A replicated, B like W;
# row: A split on the input dim, B replicated; a MoE router (replicated, like its weight): both whole.
FACTOR_KINDS = {"column": (REPLICATED, ROWS), "row": (COLUMNS, REPLICATED), "router": (REPLICATED, REPLICATED),
                "duplicated": (REPLICATED, REPLICATED)}


def factor_kinds(site: LoraSite) -> tuple[str, str]:
    """How TP splits the A and B of ``site``: an expert's are whole (expert TP 1) on the ranks holding it."""
    return (REPLICATED, REPLICATED) if site.expert is not None else FACTOR_KINDS[site.parallel]


def factor_shapes(site: LoraSite, sub: str, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Full (HF/PEFT) shapes of A and B for projection ``sub`` of ``site``."""
    return (rank, site.in_full), (site.out_full[site.subs.index(sub)], rank)


def model_sites(spec, tp: int) -> dict[tuple[int, str], LoraSite]:
    """(layer, HF projection) -> the LoraSite of the parallel linear that carries it."""
    hd, hpg = spec.head_dim, spec.heads_per_group
    sites: dict[tuple[int, str], LoraSite] = {}
    for i in range(spec.num_layers):
        attention = (mla_sites(spec, i, tp) if spec.mla is not None else [
            LoraSite(layer=i, parallel="column", subs=("q_proj", "k_proj", "v_proj"),
                     in_local=spec.hidden_size, in_full=spec.hidden_size,
                     out_full=(spec.num_heads * hd, spec.num_kv_heads * hd, spec.num_kv_heads * hd),
                     groups=spec.num_kv_heads // tp, block=(hpg + 2) * hd,
                     placement=((0, hpg * hd), (hpg * hd, hd), ((hpg + 1) * hd, hd))),
            LoraSite(layer=i, parallel="row", subs=("o_proj",), in_local=spec.num_heads * hd // tp,
                     in_full=spec.num_heads * hd, out_full=(spec.hidden_size,))])
        for site in (
            *attention,
            # a MoE layer's MLP is its experts (and shared expert): no site of its own
            *(() if spec.is_sparse(i) else mlp_sites(spec, i, MLP_PROJECTIONS, spec.intermediate_size, tp)),
            *([router_site(spec, i)] + expert_sites(spec, i) + shared_expert_sites(spec, i, tp)
              if spec.is_sparse(i) else ()),
        ):
            for sub in site.subs:
                sites[(i, sub)] = site
    sites[(spec.num_layers - 1, LM_HEAD)] = lm_head_site(spec, tp)
    return sites


def mla_sites(spec, layer: int, tp: int) -> list[LoraSite]:
    """Multi-head latent attention's sites (DeepSeek-V3): the down projections duplicated (whole on every TP rank,
    reading its slice of the sequence under SP: :class:`mlora.models.mla.LoraDuplicatedLinear`), the up projections
    (and q_proj) column-parallel with their output rows split over TP, o_proj row-parallel."""
    mla, h, heads = spec.mla, spec.hidden_size, spec.num_heads

    def column(sub: str, fan_in: int, fan_out: int, duplicated: bool = False) -> LoraSite:
        split = 1 if duplicated else tp
        return LoraSite(layer=layer, parallel="duplicated" if duplicated else "column", subs=(sub,), in_local=fan_in,
                        in_full=fan_in, out_full=(fan_out,), groups=1, block=fan_out // split,
                        placement=((0, fan_out // split),))

    q = ([column("q_proj", h, heads * mla.qk_head_dim)] if mla.q_lora_rank is None else
         [column("q_a_proj", h, mla.q_lora_rank, True), column("q_b_proj", mla.q_lora_rank, heads * mla.qk_head_dim)])
    return [*q, column("kv_a_proj_with_mqa", h, mla.kv_lora_rank + mla.qk_rope_head_dim, True),
            column("kv_b_proj", mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim)),
            LoraSite(layer=layer, parallel="row", subs=("o_proj",), in_local=heads * mla.v_head_dim // tp,
                     in_full=heads * mla.v_head_dim, out_full=(h,))]


def lm_head_site(spec, tp: int) -> LoraSite:
    """The output layer's site: column-parallel over the vocabulary (megatron's ``output_layer``), on the last
    stage (keyed by the last layer). B is split by vocabulary rows like the weight, so the vocabulary must divide
    by TP (:func:`check_lm_head`): the weight's padding rows have no PEFT counterpart."""
    rows = spec.padded_vocab_size(tp) // tp
    return LoraSite(layer=spec.num_layers - 1, parallel="column", subs=(LM_HEAD,), in_local=spec.hidden_size,
                    in_full=spec.hidden_size, out_full=(spec.vocab_size,), groups=1, block=rows,
                    placement=((0, rows),))


def check_lm_head(spec, tp: int, modules) -> None:
    """ValueError when ``modules`` adapt the output layer of a model whose vocabulary TP does not divide."""
    if (spec.num_layers - 1, LM_HEAD) in modules and spec.vocab_size % tp:
        raise ValueError(f"LoRA on lm_head at TP={tp}: the vocabulary ({spec.vocab_size}) must divide by TP (the "
                         "output layer pads it, and an adapter's B has no padding rows); use a TP that divides it, "
                         "or leave lm_head out of target_modules")


def router_site(spec, layer: int) -> LoraSite:
    """The site of MoE layer ``layer``'s router ``[E, hidden]``: whole on every rank, as its weight is; under SP
    it reads this rank's slice of the sequence, so its factors' gradients are partial per TP rank."""
    return LoraSite(layer=layer, parallel="router", subs=(router_projection(spec.moe),), in_local=spec.hidden_size,
                    in_full=spec.hidden_size, out_full=(spec.moe.num_experts,))


def expert_sites(spec, layer: int) -> list[LoraSite]:
    """The fc1 (gate, up) and fc2 (down) sites of every expert of MoE layer ``layer``: whole on their EP rank
    (expert TP 1), so their local and full widths agree whatever the TP size."""
    moe, hidden = spec.moe, spec.hidden_size
    ffn = moe.ffn_size
    out = []
    for e in range(moe.num_experts):
        gate, up, down = (expert_projection(moe, e, k) for k in range(3))
        out += [LoraSite(layer=layer, parallel="column", subs=(gate, up), in_local=hidden, in_full=hidden,
                         out_full=(ffn, ffn), groups=1, block=2 * ffn, placement=((0, ffn), (ffn, ffn)), expert=e),
                LoraSite(layer=layer, parallel="row", subs=(down,), in_local=ffn, in_full=ffn, out_full=(hidden,),
                         expert=e)]
    return out


def shared_expert_sites(spec, layer: int, tp: int) -> list[LoraSite]:
    """The fc1 (gate, up) and fc2 (down) sites of MoE layer ``layer``'s shared expert (none without one): a dense
    MLP of width ``moe.shared_ffn_size``, TP-split and laid out like the dense MLP's (column fc1, row fc2)."""
    if spec.moe.shared_ffn_size is None:
        return []
    subs = tuple(shared_expert_projection(spec.moe, k) for k in range(3))
    return mlp_sites(spec, layer, subs, spec.moe.shared_ffn_size, tp)


def mlp_sites(spec, layer: int, subs: tuple[str, str, str], ffn: int, tp: int) -> list[LoraSite]:
    """The sites of a TP-split gated MLP of width ``ffn`` whose gate, up and down projections are keyed ``subs``:
    column-parallel fc1 (megatron's per-rank ``[gate shard; up shard]``) and row-parallel fc2."""
    gate, up, down = subs
    return [LoraSite(layer=layer, parallel="column", subs=(gate, up), in_local=spec.hidden_size,
                     in_full=spec.hidden_size, out_full=(ffn, ffn), groups=1, block=2 * ffn // tp,
                     placement=((0, ffn // tp), (ffn // tp, ffn // tp))),
            LoraSite(layer=layer, parallel="row", subs=(down,), in_local=ffn // tp, in_full=ffn,
                     out_full=(spec.hidden_size,))]


def attach_lora_sites(gpt: torch.nn.Module, spec, tp: int) -> None:
    """Tell each LoRA linear of this stage where it sits: layer index, projections, output layout."""
    sites = model_sites(spec, tp)
    if getattr(gpt, "post_process", False):
        gpt.output_layer.lora_site = sites[(spec.num_layers - 1, LM_HEAD)]
    for layer in gpt.decoder.layers:
        i = layer.layer_number - 1
        attention = layer.self_attention
        if spec.mla is None:
            attention.linear_qkv.lora_site = sites[(i, "q_proj")]
        else:
            for megatron, hf in MLA_LINEARS.items():
                if hasattr(attention, megatron):
                    getattr(attention, megatron).lora_site = sites[(i, hf)]
        attention.linear_proj.lora_site = sites[(i, "o_proj")]
        if not spec.is_sparse(i):
            layer.mlp.linear_fc1.lora_site = sites[(i, "gate_proj")]
            layer.mlp.linear_fc2.lora_site = sites[(i, "down_proj")]
            continue
        layer.mlp.router.lora_site = sites[(i, router_projection(spec.moe))]
        # this EP rank's experts: megatron places global experts [ep_rank·E/EP, (ep_rank+1)·E/EP) here
        for e, expert in zip(layer.mlp.local_expert_indices, layer.mlp.experts.local_experts):
            expert.linear_fc1.lora_site = sites[(i, expert_projection(spec.moe, e, 0))]
            expert.linear_fc2.lora_site = sites[(i, expert_projection(spec.moe, e, 2))]
        if spec.moe.shared_ffn_size is not None:
            shared = layer.mlp.shared_experts
            shared.linear_fc1.lora_site = sites[(i, shared_expert_projection(spec.moe, 0))]
            shared.linear_fc2.lora_site = sites[(i, shared_expert_projection(spec.moe, 2))]
