"""HF <-> Megatron weight mapping, shard by shard.

Each Megatron parameter of a rank is described by a :class:`ParamMap`: the HF tensors it
comes from and how TP splits them. ``load`` reads only this rank's slice from the checkpoint;
``to_hf`` turns the list of all TP shards back into the HF tensors, so that loading then
saving is bit-exact.

Layouts (megatron-core):
- ``linear_qkv``: per query group ``[q heads of the group; k; v]``, groups split over TP.
- ``linear_fc1``: per TP rank ``[gate shard; up shard]``.
- column-parallel weights split dim 0, row-parallel weights split dim 1.
- vocabulary rows padded up to a multiple of TP, padding rows zero and dropped on export.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlora.formats.checkpoint_reader import CheckpointReader
from mlora.formats.hf_config import ModelSpec

REPLICATED, ROWS, COLUMNS, QKV, FC1, VOCAB = "replicated", "rows", "columns", "qkv", "fc1", "vocab"


_SPLIT_DIM = {ROWS: 0, COLUMNS: 1}
_SHARED = "mlp.shared_experts."  # megatron's SharedExpertMLP in a MoE layer
EXPERT_BIAS = "mlp.router.expert_bias"  # a sigmoid router's correction bias: float32 whatever the base's dtype
SINKS = "core_attention.softmax_offset"  # gpt-oss's sink logit per head (megatron's learnable softmax offset)


def read_shard(reader: CheckpointReader, name: str, kind: str, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's even slice of tensor ``name`` (whole tensor when ``kind`` is replicated)."""
    if kind == REPLICATED:
        return reader.read(name)
    dim = _SPLIT_DIM[kind]
    n = reader.entry(name).shape[dim] // tp
    return reader.read(name, dim=dim, start=tp_rank * n, stop=(tp_rank + 1) * n)


def shard(full: torch.Tensor, kind: str, tp: int, tp_rank: int) -> torch.Tensor:
    """In-memory twin of :func:`read_shard`."""
    if kind == REPLICATED:
        return full
    return full.chunk(tp, dim=_SPLIT_DIM[kind])[tp_rank]


def unshard(shards: list[torch.Tensor], kind: str) -> torch.Tensor:
    """The full tensor from all TP ranks' shards, in rank order (inverse of :func:`shard`)."""
    if kind == REPLICATED:
        return shards[0]
    return torch.cat(shards, dim=_SPLIT_DIM[kind])


@dataclass(frozen=True)
class ParamMap:
    """How one Megatron parameter of this rank maps onto HF tensors."""

    megatron_name: str
    hf_names: tuple[str, ...]
    kind: str
    expert: bool = False  # an expert's linear: whole on its EP rank (expert TP is 1), FFN width moe.ffn_size

    def ffn(self, spec: ModelSpec) -> int:
        """The FFN width of the MLP this parameter belongs to: a routed expert's, the shared expert's
        (TP-split like a dense MLP's) or the dense MLP's."""
        if self.expert:
            return spec.moe.ffn_size
        return spec.moe.shared_ffn_size if _SHARED in self.megatron_name else spec.intermediate_size

    def hf_shapes(self, spec: ModelSpec, reader_shapes: dict[str, tuple[int, ...]] | None = None
                  ) -> dict[str, tuple[int, ...]]:
        """Shapes of the HF tensors this parameter exports to."""
        h, hd = spec.hidden_size, spec.head_dim
        if spec.mla is not None and ".self_attention." in self.megatron_name:
            return {self.hf_names[0]: _mla_shape(spec, self.megatron_name)}
        if self.kind == QKV:
            q, k, v = self.hf_names
            trail = (h,) if self.megatron_name.endswith("weight") else ()
            return {q: (spec.num_heads * hd, *trail), k: (spec.num_kv_heads * hd, *trail),
                    v: (spec.num_kv_heads * hd, *trail)}
        ffn = self.ffn(spec)
        if self.kind == FC1:  # a gate/up pair's weights, or (gpt-oss) biases
            return {n: (ffn, h) if self.megatron_name.endswith("weight") else (ffn,) for n in self.hf_names}
        if self.kind == VOCAB:
            return {self.hf_names[0]: (spec.vocab_size, h)}
        if self.kind == COLUMNS:
            out = h
            inp = spec.num_heads * hd if "linear_proj" in self.megatron_name else ffn
            return {self.hf_names[0]: (out, inp)}
        if self.megatron_name.endswith("router.weight"):
            return {self.hf_names[0]: (spec.moe.num_experts, h)}
        if self.megatron_name.endswith("router.bias"):
            return {self.hf_names[0]: (spec.moe.num_experts,)}
        if self.megatron_name.endswith(SINKS):
            return {self.hf_names[0]: (spec.num_heads,)}
        if self.megatron_name.endswith(EXPERT_BIAS):
            return {self.hf_names[0]: (spec.moe.num_experts,)}
        if self.megatron_name.endswith(_SHARED + "gate_weight"):  # the shared expert's sigmoid gate, [1, hidden]
            return {self.hf_names[0]: (1, h)}
        if "layernorm" in self.megatron_name and "self_attention" in self.megatron_name:  # q/k norm
            heads = spec.num_heads if "q_layernorm" in self.megatron_name else spec.num_kv_heads
            return {self.hf_names[0]: (hd * heads if spec.qk_norm == "full" else hd,)}
        return {self.hf_names[0]: (h,)}

    def load(self, reader: CheckpointReader, spec: ModelSpec, tp: int, tp_rank: int) -> torch.Tensor:
        """This TP rank's shard, reading only its slices."""
        if self.expert:
            tp, tp_rank = 1, 0
        if self.kind in (REPLICATED, ROWS, COLUMNS):
            return read_shard(reader, self.hf_names[0], self.kind, tp, tp_rank)
        if self.kind == FC1:
            n = self.ffn(spec) // tp
            return torch.cat([reader.read(name, 0, tp_rank * n, (tp_rank + 1) * n) for name in self.hf_names])
        if self.kind == QKV:
            groups = spec.num_kv_heads // tp
            g0 = tp_rank * groups
            hd, hpg = spec.head_dim, spec.heads_per_group
            q_name, k_name, v_name = self.hf_names
            q = reader.read(q_name, 0, g0 * hpg * hd, (g0 + groups) * hpg * hd)
            k = reader.read(k_name, 0, g0 * hd, (g0 + groups) * hd)
            v = reader.read(v_name, 0, g0 * hd, (g0 + groups) * hd)
            trail = q.shape[1:]
            parts = [q.reshape(groups, hpg * hd, *trail), k.reshape(groups, hd, *trail),
                     v.reshape(groups, hd, *trail)]
            return torch.cat(parts, dim=1).reshape(-1, *trail)
        if self.kind == VOCAB:
            name = self.hf_names[0]
            rows = spec.padded_vocab_size(tp) // tp
            start, stop = tp_rank * rows, (tp_rank + 1) * rows
            real = reader.read(name, 0, min(start, spec.vocab_size), min(stop, spec.vocab_size))
            if real.shape[0] == rows:
                return real
            pad = torch.zeros(rows - real.shape[0], *real.shape[1:], dtype=real.dtype)
            return torch.cat([real, pad])
        raise AssertionError(self.kind)

    def to_hf(self, shards: list[torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
        """The HF tensors, from the shards of all TP ranks in rank order (an expert's: any one of them)."""
        if self.expert:
            shards = shards[:1]
        if self.kind in (REPLICATED, ROWS, COLUMNS):
            return {self.hf_names[0]: unshard(shards, self.kind)}
        if self.kind == VOCAB:
            return {self.hf_names[0]: torch.cat(shards)[: spec.vocab_size]}
        if self.kind == FC1:
            halves = [s.chunk(2, dim=0) for s in shards]
            gate, up = self.hf_names
            return {gate: torch.cat([g for g, _ in halves]), up: torch.cat([u for _, u in halves])}
        if self.kind == QKV:
            full = torch.cat(shards)
            hd, hpg = spec.head_dim, spec.heads_per_group
            trail = full.shape[1:]
            grouped = full.reshape(spec.num_kv_heads, (hpg + 2) * hd, *trail)
            q, k, v = grouped.split([hpg * hd, hd, hd], dim=1)
            q_name, k_name, v_name = self.hf_names
            return {q_name: q.reshape(-1, *trail), k_name: k.reshape(-1, *trail), v_name: v.reshape(-1, *trail)}
        raise AssertionError(self.kind)


def stage_layers(spec: ModelSpec, pp: int, pp_rank: int) -> range:
    """Global indices of the decoder layers held by pipeline stage ``pp_rank``."""
    per = spec.num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def local_experts(spec: ModelSpec, ep: int, ep_rank: int) -> range:
    """Global indices of the experts EP rank ``ep_rank`` holds (megatron's contiguous split)."""
    per = spec.moe.num_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def stage_param_maps(spec: ModelSpec, pp: int, pp_rank: int, ep: int = 1, ep_rank: int = 0) -> list[ParamMap]:
    """Every Megatron parameter of one pipeline stage (and, in sparse layers, of EP rank ``ep_rank``'s
    experts), in HF checkpoint order."""
    maps: list[ParamMap] = []
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        maps.append(ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB))
    for local, i in enumerate(stage_layers(spec, pp, pp_rank)):
        m, h = f"decoder.layers.{local}.", f"model.layers.{i}."
        attn = tuple(f"{h}self_attn.{p}_proj" for p in "qkv")
        maps.append(ParamMap(m + "input_layernorm.weight", (h + "input_layernorm.weight",), REPLICATED))
        if spec.mla is not None:
            maps += _mla_maps(spec, m, h)
        else:
            maps.append(ParamMap(m + "self_attention.linear_qkv.weight", tuple(a + ".weight" for a in attn), QKV))
        if spec.qkv_bias:
            maps.append(ParamMap(m + "self_attention.linear_qkv.bias", tuple(a + ".bias" for a in attn), QKV))
        if spec.qk_norm is not None:  # over all heads: each TP rank holds its heads' share of the weight
            kind = ROWS if spec.qk_norm == "full" else REPLICATED
            for q in "qk":
                maps.append(ParamMap(m + f"self_attention.{q}_layernorm.weight", (h + f"self_attn.{q}_norm.weight",),
                                     kind))
        maps.append(ParamMap(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), COLUMNS))
        if spec.linear_bias:  # added once, after the row-parallel sum
            maps.append(ParamMap(m + "self_attention.linear_proj.bias", (h + "self_attn.o_proj.bias",), REPLICATED))
        if spec.attention_sinks:  # one per head: TP splits them with the heads
            maps.append(ParamMap(m + "self_attention." + SINKS, (h + "self_attn.sinks",), ROWS))
        maps.append(ParamMap(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), REPLICATED))
        if spec.is_sparse(i):
            maps += _expert_maps(spec, m, h, ep, ep_rank)
            continue
        maps.append(ParamMap(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), FC1))
        maps.append(ParamMap(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), COLUMNS))
    if last:
        maps.append(ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED))
        if not spec.tied_embeddings:
            maps.append(ParamMap("output_layer.weight", ("lm_head.weight",), VOCAB))
        elif not first:
            # Tied weights on a separate last stage: megatron keeps a copy in output_layer,
            # read from embed_tokens and never exported (the first stage exports it).
            maps.append(ParamMap("output_layer.weight", ("model.embed_tokens.weight",), VOCAB))
    return maps


# megatron's multi-latent attention linears and norms -> transformers' DeepSeek-V3 names (below self_attention /
# self_attn): the up projections (and q_proj) column-parallel, their output rows split over TP; the down projections
# and the norms whole on every TP rank (mlora.models.mla)
MLA_NAMES = {"linear_q_proj": "q_proj", "linear_q_down_proj": "q_a_proj", "q_layernorm": "q_a_layernorm",
             "linear_q_up_proj": "q_b_proj", "linear_kv_down_proj": "kv_a_proj_with_mqa",
             "kv_layernorm": "kv_a_layernorm", "linear_kv_up_proj": "kv_b_proj"}


def _mla_maps(spec: ModelSpec, m: str, h: str) -> list[ParamMap]:
    """A layer's multi-latent attention maps but its output projection (megatron prefix ``m``, HF prefix ``h``)."""
    q = ("linear_q_proj",) if spec.mla.q_lora_rank is None else ("linear_q_down_proj", "q_layernorm", "linear_q_up_proj")
    return [ParamMap(f"{m}self_attention.{name}.weight", (f"{h}self_attn.{MLA_NAMES[name]}.weight",),
                     REPLICATED if name.endswith(("layernorm", "down_proj")) else ROWS)
            for name in (*q, "linear_kv_down_proj", "kv_layernorm", "linear_kv_up_proj")]


def _mla_shape(spec: ModelSpec, megatron_name: str) -> tuple[int, ...]:
    """The HF shape of multi-latent attention parameter ``megatron_name`` (one of :func:`_mla_maps`' or o_proj)."""
    mla, h, heads = spec.mla, spec.hidden_size, spec.num_heads
    shapes = {"linear_q_proj": (heads * mla.qk_head_dim, h), "linear_q_down_proj": (mla.q_lora_rank, h),
              "q_layernorm": (mla.q_lora_rank,), "linear_q_up_proj": (heads * mla.qk_head_dim, mla.q_lora_rank),
              "linear_kv_down_proj": (mla.kv_lora_rank + mla.qk_rope_head_dim, h), "kv_layernorm": (mla.kv_lora_rank,),
              "linear_kv_up_proj": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
              "linear_proj": (h, heads * mla.v_head_dim)}
    return shapes[megatron_name.split(".")[-2]]


def _expert_maps(spec: ModelSpec, m: str, h: str, ep: int, ep_rank: int) -> list[ParamMap]:
    """The router (with its correction bias where it has one), this EP rank's experts and the shared expert
    (TP-split, on every EP rank) with its gate where it has one, of one sparse layer (megatron prefix ``m``, HF
    prefix ``h``)."""
    block = f"{h}{spec.moe.block}."
    gate, up, down = spec.moe.projections
    router = f"{block}{spec.moe.router_name}."
    maps = [ParamMap(m + "mlp.router.weight", (router + "weight",), REPLICATED)]
    if spec.linear_bias:
        maps.append(ParamMap(m + "mlp.router.bias", (router + "bias",), REPLICATED))
    if spec.moe.expert_bias:
        maps.append(ParamMap(m + EXPERT_BIAS, (router + "e_score_correction_bias",), REPLICATED))
    for j, e in enumerate(local_experts(spec, ep, ep_rank)):
        x, hx = f"{m}mlp.experts.local_experts.{j}.", f"{block}experts.{e}."
        maps.append(ParamMap(x + "linear_fc1.weight", (f"{hx}{gate}.weight", f"{hx}{up}.weight"), FC1, expert=True))
        if spec.linear_bias:
            maps.append(ParamMap(x + "linear_fc1.bias", (f"{hx}{gate}.bias", f"{hx}{up}.bias"), FC1, expert=True))
        maps.append(ParamMap(x + "linear_fc2.weight", (f"{hx}{down}.weight",), COLUMNS, expert=True))
        if spec.linear_bias:
            maps.append(ParamMap(x + "linear_fc2.bias", (f"{hx}{down}.bias",), REPLICATED, expert=True))
    if spec.moe.shared_ffn_size is not None:
        x, hx = f"{m}{_SHARED}", f"{block}{spec.moe.shared_name}."
        maps.append(ParamMap(x + "linear_fc1.weight", (f"{hx}gate_proj.weight", f"{hx}up_proj.weight"), FC1))
        maps.append(ParamMap(x + "linear_fc2.weight", (f"{hx}down_proj.weight",), COLUMNS))
        if spec.moe.shared_gate:
            maps.append(ParamMap(x + "gate_weight", (f"{block}shared_expert_gate.weight",), REPLICATED))
    return maps


def is_export_copy(pm: ParamMap, spec: ModelSpec) -> bool:
    """True for the last stage's copy of tied embeddings, which HF checkpoints do not hold."""
    return spec.tied_embeddings and pm.megatron_name == "output_layer.weight"
