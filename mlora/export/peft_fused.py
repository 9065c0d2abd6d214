"""PEFT adapters of transformers 5's stacked experts (``LoraConfig(target_parameters=[...])``), read as mlora's
per-expert LoRA.

transformers 5 holds a MoE layer's experts as two 3-D parameters, ``mlp.experts.gate_up_proj`` ``[E, 2·ffn, hidden]``
(expert e's gate rows, then its up rows) and ``mlp.experts.down_proj`` ``[E, hidden, ffn]``. PEFT 0.21 adapts such a
parameter with its ``ParamWrapper``: one ``lora_A`` ``[r·E, in]`` and one ``lora_B`` ``[out, r·E]`` (``in``/``out``:
hidden and 2·ffn for gate_up_proj, ffn and hidden for down_proj), and expert e's delta is

    ΔW_e = s · B_e · A_e,  A_e = lora_A[e·r:(e+1)·r],  B_e = lora_B[:, e::E]  (lora_B.reshape(out, r, E)[..., e])

with s = alpha / r (``alpha / √r`` with rslora), PEFT's ``get_delta_weight``. Its rows split like the weight's:
``B_e[:ffn]`` is the gate's, ``B_e[ffn:]`` the up's, both with the same A_e. So each expert's gate, up and down get
LoRA of rank r exactly: gate ``(A_e, B_e[:ffn])``, up ``(A_e, B_e[ffn:])``, down ``(A_e, B_e)``.

The saved tensor names do not say which parameter a factor adapts (``mlp.experts.lora_A.weight``; the first
parameter targeted sits under ``mlp.experts.base_layer``): the shapes do, since gate_up_proj's factors are
``[·, hidden]`` and ``[2·ffn, ·]`` and down_proj's ``[·, ffn]`` and ``[hidden, ·]``.

mlora gives every expert projection one rank and scales it by one alpha. Where an adapter's two stacked parameters
have other ranks or scalings (``rank_pattern``/``alpha_pattern``, as PEFT writes after converting per-expert files:
gate_up_proj at 2r and 2·alpha), the experts take the largest rank, the smaller one's factors are padded with zero
rows of A and zero columns of B (the same function, and zero gradients), and B is multiplied by PEFT's scaling over
mlora's, so ``s·B·A`` is PEFT's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mlora.export.peft_files import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    FUSED_EXPERTS_FACTOR,
    pattern_value,
    peft_tensor_name,
)
from mlora.formats.checkpoint_reader import CheckpointError, CheckpointReader
from mlora.formats.fused_experts import DOWN, FUSED_BLOCK, GATE_UP, fused_expert_name
from mlora.lora.config import LoraConfig
from mlora.lora.targets import (
    attention_projections,
    expert_of,
    expert_projection,
    hf_module_name,
    is_router,
    model_projections,
)

_PROJECTIONS = {GATE_UP: (0, 1), DOWN: (2,)}  # which of an expert's gate (0), up (1), down (2) each one carries


@dataclass(frozen=True)
class FusedFactor:
    """The LoRA of one stacked expert parameter in a PEFT file: ``lora_A`` ``[rank·E, in]``, ``lora_B``
    ``[out, rank·E]``."""

    layer: int
    param: str  # gate_up_proj or down_proj
    a_name: str
    b_name: str
    rank: int

    @property
    def path(self) -> str:
        """The parameter's path in transformers 5's model (what ``target_parameters`` and the patterns match)."""
        return fused_expert_name(self.layer, self.param)


def _shapes(spec) -> dict[str, tuple[int, int]]:
    """Each stacked parameter's (in, out) as PEFT's ParamWrapper sees it."""
    return {GATE_UP: (spec.hidden_size, 2 * spec.moe.ffn_size), DOWN: (spec.moe.ffn_size, spec.hidden_size)}


def _rename_routers(reader: CheckpointReader, spec) -> None:
    """Key a router's LoRA by the block mlora names it by: transformers 5 (and so PEFT on it) calls Mixtral's
    ``block_sparse_moe`` ``mlp``, which its checkpoints and mlora's PEFT files do not."""
    moe = spec.moe
    if moe is None or moe.block == FUSED_BLOCK:
        return
    for i in moe.sparse_layers:
        for factor in "AB":
            name = f"base_model.model.model.layers.{i}.{FUSED_BLOCK}.gate.lora_{factor}.weight"
            if name in reader.entries:
                reader.entries[f"base_model.model.model.layers.{i}.{moe.block}.gate.lora_{factor}.weight"] = \
                    reader.entries.pop(name)


def _identify(reader: CheckpointReader, spec, layer: int, names: dict[str, str], file: Path) -> FusedFactor:
    """The stacked parameter whose LoRA ``names`` (factor -> tensor name) holds, told by the shapes."""
    if set(names) != {"A", "B"}:
        raise CheckpointError(f"{file}: {next(iter(names.values()))} has no lora_{'B' if 'A' in names else 'A'} "
                              "beside it")
    if not spec.is_sparse(layer):
        raise CheckpointError(f"{file}: {names['A']} adapts stacked experts in layer {layer}, which this base holds "
                              f"as a dense MLP (its MoE layers: {list(spec.sparse_layers)}): an adapter for another "
                              "base?")
    a, b = reader.entry(names["A"]).shape, reader.entry(names["B"]).shape
    experts = spec.moe.num_experts
    shapes = _shapes(spec)
    fits = [p for p, (fan_in, fan_out) in shapes.items() if len(a) == len(b) == 2 and a[1] == fan_in
            and b[0] == fan_out]
    if len(fits) != 1 or a[0] != b[1] or a[0] == 0 or a[0] % experts:
        need = "; ".join(f"{p}: lora_A [r·{experts}, {fan_in}] and lora_B [{fan_out}, r·{experts}]"
                         for p, (fan_in, fan_out) in shapes.items())
        raise CheckpointError(f"{file}: {names['A']} has shape {tuple(a)} and {names['B']} {tuple(b)}, which fit no "
                              f"stacked expert parameter of this base's layer {layer} ({need}): an adapter for "
                              "another base?")
    return FusedFactor(layer, fits[0], names["A"], names["B"], a[0] // experts)


def _check_target_parameters(raw: dict, spec, factors: list[FusedFactor], directory: Path) -> None:
    """Every ``target_parameters`` entry names a parameter mlora adapts, and every stacked parameter the file
    adapts is named by one (PEFT's rule: the path, or a suffix of it after a dot)."""
    targets = list(raw.get("target_parameters") or [])

    def named(path: str, target: str) -> bool:
        return path == target or path.endswith("." + target)

    known = [fused_expert_name(i, p) for i in spec.sparse_layers for p in (GATE_UP, DOWN)]
    for (i, proj) in model_projections(spec.num_layers, spec.moe, attention_projections(spec)):
        if is_router(proj):  # transformers 5's router module, whatever the checkpoint calls its block
            known.append(f"model.layers.{i}.{FUSED_BLOCK}.{spec.moe.router_name}.weight")
        elif expert_of(proj) is None:
            known.append(f"{hf_module_name(i, proj)}.weight")
    for target in targets:
        if not isinstance(target, str) or not any(named(path, target) for path in known):
            experts = "'mlp.experts.gate_up_proj', 'mlp.experts.down_proj' (the stacked experts), 'mlp.gate.weight' " \
                      "(the router), " if spec.moe is not None else ""
            raise ValueError(f"{directory / ADAPTER_CONFIG}: target_parameters entry {target!r} names no parameter of "
                             f"this {spec.architecture} that mlora imports; valid: {experts}a projection's weight "
                             "such as 'self_attn.q_proj.weight', each optionally with its layer path such as "
                             f"'model.layers.0.{'mlp.experts.gate_up_proj' if experts else 'self_attn.q_proj.weight'}'")
    for f in factors:
        if not any(named(f.path, target) for target in targets):
            raise CheckpointError(f"{directory / ADAPTER_WEIGHTS}: {f.a_name} is LoRA of {f.path} (by its shape), but "
                                  f"target_parameters in {ADAPTER_CONFIG} ({targets}) does not name it")


class FusedExperts:
    """The stacked-expert LoRA of one PEFT adapter file (none: an adapter of per-expert or dense modules), read as
    mlora's per-expert factors.

    :meth:`find` takes the tensors from the reader's names and shapes; :meth:`config` checks them against
    ``adapter_config.json`` and gives the adapter's :class:`LoraConfig`; :meth:`read` returns one per-expert factor by
    its canonical PEFT name (:func:`mlora.export.peft_files.peft_tensor_name`), reading an expert's rows of A and each
    B once per rank (B's columns of one expert are strided, so a rank reads B whole and keeps the latest two)."""

    def __init__(self, reader: CheckpointReader, spec, factors: list[FusedFactor], directory: Path) -> None:
        self.reader, self.spec, self.factors, self.directory = reader, spec, factors, directory
        self.tensor_names = frozenset(n for f in factors for n in (f.a_name, f.b_name))
        self._scaling: dict[tuple[int, str], float] = {}
        self._cfg: LoraConfig | None = None
        self._b_cache: dict[str, torch.Tensor] = {}
        # canonical per-expert PEFT name -> (its stacked factor, expert, projection index 0/1/2, is A)
        self._by_name: dict[str, tuple[FusedFactor, int, int, bool]] = {}
        for f in factors:
            for e in range(spec.moe.num_experts):
                for k in _PROJECTIONS[f.param]:
                    proj = expert_projection(spec.moe, e, k)
                    self._by_name[peft_tensor_name(f.layer, proj, "A")] = (f, e, k, True)
                    self._by_name[peft_tensor_name(f.layer, proj, "B")] = (f, e, k, False)

    @classmethod
    def find(cls, reader: CheckpointReader, spec, path: Path) -> "FusedExperts":
        """The stacked-expert factors in the adapter file of ``reader`` (``path``: its directory, for messages).
        Renames Mixtral's router LoRA from transformers 5's block name in the reader (see :func:`_rename_routers`)."""
        file = path / ADAPTER_WEIGHTS
        _rename_routers(reader, spec)
        groups: dict[tuple[int, int], dict[str, str]] = {}
        for name in reader.entries:
            m = FUSED_EXPERTS_FACTOR.match(name)
            if m is not None:
                groups.setdefault((int(m.group(1)), m.group(2).count(".base_layer")), {})[m.group(3)] = name
        if groups and spec.moe is None:
            raise CheckpointError(f"{file}: {next(iter(groups.values()))['A']} adapts stacked experts, and "
                                  f"{spec.architecture} has none: an adapter for another base?")
        factors: dict[tuple[int, str], FusedFactor] = {}
        for (layer, _), names in sorted(groups.items()):
            f = _identify(reader, spec, layer, names, file)
            if (layer, f.param) in factors:
                raise CheckpointError(f"{file}: {factors[(layer, f.param)].a_name} and {f.a_name} both fit "
                                      f"{f.path}; an adapter holds one LoRA per parameter")
            factors[(layer, f.param)] = f
        return cls(reader, spec, list(factors.values()), path)

    def __bool__(self) -> bool:
        return bool(self.factors)

    @property
    def parameter_paths(self) -> list[str]:
        """The stacked parameters adapted, by their paths in transformers 5's model."""
        return [f.path for f in self.factors]

    def modules(self) -> set[tuple[int, str]]:
        """mlora's (layer, projection) keys of every expert projection the stacked factors carry."""
        return {(f.layer, expert_projection(self.spec.moe, e, k)) for f in self.factors
                for e in range(self.spec.moe.num_experts) for k in _PROJECTIONS[f.param]}

    def config(self, cfg: LoraConfig) -> LoraConfig:
        """``cfg`` (read with :meth:`parameter_paths`) with the experts' rank of the stacked factors, after checking
        each factor's rank against ``r``/``rank_pattern`` and taking its scaling from ``lora_alpha``/``alpha_pattern``
        as PEFT does (its ``_create_and_replace``)."""
        raw = cfg.extra
        if raw.get("target_parameters") or self.factors:
            _check_target_parameters(raw, self.spec, self.factors, self.directory)
        if not self.factors:
            return cfg
        for f in self.factors:
            rank = pattern_value(raw.get("rank_pattern"), f.path, raw["r"])
            if rank != f.rank:
                shape, experts = tuple(self.reader.entry(f.a_name).shape), self.spec.moe.num_experts
                raise CheckpointError(f"{self.directory / ADAPTER_WEIGHTS}: {f.a_name} (LoRA of {f.path}) has shape "
                                      f"{shape}: rank {f.rank} per expert ({shape[0]} rows / {experts} experts), "
                                      f"but {ADAPTER_CONFIG} gives it r={rank}")
            alpha = float(pattern_value(raw.get("alpha_pattern"), f.path, raw.get("lora_alpha", raw["r"])))
            self._scaling[(f.layer, f.param)] = alpha / (math.sqrt(f.rank) if cfg.use_rslora else f.rank)
        self._cfg = replace(cfg, expert_rank=max(f.rank for f in self.factors))
        return self._cfg

    def _b(self, name: str) -> torch.Tensor:
        """Stacked factor B ``name``, whole: the latest two read are kept (an MoE layer's gate_up_proj and
        down_proj), since every local expert takes columns of it."""
        if name not in self._b_cache:
            if len(self._b_cache) >= 2:
                self._b_cache.pop(next(iter(self._b_cache)))
            self._b_cache[name] = self.reader.read(name)
        return self._b_cache[name]

    def read(self, name: str) -> torch.Tensor | None:
        """The full per-expert factor with canonical PEFT name ``name`` (an expert's factors are whole on the ranks
        holding it), or None when the stacked factors do not carry it. Call :meth:`config` first."""
        hit = self._by_name.get(name)
        if hit is None:
            return None
        if self._cfg is None:
            raise RuntimeError("FusedExperts.read before FusedExperts.config")
        f, e, k, is_a = hit
        rank, experts, ffn = self._cfg.rank_of(True), self.spec.moe.num_experts, self.spec.moe.ffn_size
        if is_a:
            a = self.reader.read(f.a_name, 0, e * f.rank, (e + 1) * f.rank)
            return torch.cat([a, a.new_zeros(rank - f.rank, a.shape[1])]) if rank > f.rank else a
        b = self._b(f.b_name).reshape(-1, f.rank, experts)[:, :, e]  # PEFT's lora_B.reshape(out, r, E)[..., e]
        if f.param == GATE_UP and self.spec.moe.gpt_oss:  # gpt-oss interleaves them: gate j at row 2j, up at 2j + 1
            b = b[k::2]
        elif f.param == GATE_UP:  # the gate's rows, then the up's, as in gate_up_proj
            b = b[:ffn] if k == 0 else b[ffn:]
        b = b.contiguous()
        if rank > f.rank:
            b = torch.cat([b, b.new_zeros(b.shape[0], rank - f.rank)], dim=1)
        ratio = self._scaling[(f.layer, f.param)] / self._cfg.scaling_of(True)
        # (in float32 at least: a bfloat16 B times the ratio would round)
        return b if ratio == 1.0 else b.to(torch.promote_types(b.dtype, torch.float32)) * ratio
