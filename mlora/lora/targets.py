"""Which (layer, projection) pairs an adapter adapts: PEFT-style target/exclude resolution.

Projections are named the HF way. Megatron's fused layers stand for several:
``linear_qkv`` = q, k, v; ``linear_proj`` = o; ``linear_fc1`` = gate, up; ``linear_fc2`` = down.
"""

from __future__ import annotations

from typing import Iterable

HF_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MEGATRON_MODULES = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Megatron path components -> HF ones, for layer-indexed Megatron patterns.
_PATH_ALIASES = {"decoder": "model", "self_attention": "self_attn"}
VALID_NAMES = ("all-linear", *HF_PROJECTIONS, *MEGATRON_MODULES)


def hf_module_name(layer: int, proj: str) -> str:
    """``model.layers.{layer}.self_attn.q_proj`` and friends."""
    return f"model.layers.{layer}.{PARENT[proj]}.{proj}"


def _patterns(spec: str | Iterable[str] | None) -> list[str]:
    if spec is None:
        return []
    if isinstance(spec, str):
        return [spec]
    return list(spec)


def _expand(pattern: str, num_layers: int) -> set[tuple[int, str]]:
    """The (layer, projection) pairs one pattern names; raises on unknown names."""
    pattern = pattern.strip()
    if pattern in ("all-linear", "all_linear"):
        return {(i, p) for i in range(num_layers) for p in HF_PROJECTIONS}
    prefix, _, last = pattern.rpartition(".")
    if last in MEGATRON_MODULES:
        projs = MEGATRON_MODULES[last]
        prefix = ".".join(_PATH_ALIASES.get(part, part) for part in prefix.split(".")) if prefix else ""
        if "mlp" in prefix.split(".") and last in ("linear_qkv", "linear_proj"):
            projs = ()
    elif last in HF_PROJECTIONS:
        projs = (last,)
    else:
        raise ValueError(f"unknown target module {pattern!r}; valid names: {', '.join(VALID_NAMES)} "
                         "(optionally with a layer path such as layers.0.self_attn.q_proj)")
    hits = set()
    for i in range(num_layers):
        for p in projs:
            full = hf_module_name(i, p)
            if not prefix or full.endswith("." + prefix + "." + p) or full == prefix + "." + p:
                hits.add((i, p))
    if not hits:
        raise ValueError(f"target module pattern {pattern!r} matches no module of this {num_layers}-layer model; "
                         f"module names look like {hf_module_name(0, 'q_proj')}")
    return hits


def resolve_targets(target_modules, exclude_modules, num_layers: int,
                    sparse_layers: Iterable[int] = ()) -> set[tuple[int, str]]:
    """The (layer, HF projection) pairs adapted by an adapter with these target/exclude specs;
    ``sparse_layers``: the MoE layers, whose experts adapters cannot target yet (a ValueError says so)."""
    targets = _patterns(target_modules)
    if not targets:
        raise ValueError(f"target_modules is empty; valid names: {', '.join(VALID_NAMES)}")
    chosen: set[tuple[int, str]] = set()
    for pattern in targets:
        chosen |= _expand(pattern, num_layers)
    for pattern in _patterns(exclude_modules):
        chosen -= _expand(pattern, num_layers)
    if not chosen:
        raise ValueError(f"exclude_modules={exclude_modules!r} removes every target of {target_modules!r}")
    sparse = sorted({i for i, p in chosen if PARENT[p] == "mlp"} & set(sparse_layers))
    if sparse:
        raise ValueError(f"target_modules={target_modules!r} reaches the experts of mixture-of-experts layers "
                         f"{sparse}: LoRA on experts is not built yet; target the attention projections "
                         "(q_proj, k_proj, v_proj, o_proj) or exclude those layers' mlp")
    return chosen
