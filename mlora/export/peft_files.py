"""PEFT adapter directories: read and check them, write them exactly as PEFT does (atomically)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable

import torch

from mlora.formats.checkpoint_reader import CheckpointError, CheckpointReader
from mlora.formats.safetensors_writer import Layout, SafetensorsWriter, TensorShard
from mlora.lora.config import LoraConfig
from mlora.lora.sites import factor_shapes
from mlora.lora.targets import (
    GQA_PROJECTIONS,
    HF_PROJECTIONS,
    LM_HEAD,
    expert_of,
    hf_module_name,
    is_router,
    model_projections,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# LoRA of a MoE layer's stacked experts (PEFT target_parameters on transformers 5): each targeted parameter wraps the
# experts module once more, so the first one targeted sits under ``base_layer``
FUSED_EXPERTS_FACTOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.mlp\.experts((?:\.base_layer)*)"
                                  r"\.lora_([AB])\.weight$")


def peft_tensor_name(layer: int, proj: str, factor: str) -> str:
    """PEFT's saved name of a LoRA factor (``factor`` is "A" or "B")."""
    return f"base_model.model.{hf_module_name(layer, proj)}.lora_{factor}.weight"


def peft_target_modules(modules: set[tuple[int, str]], num_layers: int, moe=None,
                        attention: tuple[str, ...] = GQA_PROJECTIONS) -> list[str]:
    """PEFT ``target_modules`` naming exactly the adapted modules.

    Module names (``q_proj``; an expert's ``gate_proj`` or ``w1``) when every module of the model with each
    adapted name is adapted (what PEFT itself writes for ``target_modules=["q_proj", ...]``), otherwise
    full module paths. transformers 5 stacks experts into 3-D parameters; PEFT maps these per-expert
    names onto them when it loads the adapter (``peft.utils.transformers_weight_conversion``).
    """
    def leaf(proj: str) -> str:
        return proj.rsplit(".", 1)[-1]

    leaves = {leaf(p) for _, p in modules}
    if all(key in modules for key in model_projections(num_layers, moe, attention) if leaf(key[1]) in leaves):
        # attention (multi-latent attention's first) and MLP names, then a MoE layer's router (its leaf: gate) and its
        # experts' names; the name breaks ties, so that the file does not depend on set order
        def order(n: str) -> tuple[int, str]:
            if n in HF_PROJECTIONS:
                return HF_PROJECTIONS.index(n), n
            if n in attention:
                return attention.index(n) - len(attention), n
            if n == LM_HEAD:
                return 2 * len(HF_PROJECTIONS), n
            return len(HF_PROJECTIONS) + (moe.projections.index(n) if n in moe.projections else -1), n

        return sorted(leaves, key=order)
    return sorted(hf_module_name(i, p) for i, p in modules)


def peft_adapter_config(config: LoraConfig, modules: set[tuple[int, str]], num_layers: int,
                        base_model_name_or_path: str, architecture: str, moe=None,
                        attention: tuple[str, ...] = GQA_PROJECTIONS) -> dict:
    """The ``adapter_config.json`` PEFT 0.2x writes for a plain LoRA adapter on a causal LM (``moe``: the
    model's MoESpec, whose expert names ``target_modules`` may use; ``attention``: its attention projections,
    :func:`mlora.lora.targets.attention_projections`)."""
    import transformers

    stacked, target = {}, modules
    if moe is not None and moe.gpt_oss:  # the experts (and routers) as target_parameters (mlora.export.peft_gpt_oss)
        from mlora.export.peft_gpt_oss import peft_config_fields

        stacked = peft_config_fields(config, modules, num_layers, moe.sparse_layers)
        target = {(i, p) for i, p in modules if expert_of(p) is None and not is_router(p)}
    ranks = _ranks(config, modules) if not stacked else {"r": config.rank, "rank_pattern": stacked["rank_pattern"]}
    return {
        "alpha_pattern": stacked.get("alpha_pattern", {}),
        "auto_mapping": {"base_model_class": architecture,
                         "parent_library": getattr(transformers, architecture).__module__},
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        # what PEFT records for its own inits; Megatron-Bridge's have no PEFT name (the weights are stored)
        "init_lora_weights": "gaussian" if config.init_method == "gaussian" else True,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": config.alpha if not float(config.alpha).is_integer() else int(config.alpha),
        "lora_bias": False,
        "lora_dropout": config.dropout,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "peft_type": "LORA",
        **ranks,
        "revision": None,
        "target_modules": peft_target_modules(target, num_layers, moe, attention) if target else None,
        **({"target_parameters": stacked["target_parameters"]} if stacked else {}),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": config.use_rslora,
    }


def _ranks(config: LoraConfig, modules: set[tuple[int, str]]) -> dict:
    """``r`` and ``rank_pattern`` of an adapter: with an ``expert_rank`` of its own, ``r`` is the experts' (PEFT's
    transformers-5 conversion derives the fused experts' ranks from ``r`` alone) and ``rank_pattern`` gives every
    other adapted module, by its exact path, ``rank`` (PEFT and vLLM both scale a module ``alpha / its rank``). A
    router is named twice: by its module path (vLLM's, and the checkpoint's) and by the parameter path PEFT keys it by
    on transformers 5 (where Mixtral's ``block_sparse_moe`` is ``mlp``)."""
    if config.expert_rank is None:
        return {"r": config.rank, "rank_pattern": {}}
    pattern = {}
    for i, p in sorted(modules):
        if expert_of(p) is None:
            pattern[re.escape(hf_module_name(i, p))] = config.rank
        if is_router(p):  # PEFT adapts transformers 5's router as the parameter model.layers.{i}.mlp.gate.weight
            pattern[re.escape(f"model.layers.{i}.mlp.gate.weight")] = config.rank
    return {"r": config.expert_rank, "rank_pattern": pattern}


def pattern_value(pattern: dict | None, path: str, default):
    """The value PEFT's ``rank_pattern`` / ``alpha_pattern`` gives the module or parameter ``path``: that of the first
    key (a regex) matching the end of ``path`` on a dot boundary, as ``peft.utils.other.get_pattern_key`` matches it;
    ``default`` when none does."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", path):
            return value
    return default


def _without_keys_of(pattern: dict | None, parameters: Iterable[str]) -> dict:
    """``pattern`` less the keys that name any of ``parameters`` (resolved per parameter by their reader)."""
    parameters = tuple(parameters)
    return {k: v for k, v in (pattern or {}).items()
            if not any(pattern_value({k: True}, p, False) for p in parameters)}


def _ranks_of(raw: dict, file: Path) -> tuple[int, int | None]:
    """``(rank, expert_rank)`` of an ``adapter_config.json``: plain (one ``r``), or :func:`_ranks`'s form, whose
    ``rank_pattern`` names non-expert modules by exact path, all with one rank."""
    pattern = raw.get("rank_pattern") or {}
    if not pattern:
        return int(raw["r"]), None
    paths = [key.replace("\\.", ".") for key in pattern]
    if len(set(pattern.values())) != 1 or not all(
            re.fullmatch(r"model\.layers\.\d+\.[\w.]+|lm_head", p) and ".experts." not in p for p in paths):
        raise ValueError(f"{file}: rank_pattern {pattern} is not supported: mlora takes one rank for every module, or "
                         "one for the MoE experts (r) and one for every other module (rank_pattern naming each "
                         "by its path, as mlora writes it)")
    return int(next(iter(pattern.values()))), int(raw["r"])


def write_peft_adapter(out_dir: str | os.PathLike, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """Write ``adapter_model.safetensors`` and ``adapter_config.json``; each file appears atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    writer = SafetensorsWriter(out / ADAPTER_WEIGHTS,
                               {n: (tensors[n].dtype, tuple(tensors[n].shape)) for n in names},
                               metadata={"format": "pt"})
    try:
        for n in names:
            writer.write(n, tensors[n])
    except BaseException:
        writer.abort()
        raise
    writer.close()
    tmp = out / (ADAPTER_CONFIG + ".tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / ADAPTER_CONFIG)
    return out


def _write_text_atomic(path: Path, text: str, fsync: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def write_peft_adapter_sharded(out_dir: str | os.PathLike, layout: Layout, shards: Iterable[TensorShard],
                               config: dict | None, *, root: int = 0, direct: bool | None = None,
                               durable: bool | None = None) -> Path:
    """Collective (every rank): write a PEFT adapter directory from shards that stay where they are.

    The directory is ``out_dir`` as given on global rank ``root`` (other ranks' ``out_dir`` is
    ignored, as it always was). ``layout`` (name -> (dtype, full shape), sorted by name as PEFT
    writes it) must be the same on every rank: the header and every tensor's byte range follow
    from it. ``shards`` is this rank's part of ``adapter_model.safetensors`` (nothing for ranks
    that write nothing), consumed lazily; between them the ranks cover every byte once. Each rank
    that sees ``root``'s file system writes its shards in place with ``pwrite``; others relay theirs to
    ``root`` one at a time (see :mod:`mlora.export.sharded_write`; ``direct=False`` relays all).
    ``root`` writes ``adapter_config.json`` from ``config`` (ignored elsewhere; None: none). Each
    file appears atomically; the weights' bytes equal :func:`write_peft_adapter`'s for the
    assembled tensors. ``durable``: fsync everything (None: only inside
    :func:`mlora.formats.durable.durable_writes`, which checkpoints enter). This is the file
    path of the trainer-to-engine hand-off: benchmarks time it on any per-rank shards.
    """
    from mlora.export.sharded_write import write_safetensors_collectively
    from mlora.formats.durable import is_durable

    durable = is_durable(durable)

    def finish(weights: Path) -> None:
        if config is not None:
            _write_text_atomic(weights.parent / ADAPTER_CONFIG, json.dumps(config, indent=2, sort_keys=True) + "\n",
                               fsync=durable)

    final = write_safetensors_collectively(Path(out_dir) / ADAPTER_WEIGHTS, layout, shards, root=root,
                                           metadata={"format": "pt"}, direct=direct, finish=finish,
                                           durable=durable)
    return final.parent


_UNSUPPORTED_PEFT = {
    "use_dora": (True,), "fan_in_fan_out": (True,), "bias": ("all", "lora_only"),
}


def check_peft_dir(path: Path) -> None:
    """FileNotFoundError when ``path`` has no ``adapter_model.safetensors``; first, as loaders said before they read
    the weights, what :func:`read_peft_config` says of the directory and its config (missing, or refused)."""
    if not (path / ADAPTER_WEIGHTS).is_file():
        read_peft_config(path)
        raise FileNotFoundError(f"{path} has no {ADAPTER_WEIGHTS} (a PEFT adapter directory holds {ADAPTER_CONFIG} "
                                f"and {ADAPTER_WEIGHTS})")


def read_peft_config(path: Path, modules_to_save: tuple[str, ...] = (), parameters: Iterable[str] = ()) -> LoraConfig:
    """LoraConfig from a PEFT ``adapter_config.json``, rejecting features mlora cannot reproduce.

    ``modules_to_save``: the whole modules the caller loads itself (the reward adapter's
    ``score`` head, :mod:`mlora.export.reward_adapter`); any other is rejected. ``parameters``: the paths of
    transformers 5's stacked expert parameters the file adapts (``model.layers.0.mlp.experts.gate_up_proj``, from
    :mod:`mlora.export.peft_fused`): ``rank_pattern`` and ``alpha_pattern`` keys naming them are left to that
    module, which resolves them per parameter."""
    file = path / ADAPTER_CONFIG
    if not path.is_dir():
        raise FileNotFoundError(f"adapter directory {str(path)!r} does not exist")
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no {ADAPTER_CONFIG}: not a PEFT adapter directory")
    raw = json.loads(file.read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file}: peft_type {raw.get('peft_type')!r} is not supported; supported: 'LORA'")
    for key, bad in _UNSUPPORTED_PEFT.items():
        if raw.get(key) in bad:
            raise ValueError(f"{file}: {key}={raw[key]!r} is not supported (mlora loads plain LoRA)")
    if _without_keys_of(raw.get("alpha_pattern"), parameters):
        raise ValueError(f"{file}: a non-empty alpha_pattern is not supported (one alpha per adapter)")
    dropout = float(raw.get("lora_dropout", 0.0) or 0.0)
    if dropout > 0 and raw.get("target_parameters"):
        # PEFT's ParamWrapper cannot apply dropout to the input of a parameter, and refuses it
        raise ValueError(f"{file}: lora_dropout={dropout} with target_parameters={raw['target_parameters']}: PEFT "
                         "refuses dropout on target_parameters (its ParamWrapper), so such an adapter cannot have "
                         "been trained; set lora_dropout to 0.0")
    rank, expert_rank = _ranks_of({**raw, "rank_pattern": _without_keys_of(raw.get("rank_pattern"), parameters)},
                                  file)
    if raw.get("modules_to_save") and set(raw["modules_to_save"]) - set(modules_to_save):
        raise ValueError(f"{file}: modules_to_save={raw['modules_to_save']} is not supported"
                         + (f" (this loader takes {list(modules_to_save)})" if modules_to_save else ""))
    return LoraConfig(rank=rank, expert_rank=expert_rank, alpha=float(raw.get("lora_alpha", raw["r"])),
                      dropout=dropout,
                      target_modules=raw.get("target_modules") or "all-linear",
                      exclude_modules=raw.get("exclude_modules"),
                      use_rslora=bool(raw.get("use_rslora", False)), extra=raw)


def peft_modules(names, num_layers: int, path: Path, moe=None, attention: tuple[str, ...] = GQA_PROJECTIONS
                 ) -> set[tuple[int, str]]:
    """(layer, projection) pairs present in a PEFT weights file (``moe``: the base's MoESpec, whose
    per-expert modules ``mlp.experts.{e}.gate_proj`` ... an adapter may hold; ``attention``: the base's attention
    projections)."""
    pattern = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.([\w.]+)\.lora_([AB])\.weight$")
    head = re.compile(r"^base_model\.model\.lm_head\.lora_([AB])\.weight$")
    valid = model_projections(num_layers, moe, attention)
    found: dict[tuple[int, str], set[str]] = {}
    for name in names:
        m = head.match(name)
        if m is not None:  # the output layer, keyed by the last layer (mlora.lora.targets)
            found.setdefault((num_layers - 1, LM_HEAD), set()).add(m.group(1))
            continue
        if FUSED_EXPERTS_FACTOR.match(name):
            raise CheckpointError(f"{path / ADAPTER_WEIGHTS}: {name!r} is LoRA of transformers 5's stacked experts "
                                  "(PEFT target_parameters), which this command does not read: load the adapter with "
                                  "MLoraModel.load_adapter, which converts it into per-expert factors, and write "
                                  "those with save_adapter")
        m = pattern.match(name)
        if m is None and name.endswith(".base_layer.weight"):
            raise CheckpointError(f"{path / ADAPTER_WEIGHTS}: {name!r} is a base weight, not a LoRA factor (PEFT saves "
                                  "the embedding and lm_head weights when they are targets, unless save_pretrained "
                                  "is given save_embedding_layers=False): mlora loads adapters without base weights")
        if m is None:
            raise CheckpointError(f"{path / ADAPTER_WEIGHTS}: tensor {name!r} is not a LoRA factor of a "
                                  "supported decoder layer")
        layer, module, factor = int(m.group(1)), m.group(2), m.group(3)
        if layer >= num_layers:
            raise CheckpointError(f"{path / ADAPTER_WEIGHTS}: adapter has layer {layer}, the base has only "
                                  f"{num_layers} layers: an adapter for another base?")
        parent, _, proj = module.partition(".")
        if not (parent in ("self_attn", "mlp") and (layer, proj) in valid):
            proj = module  # an expert's projection is keyed by its whole path below the layer
        if (layer, proj) not in valid:
            examples = sorted({hf_module_name(layer, p) for (i, p) in valid if i == layer}, key=len)[:8]
            raise CheckpointError(f"{path / ADAPTER_WEIGHTS}: {name!r} adapts no module of this base's layer "
                                  f"{layer}; its modules include {', '.join(examples)}: an adapter for another base?")
        found.setdefault((layer, proj), set()).add(factor)
    incomplete = [f"{hf_module_name(*k)}" for k, v in found.items() if v != {"A", "B"}]
    if incomplete:
        raise CheckpointError(f"{path / ADAPTER_WEIGHTS}: modules without both lora_A and lora_B: {incomplete[:3]}")
    if not found:
        raise CheckpointError(f"{path / ADAPTER_WEIGHTS} holds no LoRA tensors")
    return set(found)


def check_peft_shapes(reader: CheckpointReader, modules, sites, config: LoraConfig, path: Path) -> None:
    """Every factor must have the shape the base implies (ranks from adapter_config.json)."""
    for layer, proj in sorted(modules):
        site = sites[(layer, proj)]
        rank = config.rank_of(site.expert is not None)
        a_shape, b_shape = factor_shapes(site, proj, rank)
        for factor, shape in (("A", a_shape), ("B", b_shape)):
            name = peft_tensor_name(layer, proj, factor)
            got = reader.entry(name).shape
            if tuple(got) != shape:
                hint = (f"r in {ADAPTER_CONFIG} is {rank}" if (factor == "A" and got[0] != rank)
                        or (factor == "B" and got[1] != rank) else "an adapter for another base?")
                raise CheckpointError(f"{path / ADAPTER_WEIGHTS}: {name} has shape {tuple(got)}, this base "
                                      f"needs {shape} ({hint})")
