"""Which (layer, projection) pairs an adapter adapts: PEFT-style target/exclude resolution.

Projections are named the HF way. Megatron's fused layers stand for several:
``linear_qkv`` = q, k, v; ``linear_proj`` = o; ``linear_fc1`` = gate, up; ``linear_fc2`` = down. Multi-head latent
attention (DeepSeek-V3) has ``q_a_proj``, ``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa``, ``kv_b_proj`` and
``o_proj`` instead of q/k/v/o (megatron's ``linear_q_down_proj``, ``linear_q_up_proj``, ``linear_q_proj``,
``linear_kv_down_proj``, ``linear_kv_up_proj``, ``linear_proj``).

An expert's projection is keyed by its HF path below the layer, ``mlp.experts.{e}.gate_proj`` (Mixtral:
``block_sparse_moe.experts.{e}.w1``), the per-expert name HF checkpoints and PEFT adapters use: one
adapter per expert and projection. ``gate_proj``/``up_proj``/``down_proj`` (and ``linear_fc1``/``linear_fc2``,
``all-linear``) reach every expert of a MoE layer as they reach a dense MLP.

A MoE layer's router is a target when named: ``gate`` (its HF name, ``mlp.gate``; Mixtral ``block_sparse_moe.gate``)
or megatron's ``router``, keyed by its HF path below the layer. ``all-linear`` leaves it out, as Megatron-Bridge's and
SkyRL's all-linear do: a router's LoRA moves which experts a token reaches, a choice to make by name.

The output layer (``lm_head``, megatron's ``output_layer``) is a target when named, never through ``all-linear``
(PEFT's all-linear leaves the output layer out too). It has no layer of its own: it is keyed ``(last layer,
"lm_head")``, so that it lives on the last pipeline stage, as the output layer does; its PEFT path is ``lm_head``.

A shared expert (Qwen2-MoE) is a dense MLP inside the MoE block, keyed ``mlp.shared_expert.gate_proj`` and so on
(its HF path below the layer, as PEFT names it): the MLP names reach it as well as every routed expert. Its
``shared_expert_gate`` (a ``[1, hidden]`` linear PEFT's all-linear would include) stays frozen and is no target:
mlora's all-linear is the projections, and a scalar gate's LoRA would not be low-rank.
"""

from __future__ import annotations

from typing import Iterable

HF_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GQA_PROJECTIONS = HF_PROJECTIONS[:4]  # grouped-query attention's
# multi-head latent attention's (DeepSeek-V3) besides o_proj, and q_proj where it has no q_lora_rank
MLA_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
MLA_DOWN_PROJECTIONS = ("q_a_proj", "kv_a_proj_with_mqa")  # whole on every TP rank (mlora.models.mla)
MEGATRON_MODULES = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
    "linear_q_proj": ("q_proj",),
    "linear_q_down_proj": ("q_a_proj",),
    "linear_q_up_proj": ("q_b_proj",),
    "linear_kv_down_proj": ("kv_a_proj_with_mqa",),
    "linear_kv_up_proj": ("kv_b_proj",),
}
PARENT = {**{p: "self_attn" for p in (*GQA_PROJECTIONS, *MLA_PROJECTIONS)},
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# every dense projection name in a layer's HF order (sorting and the names a target may use)
_ORDER = ("q_proj", "q_a_proj", "q_b_proj", "k_proj", "v_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
          "gate_proj", "up_proj", "down_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# Megatron path components -> HF ones, for layer-indexed Megatron patterns (megatron's shared_experts: the
# model's own name for its shared expert, see _hf_path)
_PATH_ALIASES = {"decoder": "model", "self_attention": "self_attn"}
LM_HEAD = "lm_head"  # the output layer's key and HF name
LM_HEAD_NAMES = (LM_HEAD, "output_layer")  # its HF and megatron names
VALID_NAMES = ("all-linear", *_ORDER, *MEGATRON_MODULES, LM_HEAD)


ROUTER = "router"  # the canonical projection of a MoE layer's router
ROUTER_NAMES = ("gate", "router")  # its HF and megatron names


def router_projection(moe) -> str:
    """The key of a MoE layer's router: its HF path below the layer, ``mlp.gate`` (Mixtral ``block_sparse_moe.gate``,
    gpt-oss ``mlp.router``)."""
    return f"{moe.block}.{moe.router_name}"


def is_router(proj: str) -> bool:
    """Whether the projection key ``proj`` is a MoE layer's router."""
    block, dot, leaf = proj.partition(".")
    return bool(dot) and leaf in ROUTER_NAMES


def shared_expert_projection(moe, k: int) -> str:
    """The key of projection ``k`` (0 gate, 1 up, 2 down) of a MoE layer's shared expert: its HF path below the
    layer, ``mlp.shared_expert.gate_proj`` (GLM-4.5: ``mlp.shared_experts.gate_proj``)."""
    return f"{moe.block}.{moe.shared_name}.{MLP_PROJECTIONS[k]}"


def expert_projection(moe, expert: int, k: int) -> str:
    """The key of projection ``k`` (0 gate, 1 up, 2 down) of expert ``expert``: its HF path below the layer."""
    return f"{moe.block}.experts.{expert}.{moe.projections[k]}"


def expert_of(proj: str) -> int | None:
    """The expert index of an expert projection's key, None for a dense projection."""
    parts = proj.split(".")
    return int(parts[-2]) if len(parts) == 4 and parts[1] == "experts" else None


def projection_order(proj: str, moe=None) -> tuple[int, int, int]:
    """Sort key of projections within a layer: attention, dense MLP, then experts by index, gate/up/down, then the
    shared expert's gate/up/down; a MoE layer's router before its experts (HF's order of the block's modules as
    checkpoints hold them)."""
    expert = expert_of(proj)
    if proj == LM_HEAD:  # after the last layer's modules
        return len(_ORDER) + 2, 0, 0
    if is_router(proj):
        return len(_ORDER), -1, 0
    if expert is None and "." in proj:  # the shared expert's
        return len(_ORDER) + 1, 0, MLP_PROJECTIONS.index(proj.rsplit(".", 1)[1])
    if expert is None:
        return _ORDER.index(proj), 0, 0
    leaf = proj.rsplit(".", 1)[1]
    return len(_ORDER), expert, (moe.projections.index(leaf) if moe is not None else 0)


def hf_module_name(layer: int, proj: str) -> str:
    """``model.layers.{layer}.self_attn.q_proj`` and friends (``model.layers.{layer}.mlp.experts.{e}.gate_proj``);
    the output layer's is ``lm_head``."""
    if proj == LM_HEAD:
        return LM_HEAD
    return f"model.layers.{layer}.{proj if '.' in proj else PARENT[proj] + '.' + proj}"


def attention_projections(spec) -> tuple[str, ...]:
    """The attention projections of ``spec``'s layers (a :class:`mlora.formats.hf_config.ModelSpec`): q/k/v/o, or
    multi-head latent attention's (q_a/q_b, or q without a q_lora_rank; kv_a_proj_with_mqa, kv_b_proj; o)."""
    if spec.mla is None:
        return GQA_PROJECTIONS
    q = ("q_proj",) if spec.mla.q_lora_rank is None else MLA_PROJECTIONS[:2]
    return (*q, *MLA_PROJECTIONS[2:], "o_proj")


def model_projections(num_layers: int, moe=None, attention: tuple[str, ...] = GQA_PROJECTIONS
                      ) -> dict[tuple[int, str], str]:
    """Every adaptable (layer, projection) of the model -> its canonical HF projection (an expert's gate is
    ``gate_proj`` whatever its family calls it); the output layer is ``(num_layers - 1, "lm_head")``. ``attention``:
    the layers' attention projections (:func:`attention_projections`)."""
    sparse = set(moe.sparse_layers) if moe is not None else set()
    out: dict[tuple[int, str], str] = {(num_layers - 1, LM_HEAD): LM_HEAD}
    for i in range(num_layers):
        for p in attention:
            out[(i, p)] = p
        if i not in sparse:
            for p in MLP_PROJECTIONS:
                out[(i, p)] = p
            continue
        out[(i, router_projection(moe))] = ROUTER
        for e in range(moe.num_experts):
            for k, p in enumerate(MLP_PROJECTIONS):
                out[(i, expert_projection(moe, e, k))] = p
        if moe.shared_ffn_size is not None:
            for k, p in enumerate(MLP_PROJECTIONS):
                out[(i, shared_expert_projection(moe, k))] = p
    return out


def _patterns(spec: str | Iterable[str] | None) -> list[str]:
    if spec is None:
        return []
    if isinstance(spec, str):
        return [spec]
    return list(spec)


def _hf_path(prefix: str, moe) -> str:
    """A megatron module path's HF spelling (``decoder.layers.3.mlp.shared_experts`` -> ``model.layers.3.mlp.`` and
    the model's shared expert name)."""
    aliases = {**_PATH_ALIASES, "shared_experts": moe.shared_name if moe is not None else "shared_experts"}
    return ".".join(aliases.get(part, part) for part in prefix.split(".")) if prefix else ""


def _expand(pattern: str, universe: dict[tuple[int, str], str], moe) -> set[tuple[int, str]]:
    """The (layer, projection) pairs one pattern names; raises on unknown names."""
    pattern = pattern.strip()
    if pattern in ("all-linear", "all_linear"):
        return {key for key, canonical in universe.items() if canonical not in (ROUTER, LM_HEAD)}
    prefix, _, last = pattern.rpartition(".")
    if last in LM_HEAD_NAMES and not prefix:
        return {key for key, canonical in universe.items() if canonical == LM_HEAD}
    leaves = MLP_PROJECTIONS if moe is None else tuple(dict.fromkeys((*MLP_PROJECTIONS, *moe.projections)))
    if last in MEGATRON_MODULES:
        projs = set(MEGATRON_MODULES[last])
        prefix = _hf_path(prefix, moe)
        if "mlp" in prefix.split(".") and last in ("linear_qkv", "linear_proj"):
            projs = set()
    elif last in _ORDER or last in leaves:
        projs = {last}
    elif last in ROUTER_NAMES and moe is not None:
        projs = {ROUTER}  # a router, whatever its HF name: matched below against the HF path
        prefix = _hf_path(prefix, moe)
    elif (last in ("shared_expert_gate", "gate_weight") and moe is not None and moe.shared_ffn_size is not None
          and moe.shared_gate):
        raise ValueError(f"target module {pattern!r}: the shared expert's sigmoid gate (output width 1) is not a LoRA "
                         "target; the shared expert's projections are (shared_expert.gate_proj, .up_proj, "
                         ".down_proj, or gate_proj/up_proj/down_proj for every MLP)")
    else:
        valid = (*VALID_NAMES, *(n for n in leaves if n not in VALID_NAMES),
                 *(f"{n} (the MoE router)" for n in ROUTER_NAMES if moe is not None))
        raise ValueError(f"unknown target module {pattern!r}; valid names: {', '.join(valid)} "
                         "(optionally with a layer path such as layers.0.self_attn.q_proj)")
    hits = set()
    for (i, proj), canonical in universe.items():
        leaf = proj.rsplit(".", 1)[-1]
        named = projs & {canonical, leaf}  # an expert's gate answers to gate_proj and to its own name (w1)
        if not named:
            continue
        stem = hf_module_name(i, proj)[:-len(leaf)]
        if not prefix or any((stem + p).endswith("." + prefix + "." + p) or stem + p == prefix + "." + p
                             for p in named):
            hits.add((i, proj))
    if not hits:
        raise ValueError(f"target module pattern {pattern!r} matches no module of this {len({i for i, _ in universe})}"
                         f"-layer model; module names look like {hf_module_name(0, 'q_proj')}")
    return hits


def resolve_targets(target_modules, exclude_modules, num_layers: int, moe=None,
                    attention: tuple[str, ...] = GQA_PROJECTIONS) -> set[tuple[int, str]]:
    """The (layer, projection) pairs adapted by an adapter with these target/exclude specs; ``moe``: the
    model's :class:`mlora.formats.hf_config.MoESpec` (None: dense), whose experts the MLP names reach;
    ``attention``: the layers' attention projections (:func:`attention_projections`)."""
    targets = _patterns(target_modules)
    if not targets:
        raise ValueError(f"target_modules is empty; valid names: {', '.join(VALID_NAMES)}")
    universe = model_projections(num_layers, moe, attention)
    chosen: set[tuple[int, str]] = set()
    for pattern in targets:
        chosen |= _expand(pattern, universe, moe)
    for pattern in _patterns(exclude_modules):
        chosen -= _expand(pattern, universe, moe)
    if not chosen:
        raise ValueError(f"exclude_modules={exclude_modules!r} removes every target of {target_modules!r}")
    return chosen
