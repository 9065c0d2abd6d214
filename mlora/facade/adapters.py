"""Many named adapters on one frozen base: add, load (PEFT), select, stack, gather.

:class:`AdapterHost` is mixed into :class:`mlora.MLoraModel`; it walks the LoRA linears of this
rank's megatron model, creates one :class:`LoraBranch` per adapter on each adapted linear, and
converts between this rank's shards and canonical PEFT tensors
(``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ...).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from mlora.export.peft_files import (
    ADAPTER_WEIGHTS,
    check_peft_dir,
    check_peft_shapes,
    peft_adapter_config,
    peft_modules,
    peft_tensor_name,
    read_peft_config,
    write_peft_adapter_sharded,
)
from mlora.export.peft_fused import FusedExperts
from mlora.export.peft_gpt_oss import (
    GATE_UP,
    adapted_params,
    peft_stacked,
    stack_gate_up,
    stacked_layout,
    stacked_names,
)
from mlora.export.sharded_write import select_shards
from mlora.formats.checkpoint_reader import CheckpointError, CheckpointReader
from mlora.formats.safetensors_writer import TensorShard
from mlora.formats.weight_map import REPLICATED, local_experts, read_shard, shard, stage_layers, unshard
from mlora.lora.config import INIT_METHODS, LoraConfig, derive_seed, master_dtype
from mlora.lora.layers import (
    DropoutKey,
    LoraBranch,
    LoraHost,
    LoraSite,
    has_tp_partial_grad,
    is_expert_param,
    stacked_b,
)
from mlora.lora.sites import check_lm_head, factor_kinds, factor_shapes, model_sites
from mlora.lora.targets import (
    MLA_DOWN_PROJECTIONS,
    MLP_PROJECTIONS,
    attention_projections,
    expert_of,
    expert_projection,
    hf_module_name,
    is_router,
    projection_order,
    resolve_targets,
)


@dataclass
class AdapterInfo:
    """What the model knows about one adapter."""

    config: LoraConfig
    trainable: bool
    modules: frozenset  # (layer, HF projection) pairs, over the whole model


def _draw_a(method: str, shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """The full ``[rank, in]`` A for ``LoraConfig.init_method`` (float64; see LoraConfig)."""
    rank, fan_in = shape
    if method == "kaiming":  # kaiming_uniform_(a=√5): gain √(1/3) · √(3/in) = 1/√in
        return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) / fan_in ** 0.5
    if method == "zero":
        return torch.zeros(shape, dtype=torch.float64)
    std = {"gaussian": 1.0 / rank, "xavier": (2.0 / (fan_in + rank)) ** 0.5, "normal": 0.2}.get(method)
    if std is None:
        raise ValueError(f"LoRA init_method={method!r} is invalid; valid: {', '.join(INIT_METHODS)}")
    return torch.randn(shape, generator=g, dtype=torch.float64) * std


def _init_factors(cfg: LoraConfig, name: str, site: LoraSite, sub: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Full (unsharded) A drawn with ``cfg.init_method`` and B = 0.

    The stream is keyed by (seed, adapter name, layer, HF projection) through a stable hash, so
    q_proj and gate_proj (same input width) or two adapters built from one config never share an
    A, and every mesh draws the same full matrix before sharding it.
    """
    a_shape, b_shape = factor_shapes(site, sub, cfg.rank_of(site.expert is not None))
    g = torch.Generator().manual_seed(derive_seed(cfg.seed, name, site.layer, sub, "init_A"))
    return _draw_a(cfg.init_method, a_shape, g), torch.zeros(b_shape, dtype=torch.float64)


def _check_expert_dropout(config: LoraConfig, modules) -> None:
    """Dropout masks are keyed by token rows, and the MoE dispatcher reorders an expert's tokens by routing
    and EP rank, so masks on experts would change with the mesh; PEFT's expert LoRA (``target_parameters``)
    refuses dropout too. A router under SP reads its rank's slice of the tokens, whose masks would change with
    TP, and PEFT adapts it through ``target_parameters`` as well."""
    if config.dropout > 0 and any(expert_of(proj) is not None for _, proj in modules):
        raise ValueError(f"LoRA dropout={config.dropout} on mixture-of-experts experts is not supported (PEFT "
                         "refuses it on experts too): use dropout 0, or exclude the experts (exclude_modules "
                         "gate_proj/up_proj/down_proj of the MoE layers)")
    if config.dropout > 0 and any(is_router(proj) for _, proj in modules):
        raise ValueError(f"LoRA dropout={config.dropout} on a mixture-of-experts router is not supported (PEFT "
                         "adapts the router as a parameter and refuses dropout there too): use dropout 0, or leave "
                         "the router (gate) out of target_modules")


def _check_duplicated_dropout(config: LoraConfig, modules, tp: int) -> None:
    """Multi-latent attention's down projections read each TP rank's slice of the sequence under SP
    (:class:`mlora.models.mla.LoraDuplicatedLinear`), so at TP > 1 their dropout masks would change with the mesh."""
    down = sorted({proj for _, proj in modules if proj in MLA_DOWN_PROJECTIONS})
    if config.dropout > 0 and tp > 1 and down:
        raise ValueError(f"LoRA dropout={config.dropout} on multi-latent attention's down projections {down} at tp={tp} "
                         "is not supported (each TP rank projects its slice of the sequence, so the masks would "
                         "change with the mesh): use dropout 0, tp=1, or exclude them (exclude_modules)")


def _check_expert_rank(config: LoraConfig, modules) -> None:
    """An ``expert_rank`` applies to experts only: on an adapter without any it would do nothing."""
    if config.expert_rank is not None and not any(expert_of(proj) is not None for _, proj in modules):
        raise ValueError(f"LoRA expert_rank={config.expert_rank} but the adapter adapts no MoE expert (a dense base, "
                         "or targets without the experts' gate_proj/up_proj/down_proj): leave expert_rank unset")


def _warn_what_peft_drops(name: str, modules, spec) -> None:
    """Say when an adapter of a mixture of experts has LoRA that PEFT 0.21 on transformers 5 drops when it loads it.

    PEFT's v5 conversion (``peft.utils.transformers_weight_conversion``) maps every gate/up/down target onto the
    stacked experts for Mixtral and the model types transformers converts like ``qwen2_moe`` (Qwen3-MoE, OLMoE), so
    the dense MLP layers of such a model (``mlp_only_layers``) cannot carry LoRA there. ``qwen2_moe`` itself is not
    among those types (PEFT looks its conversion pattern up by the model type and finds none), so on Qwen2-MoE
    gate/up/down stay plain module targets: the shared expert's and the dense MLP's LoRA load, and every routed
    expert's is dropped without a word."""
    if spec.moe is None:
        return
    if spec.architecture == "Qwen2MoeForCausalLM":
        routers = sorted({i for i, proj in modules if is_router(proj)})
        if routers:
            warnings.warn(f"adapter {name!r} adapts the router of layers {routers} of a Qwen2-MoE model: mlora, vLLM "
                          "and its merged export apply it, but PEFT 0.21 with transformers 5 refuses to load the "
                          "adapter at all (its Qwen2MoeTopKRouter is no module type PEFT adapts); leave the router "
                          "(gate) out of target_modules to get an adapter PEFT loads", stacklevel=3)
        experts = sorted({i for i, proj in modules if expert_of(proj) is not None})
        if experts:
            warnings.warn(f"adapter {name!r} adapts the routed experts of layers {experts} of a Qwen2-MoE model: mlora "
                          "and its merged export apply them, but PEFT 0.21 with transformers 5 does not convert "
                          "Qwen2-MoE adapters onto the stacked experts and drops their LoRA when loading the adapter "
                          "(the attention's, shared expert's and dense MLP's load); exclude the experts (e.g. "
                          "target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj', 'shared_expert.gate_proj', "
                          "'shared_expert.up_proj', 'shared_expert.down_proj']) to get an adapter PEFT loads whole",
                          stacklevel=3)
        return
    dense = sorted({i for i, proj in modules if proj in MLP_PROJECTIONS})
    if dense:
        warnings.warn(f"adapter {name!r} adapts the dense MLP of layers {dense} of a mixture-of-experts model: mlora "
                      "and its merged export apply it, but PEFT 0.21 with transformers 5 maps gate_proj/up_proj/"
                      "down_proj onto the experts and drops it when loading the adapter; exclude those layers' mlp "
                      "to get an adapter PEFT loads", stacklevel=3)


def peft_refusals(modules, spec) -> list[str]:
    """Why PEFT 0.21 on transformers 5 cannot load an adapter of these (layer, projection) ``modules`` as mlora saves
    it (empty: it can). On the MoE models whose experts transformers 5 stacks and PEFT converts (Mixtral, and the
    types converted like ``qwen2_moe``: Qwen3-MoE, OLMoE) one MoE layer's expert LoRA becomes one LoRA per stacked
    parameter (``gate_up_proj``: gate and up side by side; ``down_proj``), of every expert. So in each MoE layer:
    gate and up adapted together or not at all (PEFT refuses one alone: "without also targeting"); a projection
    adapted on every expert or on none (one expert's factors: PEFT's size mismatch); and gate/up only with down
    (PEFT loads gate_up_proj's LoRA without down_proj's with missing keys and other logits). A shared expert's
    LoRA (GLM-4.5's ``shared_experts``) PEFT maps onto the routed experts too: refused.
    Measured in ``tests/test_peft_moe_refusals.py`` with PEFT itself. Qwen2-MoE's experts PEFT does not convert
    (:func:`_warn_what_peft_drops` says so)."""
    moe = spec.moe
    if moe is None or spec.architecture == "Qwen2MoeForCausalLM":
        return []
    gate, up, down = moe.projections
    adapted: dict[int, dict[str, set[int]]] = {}
    shared: set[int] = set()
    for layer, proj in modules:
        expert = expert_of(proj)
        if expert is not None:
            adapted.setdefault(layer, {}).setdefault(proj.rsplit(".", 1)[1], set()).add(expert)
        elif f".{moe.shared_name}." in proj:
            shared.add(layer)
    alone: dict[tuple[str, str], list[int]] = {}
    partial: list[str] = []
    no_down: list[int] = []
    for layer, by_leaf in sorted(adapted.items()):
        if (gate in by_leaf) != (up in by_leaf):
            alone.setdefault((gate, up) if gate in by_leaf else (up, gate), []).append(layer)
        partial += [f"{leaf} of experts {sorted(by_leaf[leaf])} in layer {layer}" for leaf in moe.projections
                    if 0 < len(by_leaf.get(leaf, ())) < moe.num_experts]
        if (gate in by_leaf or up in by_leaf) and down not in by_leaf:
            no_down.append(layer)
    problems = [f"the experts' {one} without {other} (layers {layers}): PEFT fuses them into gate_up_proj; target "
                "both or neither" for (one, other), layers in alone.items()]
    if partial:
        problems.append(", ".join(partial) + f" but not of all {moe.num_experts}: PEFT stacks every expert of a layer "
                        "into one parameter; adapt a projection on every expert of a layer or on none")
    if no_down:
        problems.append(f"the experts' {gate}/{up} without {down} (layers {no_down}): PEFT 0.21 loads gate_up_proj's "
                        f"LoRA without down_proj's wrongly (missing keys, other logits); target {down} too")
    if shared:
        problems.append(f"the {moe.shared_name}' projections (layers {sorted(shared)}): PEFT 0.21 maps their "
                        "gate_proj/up_proj/down_proj onto the routed experts' stacked parameters and loads other "
                        f"logits; leave {moe.shared_name} out (e.g. exclude_modules=['{moe.shared_name}.gate_proj', "
                        f"'{moe.shared_name}.up_proj', '{moe.shared_name}.down_proj'])")
    return problems


class AdapterHost:
    """Adapter management for a model that has ``gpt``, ``spec``, ``mesh``, ``dtype``, ``lora_compute_dtype``
    and ``base_weight``.

    Factors are held in :attr:`adapter_dtype` (float32 masters under a 16-bit base); each branch
    computes in ``lora_compute_dtype``. Saved adapters (exports and checkpoints) hold the masters, as
    PEFT saves its float32 adapters of a bf16 model; vLLM casts them to its own LoRA dtype on load.
    """

    adapters: dict[str, AdapterInfo]

    @property
    def adapter_dtype(self) -> torch.dtype:
        """dtype of every adapter factor (and of the scalar heads): see :func:`mlora.lora.config.master_dtype`."""
        return master_dtype(self.dtype)

    def _lora_linears(self) -> Iterator[torch.nn.Module]:
        for module in self.gpt.modules():
            # the local spec's LoRA linears (this EP rank's experts' included) and the TE spec's (mlora.models.te)
            if isinstance(module, LoraHost) and module.lora_site is not None:
                yield module

    # ------------------------------------------------------------- creation
    def _check_new_name(self, name: str) -> None:
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"adapter name {name!r} is invalid: use a non-empty string without dots")
        if name in self.adapters:
            raise ValueError(f"an adapter named {name!r} already exists; existing: {sorted(self.adapters)}")

    def _install(self, name: str, cfg: LoraConfig, modules: set, trainable: bool, factors, key: str | None = None
                 ) -> None:
        """Create the branches of this stage. ``factors(site, sub) -> (A_local, B_local)``; ``key``: the name its
        dropout masks are drawn by (default ``name``)."""
        for linear in self._lora_linears():
            site = linear.lora_site
            subs = tuple(s for s in site.subs if (site.layer, s) in modules)
            if not subs:
                continue
            a_parts, b_parts = [], []
            for sub in subs:
                a, b = factors(site, sub)
                a_parts.append(a)
                b_parts.append(b)
            device = self.mesh.device  # (a tied output layer at PP 1 holds no weight: it borrows the embedding's)
            expert = site.expert is not None
            branch = LoraBranch(subs, cfg.rank_of(expert), cfg.scaling_of(expert), cfg.dropout,
                                torch.cat(a_parts).to(device=device, dtype=self.adapter_dtype),
                                [b.to(device=device, dtype=self.adapter_dtype) for b in b_parts], trainable,
                                parallel="expert" if expert else site.parallel, dropout_key=self._dropout_key(key or name, cfg, site),
                                compute_dtype=self.lora_compute_dtype)
            branch.train(self.training)
            linear.lora[name] = branch
        self.adapters[name] = AdapterInfo(cfg, trainable, frozenset(modules))
        self._apply_active()

    def _dropout_key(self, name: str, cfg: LoraConfig, site: LoraSite) -> DropoutKey:
        """Mesh-independent dropout masks: keyed by the module, not the rank; a row-parallel rank
        applies its TP slice of the full-input mask."""
        offset = self.mesh.tp_rank * site.in_local if site.parallel == "row" and site.expert is None else 0
        return DropoutKey(seed=cfg.seed, adapter=name, layer=site.layer, stream=self.mesh.dp_rank,
                          in_full=site.in_full, in_offset=offset)

    def add_adapter(self, name: str, config: LoraConfig, trainable: bool = True, key: str | None = None) -> None:
        """Add a freshly initialised adapter (B = 0, so the model's output is unchanged).

        ``key``: the name its random draws (A's initialisation, dropout masks) are keyed by, with
        ``config.seed``; default ``name``. Experiments name their adapters ``e/policy`` but key them
        ``policy``, so that each starts exactly where a run of its own with the same seed would."""
        self._check_new_name(name)
        modules = resolve_targets(config.target_modules, config.exclude_modules, self.spec.num_layers,
                                  self.spec.moe, attention_projections(self.spec))
        _check_expert_dropout(config, modules)
        _check_duplicated_dropout(config, modules, self.mesh.tp)
        _check_expert_rank(config, modules)
        check_lm_head(self.spec, self.mesh.tp, modules)
        tp, tp_rank = self.mesh.tp, self.mesh.tp_rank

        def factors(site: LoraSite, sub: str):
            a, b = _init_factors(config, key or name, site, sub)
            a_kind, b_kind = factor_kinds(site)
            return shard(a, a_kind, tp, tp_rank), shard(b, b_kind, tp, tp_rank)

        self._install(name, config, modules, trainable, factors, key)

    def load_adapter(self, name: str, peft_dir: str | os.PathLike, trainable: bool = False) -> None:
        """Load a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

        Each rank reads only its slices. Adapters that target a subset of projections load as
        that subset. Shapes are checked against the base before anything is created. LoRA that PEFT
        trained on transformers 5's stacked experts (``target_parameters``) loads as the exactly equal
        per-expert LoRA (:mod:`mlora.export.peft_fused`).
        """
        self._check_new_name(name)
        path = Path(peft_dir)
        check_peft_dir(path)
        with CheckpointReader(path) as reader:
            cfg, modules, per_module, read = self._open_peft(reader, path)
            check_lm_head(self.spec, self.mesh.tp, modules)
            check_peft_shapes(reader, per_module, model_sites(self.spec, self.mesh.tp), cfg, path)

            def factors(site: LoraSite, sub: str):
                a_kind, b_kind = factor_kinds(site)
                return (read(peft_tensor_name(site.layer, sub, "A"), a_kind),
                        read(peft_tensor_name(site.layer, sub, "B"), b_kind))

            self._install(name, cfg, modules, trainable, factors)

    def _open_peft(self, reader: CheckpointReader, path: Path
                   ) -> tuple[LoraConfig, set, set, Callable[[str, str], torch.Tensor]]:
        """The PEFT adapter in ``path`` (its weights open in ``reader``) as an mlora adapter: its config, every (layer,
        projection) it adapts, those of them stored per module (the others: LoRA of transformers 5's stacked experts,
        PEFT's ``target_parameters``, converted exactly into per-expert factors by :mod:`mlora.export.peft_fused`),
        and ``read(PEFT name, TP kind)``: this rank's slice of a factor by its canonical PEFT name."""
        fused = FusedExperts.find(reader, self.spec, path)
        cfg = fused.config(read_peft_config(path, parameters=fused.parameter_paths))
        names = [n for n in reader.entries if n not in fused.tensor_names]
        per_module = (peft_modules(names, self.spec.num_layers, path, self.spec.moe, attention_projections(self.spec))
                      if names or not fused else set())
        stacked = fused.modules()
        if per_module & stacked:
            twice = hf_module_name(*min(per_module & stacked))
            raise CheckpointError(f"{path / ADAPTER_WEIGHTS} holds LoRA of {twice} twice: per expert and in the "
                                  "stacked experts' factors; an adapter holds one or the other for a layer")
        tp, tp_rank = self.mesh.tp, self.mesh.tp_rank

        def read(peft_name: str, kind: str) -> torch.Tensor:
            whole = fused.read(peft_name)  # an expert's factors are whole on the ranks holding it
            return read_shard(reader, peft_name, kind, tp, tp_rank) if whole is None else whole

        return cfg, per_module | stacked, per_module, read

    def load_adapter_weights(self, name: str, peft_dir: str | os.PathLike) -> None:
        """Overwrite the factors of existing adapter ``name`` with a PEFT adapter's (e.g. resuming a run:
        the parameters stay the same objects, so optimizers keep pointing at them).

        The PEFT adapter must have the same rank and adapt the same modules. Each rank reads its slices.
        """
        self._require(name)
        path = Path(peft_dir)
        info = self.adapters[name]
        check_peft_dir(path)
        with CheckpointReader(path) as reader:
            cfg, modules, per_module, read = self._open_peft(reader, path)
            if (cfg.alpha, cfg.use_rslora) != (info.config.alpha, info.config.use_rslora):
                # the factors were trained under their scaling: under another one they compute another function
                raise ValueError(f"{path}: lora_alpha={cfg.alpha:g}, use_rslora={cfg.use_rslora} (scaling "
                                 f"{cfg.scaling:.6g}), adapter {name!r} has lora_alpha={info.config.alpha:g}, "
                                 f"use_rslora={info.config.use_rslora} (scaling {info.config.scaling:.6g}); load it "
                                 "into an adapter with the same alpha and use_rslora (in a run: "
                                 "trainer.policy|critic.model.lora.alpha)")
            if modules != set(info.modules):
                raise ValueError(f"{path} adapts {len(modules)} modules, adapter {name!r} {len(info.modules)}: "
                                 "not the same target modules")
            for expert in sorted({expert_of(proj) is not None for _, proj in modules}):
                if cfg.rank_of(expert) != info.config.rank_of(expert):
                    what = "its experts have" if expert else "it has"
                    raise ValueError(f"{path}: {what} rank {cfg.rank_of(expert)}, adapter {name!r} "
                                     f"{info.config.rank_of(expert)}")
            check_peft_shapes(reader, per_module, model_sites(self.spec, self.mesh.tp), cfg, path)
            with torch.no_grad():
                for peft_name, kind, branch, k, is_a in self._factors(name):
                    (branch.a_of(k) if is_a else branch.lora_B[k]).copy_(read(peft_name, kind))

    def delete_adapter(self, name: str) -> None:
        self._require(name)
        for linear in self._lora_linears():
            if name in linear.lora:
                del linear.lora[name]
        del self.adapters[name]
        self._active = tuple(a for a in self._active if a != name) if self._active is not None else None
        self._apply_active()

    # ------------------------------------------------------------- selection
    def _require(self, *names: str) -> None:
        unknown = [n for n in names if n not in self.adapters]
        if unknown:
            raise ValueError(f"unknown adapters {unknown}; this model has {sorted(self.adapters) or 'none'}")

    @property
    def active_adapters(self) -> tuple[str, ...]:
        """Adapters applied in forward passes: those of the innermost ``use_adapters`` block, else all."""
        return tuple(self.adapters) if self._active is None else self._active

    def _apply_active(self) -> None:
        active = self.active_adapters
        for linear in self._lora_linears():
            linear.active_adapters = active

    @contextlib.contextmanager
    def use_adapters(self, *names: str):
        """Apply exactly ``names`` (stacked, in order) inside the block; no names = the base alone."""
        self._require(*names)
        previous = self._active
        self._active = tuple(names)
        self._apply_active()
        try:
            yield self
        finally:
            self._active = previous
            self._apply_active()

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters that train: adapter factors (and heads) with ``requires_grad``; never the base."""
        return [p for p in self.parameters() if p.requires_grad]

    def adapter_parameters(self, name: str) -> list[torch.nn.Parameter]:
        """This rank's parameters of adapter ``name`` (its factors on this stage)."""
        self._require(name)
        return [p for linear in self._lora_linears() if name in linear.lora for p in linear.lora[name].parameters()]

    def set_trainable(self, name: str, trainable: bool) -> None:
        self._require(name)
        for linear in self._lora_linears():
            if name in linear.lora:
                linear.lora[name].requires_grad_(trainable)
        self.adapters[name].trainable = trainable

    # ------------------------------------------------------------- gradients and gathering
    def reduce_tp_replicated_grads(self) -> None:
        """Sum the gradients of TP-replicated parameters over TP (one bucketed all-reduce).

        Each TP rank holds only its part of those gradients (A of column layers and B of row
        layers depend on its output or input shard); the sum is the full gradient. The training
        engine folds this into its once-per-step DP reduction (:mod:`mlora.lora.grads`).
        """
        from mlora.lora.grads import all_reduce_grads

        all_reduce_grads([p for p in self.parameters() if has_tp_partial_grad(p)], self.mesh.tp_group)

    def adapter_tensors(self, name: str, grads: bool = False) -> dict[str, torch.Tensor]:
        """This stage's factors of ``name`` (or their gradients) in PEFT layout, gathered over TP.

        Collective over the TP group. Replicated factors' gradients must have been reduced with
        :meth:`reduce_tp_replicated_grads` first.
        """
        self._require(name)
        out: dict[str, torch.Tensor] = {}
        experts: dict[str, torch.Tensor] = {}
        for peft_name, kind, branch, k, is_a in self._factors(name):
            local = branch.a_of(k, grad=grads) if is_a else (branch.lora_B[k].grad if grads else branch.lora_B[k])
            if is_expert_param(branch.lora_A):  # whole on this EP rank; the other experts are on the others
                experts[peft_name] = None if local is None else local.detach().cpu().clone()
            else:
                out[peft_name] = self._gather_tp(local, kind)
        if self.mesh.ep > 1:
            parts: list = [None] * self.mesh.ep
            dist.all_gather_object(parts, experts, group=self.mesh.ep_group)
            experts = {n: t for part in parts for n, t in part.items()}
        return {**out, **experts}

    def adapter_layout(self, name: str, dtype: torch.dtype | None = None, order: str = "name"
                       ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """PEFT file layout of adapter ``name`` over the whole model: tensor name -> (dtype, full shape),
        sorted by name as PEFT writes it (``order="layer"``: by layer, then projection, A before B: the
        hand-off's segment, :mod:`mlora.rollout.tensor_sync`). ``dtype``: default :attr:`adapter_dtype`.
        Derived from the config and the model's shapes alone, so every rank of every stage computes the
        same (no communication)."""
        self._require(name)
        info, sites = self.adapters[name], model_sites(self.spec, self.mesh.tp)
        dtype = dtype or self.adapter_dtype
        modules = sorted(info.modules, key=lambda m: (m[0], projection_order(m[1], self.spec.moe)))
        gpt_oss = self.spec.moe is not None and self.spec.moe.gpt_oss
        layout = {}
        for layer, sub in modules:
            if gpt_oss and expert_of(sub) is not None:  # stacked below
                continue
            site = sites[(layer, sub)]
            a_shape, b_shape = factor_shapes(site, sub, info.config.rank_of(site.expert is not None))
            layout[peft_tensor_name(layer, sub, "A")] = (dtype, a_shape)
            layout[peft_tensor_name(layer, sub, "B")] = (dtype, b_shape)
        if gpt_oss:
            layout.update(stacked_layout(info.modules, self.spec, info.config.rank_of(True), dtype))
        if order == "layer":
            return layout
        if order != "name":
            raise ValueError(f"order={order!r}; valid: 'name', 'layer'")
        return dict(sorted(layout.items()))

    def adapter_peft_config(self, name: str) -> dict:
        """The ``adapter_config.json`` of adapter ``name`` (what :meth:`save_adapter` writes)."""
        self._require(name)
        info = self.adapters[name]
        return peft_adapter_config(info.config, set(info.modules), self.spec.num_layers, str(self.hf_dir),
                                   self.spec.architecture, self.spec.moe, attention_projections(self.spec))

    def _factors(self, name: str) -> Iterator[tuple[str, str, object, int, bool]]:
        """``(PEFT name, TP kind, branch, k, is_A)`` of every factor of ``name`` on this rank, in the order of
        this stage's LoRA linears (the same on every TP rank of the stage)."""
        for linear in self._lora_linears():
            if name not in linear.lora:
                continue
            site, branch = linear.lora_site, linear.lora[name]
            a_kind, b_kind = factor_kinds(site)
            for k, sub in enumerate(branch.subs):
                yield peft_tensor_name(site.layer, sub, "A"), a_kind, branch, k, True
                yield peft_tensor_name(site.layer, sub, "B"), b_kind, branch, k, False

    def _factor_shards(self, name: str, experts: bool) -> Iterator[tuple[str, torch.Tensor, str]]:
        """(PEFT name, this rank's factor, TP kind) of every factor of ``name`` on this rank (:meth:`_factors`):
        the experts' (whole on their EP rank) or the others'."""
        for peft_name, kind, branch, k, is_a in self._factors(name):
            if is_expert_param(branch.lora_A) == experts:
                yield peft_name, (branch.a_of(k) if is_a else branch.lora_B[k]).detach(), kind

    def adapter_shards(self, name: str) -> Iterator[TensorShard]:
        """This rank's part of adapter ``name``'s PEFT file, one factor at a time, nothing gathered: what
        :meth:`save_adapter` and the tensor hand-off (:mod:`mlora.rollout.tensor_sync`) write.

        DP rank 0 of each stage writes; the other DP replicas hold the same values and write nothing.
        A TP-sharded factor (B of column layers, A of row layers) is written by every TP rank, its own
        chunk; a replicated factor by one TP rank, taken in turn so the TP ranks write alike
        (:func:`mlora.export.sharded_write.select_shards`). An expert's factors, whole on the ranks holding
        the expert, are written by the first rank of its expert-data-parallel group.
        """
        self._require(name)
        mesh = self.mesh
        yield from select_shards(self._factor_shards(name, experts=False), mesh.tp, mesh.tp_rank, mesh.dp_rank)
        if self.spec.moe is None or mesh.expert_dp_rank != 0:
            return  # no experts, or another rank holding the same experts writes them
        if self.spec.moe.gpt_oss:
            yield from self._stacked_expert_shards(name)
            return
        for peft_name, local, _ in self._factor_shards(name, experts=True):
            yield TensorShard(peft_name, local)

    def _stacked_expert_shards(self, name: str) -> Iterator[TensorShard]:
        """gpt-oss: adapter ``name``'s expert LoRA as PEFT's stacked factors (:mod:`mlora.export.peft_gpt_oss`), each
        gathered over the EP group (collective over EP, ranks of expert-data-parallel rank 0) and written by its EP
        rank 0; a layer's stacked B interleaves every expert's columns, so no EP rank can write its own part."""
        mesh, moe = self.mesh, self.spec.moe
        factors = {}
        for linear in self._lora_linears():
            branch = linear.lora[name] if name in linear.lora else None
            if branch is not None and is_expert_param(branch.lora_A):
                for k, sub in enumerate(branch.subs):
                    factors[(linear.lora_site.layer, sub)] = (branch.a_of(k).detach(), branch.lora_B[k].detach())
        stage = set(stage_layers(self.spec, mesh.pp, mesh.pp_rank))
        for layer, params in adapted_params(self.adapters[name].modules).items():
            if layer not in stage:
                continue
            for param, (a_name, b_name) in stacked_names(layer, params).items():
                a_parts, b_parts = [], []
                for e in local_experts(self.spec, mesh.ep, mesh.ep_rank):
                    if param == GATE_UP:
                        a, b = stack_gate_up(*factors[(layer, expert_projection(moe, e, 0))],
                                             *factors[(layer, expert_projection(moe, e, 1))])
                    else:
                        a, b = factors[(layer, expert_projection(moe, e, 2))]
                    a_parts.append(a)
                    b_parts.append(b)
                a_local, b_local = torch.stack(a_parts), torch.stack(b_parts)
                if mesh.ep > 1:
                    a_all = [torch.empty_like(a_local) for _ in range(mesh.ep)]
                    b_all = [torch.empty_like(b_local) for _ in range(mesh.ep)]
                    dist.all_gather(a_all, a_local.contiguous(), group=mesh.ep_group)
                    dist.all_gather(b_all, b_local.contiguous(), group=mesh.ep_group)
                    a_local, b_local = torch.cat(a_all), torch.cat(b_all)
                if mesh.ep_rank == 0:
                    a, b = peft_stacked(list(a_local.cpu()), list(b_local.cpu()))
                    yield TensorShard(a_name, a)
                    yield TensorShard(b_name, b)

    def require_peft_loadable(self, name: str) -> None:
        """Raise when PEFT 0.21 could not load adapter ``name`` as :meth:`save_adapter` writes it
        (:func:`peft_refusals`, the same on every rank); the trainer asks before its first step, so a run does not
        train an adapter it cannot export."""
        problems = peft_refusals(self.adapters[name].modules, self.spec)
        if problems:
            raise ValueError(f"adapter {name!r} cannot be written in PEFT's format for {self.spec.architecture}: "
                             + "; ".join(problems) + " (mlora's training checkpoints hold any adapter)")

    def save_adapter(self, name: str, out_dir: str | os.PathLike) -> None:
        """Write adapter ``name`` as a PEFT directory (collective: call on every rank).

        The directory is ``out_dir`` as given on global rank 0. ``adapter_model.safetensors`` is one
        file whose header every rank derives from shapes alone; rank 0 creates it at its final size,
        then the TP ranks of DP rank 0 of every stage write their own shards of their own layers at
        their byte offsets (no gather, no pickle: a rank's extra memory is one factor's CPU copy; a
        rank that cannot see rank 0's file system relays its shards to rank 0 one at a time), and
        rank 0 renames it into place and writes ``adapter_config.json``
        (:func:`mlora.export.peft_files.write_peft_adapter_sharded`). Bytes equal what PEFT writes;
        each file appears atomically. Loads unchanged with ``PeftModel.from_pretrained`` and in vLLM.
        """
        self._require(name)
        self.require_peft_loadable(name)
        config = self.adapter_peft_config(name) if self.mesh.rank == 0 else None
        if config is not None:
            _warn_what_peft_drops(name, self.adapters[name].modules, self.spec)
        write_peft_adapter_sharded(out_dir, self.adapter_layout(name), self.adapter_shards(name), config, root=0)

    def merged_weight(self, linear: torch.nn.Module, names: list[str]) -> torch.Tensor:
        """This rank's ``W + Σ s·B·A`` of a LoRA linear for adapters ``names`` (same layout as W; an FP8
        base dequantized first, see ``base_weight``), summed in float32 at least and rounded to W's dtype once: a
        16-bit sum of a rounded delta would round twice, and lose an update just over half a step of W."""
        base = self.base_weight(linear)
        weight = base.to(torch.promote_types(base.dtype, torch.float32), copy=True)
        site = linear.lora_site
        for name in names:
            if name not in linear.lora:
                continue
            branch = linear.lora[name]
            weight += (stacked_b(branch, site) @ branch.lora_A).detach().to(weight.dtype)
        return weight.to(base.dtype)

    def _gather_tp(self, local: torch.Tensor, kind: str) -> torch.Tensor:
        local = local.detach()
        if kind == REPLICATED or self.mesh.tp == 1:
            return local.cpu().clone()
        shards = [torch.empty_like(local) for _ in range(self.mesh.tp)]
        dist.all_gather(shards, local.contiguous(), group=self.mesh.tp_group)
        return unshard([s.cpu() for s in shards], kind)
