"""HF safetensors <-> megatron-core distributed checkpoint (``torch_dist``), tensor by tensor.

``hf_to_mcore`` runs on ``pp × lcm(tp, ep)`` ranks (one process when all are 1). Each rank builds a
megatron ``GPTModel`` for its pipeline stage (dense models without q/k norms: megatron's plain local
layer spec; q/k norms or experts: the layer spec mlora builds, megatron's local spec with its MoE layer and
mlora's norms), fills it with only its TP slices and its EP rank's experts of the HF tensors (read slice by
slice: :class:`~mlora.formats.checkpoint_reader.CheckpointReader`), and megatron-core's own
``dist_checkpointing.save`` writes the model's ``sharded_state_dict()``. A rank holds its shard of the
model plus one tensor being read: megatron's save takes a built model's tensors, as Megatron-LM's and
Megatron-Bridge's converters do.

The directory is what Megatron-LM's ``--load`` (``--ckpt-format torch_dist``) and Megatron-Bridge read::

    OUT/latest_checkpointed_iteration.txt      "release"
    OUT/release/metadata.json, common.pt, .metadata, __<rank>_<i>.distcp    (megatron-core)
    OUT/release/mlora_hf/config.json, tokenizer files                      (the HF side files)
    OUT/release/mlora_convert.json            source layout: HF files, tensor order, dtypes, vocab padding

Tensor keys are the local spec's, TE-compatible in dense layers (``...linear_qkv.layer_norm_weight`` for
the input norm, ``...linear_fc1.layer_norm_weight`` for the pre-MLP norm; see the limit below), QKV
grouped per query group ``[q; k; v]``, ``linear_fc1`` as ``[gate; up]``, and the vocabulary padded as
Megatron-LM pads it: up to a multiple of ``make_vocab_size_divisible_by × tp`` (default 128 × tp).
Dense models stack the decoder layers on a leading axis (``decoder.layers.<name>`` ``[L, ...]``).
Mixtures of experts are what megatron writes for a model whose ``moe_layer_freq`` is a list (Megatron-LM's
``--moe-layer-freq '([1]*L)'``, as mlora builds them): one key per layer, ``decoder.layers.<i>.<name>``, with
the experts of a layer stacked on a leading axis in global order,
``decoder.layers.<i>.mlp.experts.experts.linear_fc1.weight`` ``[E, 2·ffn, hidden]`` (each ``[gate; up]``) and
``...linear_fc2.weight`` ``[E, hidden, ffn]``, ``decoder.layers.<i>.mlp.router.weight`` ``[E, hidden]``; q/k
norms are ``...self_attention.{q,k}_layernorm.weight``, ``[head_dim]`` per head or the full width of all heads
(OLMoE; split over TP with the heads). A dist checkpoint is layout-free: any TP×PP×EP loads it (same padded
vocabulary); ``tp``/``pp``/``ep`` choose the padding and how many ranks write.

``mcore_to_hf`` needs one process and no process group: it reads one megatron tensor (one layer's or one
expert's slice of a stacked key) at a time through torch.distributed.checkpoint, the storage layer of
``torch_dist``, turns it into the HF tensors and streams them into safetensors files laid out as the source
was, so HF -> mcore -> HF is bit-identical. A checkpoint written elsewhere (Megatron-LM, Bridge) converts too
given the HF ``config.json`` it corresponds to (``hf_config=``); it is checked tensor by tensor against it.
It reads either layer layout (stacked or one key per layer, as an integer or a list ``--moe-layer-freq``
gives) and the pre-MLP norm of MoE layers under the local spec's name or Transformer Engine's
(``pre_mlp_layernorm.weight``, which megatron's TE spec stores for MoE layers).

Limit: ``hf_to_mcore`` writes the local spec's keys, the ones a model built by mlora (and megatron's local
spec) asks for. They are the TE spec's too except in MoE layers, where megatron's TE spec keeps the pre-MLP
norm apart (``decoder.layers.<i>.pre_mlp_layernorm.weight``): a Megatron-LM run on the TE spec (its default)
loads a converted dense model as it is, a converted MoE model with ``--transformer-impl local``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from mlora.formats.checkpoint_reader import INDEX_FILE, CheckpointError, CheckpointReader
from mlora.formats.dtypes import SAFETENSORS_DTYPES, SAFETENSORS_NAMES
from mlora.formats.fused_experts import (
    expose_gpt_oss_experts,
    fuse_gpt_oss_experts,
    gpt_oss_layout,
    is_gpt_oss_stacked,
)
from mlora.formats.hf_config import ModelSpec, check_layout, load_hf_config, model_spec
from mlora.formats.weight_map import VOCAB, ParamMap, is_export_copy, stage_layers, stage_param_maps

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE_DIR = "release"
HF_SIDE_DIR = "mlora_hf"
CONVERT_INFO = "mlora_convert.json"
INFO_FORMAT = "mlora-mcore-convert/1"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version (mcore layers, [q; k; v] per group)
# What Megatron-LM and Megatron-Bridge record as content metadata for a model without optimizer state.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
HF_SHARD_BYTES = 5 * 1024**3  # transformers' default max_shard_size, for checkpoints without a source layout
# megatron's local layer spec stores the two norms under the TE spec's names (sharded_state_dict_keys_map).
_NORM_KEYS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
              "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
_TE_MOE_NORM = "pre_mlp_layernorm.weight"  # megatron's TE spec: MoE layers keep their pre-MLP norm separate
_LAYERS = "decoder.layers."
_LOCAL_EXPERTS = "mlp.experts.local_experts."  # SequentialMLP's parameters ...
_EXPERTS = "mlp.experts.experts."  # ... and its sharded keys (TEGroupedMLP's too: megatron keeps them interchangeable)
# weights and their indexes: not copied with the side files (config, tokenizer, generation config, ...)
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", INDEX_FILE,
                 "pytorch_model.bin.index.json")


# ----------------------------------------------------------------------------- shared helpers
def ranks_needed(tp: int, pp: int, ep: int = 1) -> int:
    """Ranks that write a ``tp × pp`` checkpoint with the experts split ``ep`` ways: ``pp × lcm(tp, ep)``.
    megatron draws the EP ranks of a stage from its TP × DP ranks, so EP beyond TP needs DP replicas
    (they hold the same dense shards and megatron's save writes each shard once)."""
    return pp * math.lcm(tp, ep)


@dataclass(frozen=True)
class KeyLayout:
    """How a dist checkpoint names the parameters of a GPTModel.

    ``per_layer``: one key per decoder layer, ``decoder.layers.<i>.<name>`` (what megatron writes for a
    model with heterogeneous layers: a list ``moe_layer_freq``, as mlora's MoE models have), else the
    layers stacked on a leading axis of ``decoder.layers.<name>``. Experts are stacked on the next axis.
    ``te_moe_norm``: the pre-MLP norm of MoE layers is stored as ``pre_mlp_layernorm.weight`` (megatron's
    Transformer Engine spec) rather than the local spec's ``mlp.linear_fc1.layer_norm_weight``.
    ``sparse_layers``: the MoE layers (global indices). ``norm_keys``: the two norms under the TE spec's names
    (megatron's local spec maps them so); its multi-latent attention layer spec keeps their own names."""

    per_layer: bool = False
    te_moe_norm: bool = False
    sparse_layers: frozenset[int] = frozenset()
    norm_keys: bool = True

    @classmethod
    def written(cls, spec: ModelSpec) -> "KeyLayout":
        """What :func:`hf_to_mcore` writes for ``spec``: megatron's keys for mlora's model config."""
        return cls(per_layer=spec.moe is not None, sparse_layers=frozenset(spec.sparse_layers),
                   norm_keys=spec.mla is None)

    @classmethod
    def stored(cls, spec: ModelSpec, keys: Iterable[str]) -> "KeyLayout":
        """The layout of a checkpoint holding tensor ``keys`` (per layer or stacked; TE's MoE norm name)."""
        keys = list(keys)
        layered = [k.split(".", 3) for k in keys if k.startswith(_LAYERS)]
        per_layer = any(part[2].isdigit() for part in layered if len(part) > 3)
        te_norm = any(k.startswith(_LAYERS) and k.endswith("." + _TE_MOE_NORM) for k in keys)
        own_norms = any(k.startswith(_LAYERS) and k.endswith(".input_layernorm.weight") for k in keys)
        return cls(per_layer, te_norm and spec.moe is not None, frozenset(spec.sparse_layers), not own_norms)

    def key(self, megatron_name: str, layer_offset: int = 0, expert_offset: int = 0) -> tuple[str, tuple[int, ...]]:
        """The dist-checkpoint key of a ``GPTModel`` parameter name and the indices of its slice on the
        stacked leading axes (global layer, then global expert; ``layer_offset``/``expert_offset``: the
        first layer of the stage and first expert of the EP rank, 0 for a TP1/PP1/EP1 model's names)::

            decoder.layers.3.input_layernorm.weight (stacked)
                -> ("decoder.layers.self_attention.linear_qkv.layer_norm_weight", (3,))
            decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.weight (per layer)
                -> ("decoder.layers.3.mlp.experts.experts.linear_fc2.weight", (5,))
        """
        if not megatron_name.startswith(_LAYERS):
            return megatron_name, ()
        local, rest = megatron_name[len(_LAYERS):].split(".", 1)
        layer = int(local) + layer_offset
        if self.norm_keys and not (self.te_moe_norm and rest == _TE_MOE_NORM and layer in self.sparse_layers):
            rest = _NORM_KEYS.get(rest, rest)  # else TE's name, which is the module's own
        index: tuple[int, ...] = ()
        if rest.startswith(_LOCAL_EXPERTS):  # SequentialMLP's sharded_state_dict: local j -> global expert
            j, tail = rest[len(_LOCAL_EXPERTS):].split(".", 1)
            rest, index = f"{_EXPERTS}{tail}", (int(j) + expert_offset,)
        if self.per_layer:
            return f"{_LAYERS}{layer}.{rest}", index
        return _LAYERS + rest, (layer, *index)


def _megatron_shape(pm: ParamMap, spec: ModelSpec, padded_vocab: int) -> tuple[int, ...]:
    """The unsharded (TP1) shape of one parameter: its HF tensors concatenated on dim 0."""
    if pm.kind == VOCAB:
        return (padded_vocab, spec.hidden_size)
    shapes = list(pm.hf_shapes(spec).values())
    return (sum(s[0] for s in shapes), *shapes[0][1:])


def expected_shapes(spec: ModelSpec, padded_vocab: int, layout: KeyLayout | None = None) -> dict[str, tuple[int, ...]]:
    """Global shape of every model tensor a dist checkpoint of ``spec`` holds in ``layout`` (default: the
    one :func:`hf_to_mcore` writes), stacked axes first."""
    layout = layout or KeyLayout.written(spec)
    shapes: dict[str, tuple[int, ...]] = {}
    for pm in stage_param_maps(spec, 1, 0):
        if is_export_copy(pm, spec):
            continue
        key, index = layout.key(pm.megatron_name)
        stacked = (spec.num_layers,) if index and not layout.per_layer else ()
        if pm.expert:
            stacked += (spec.moe.num_experts,)
        shapes[key] = (*stacked, *_megatron_shape(pm, spec, padded_vocab))
    return shapes


def model_sharded_state_dict(model: torch.nn.Module, spec: ModelSpec, metadata: dict | None = None) -> dict:
    """``model.sharded_state_dict(metadata=...)`` as a dist checkpoint of ``spec`` stores it: what
    :func:`hf_to_mcore` saves, and what to give ``dist_checkpointing.load`` for a model built by mlora.

    One fix over the module's own: OLMoE's full-width q/k norm weights (``spec.qk_norm == "full"``) are
    split over TP with the heads, and mlora's norm module leaves them to megatron's default, which takes
    every TP rank's slice for a replica of the whole; here they are TP-sharded on their last axis."""
    sharded = model.sharded_state_dict(metadata=metadata)
    if spec.qk_norm != "full":
        return sharded
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    if tp == 1:
        return sharded
    for name, item in sharded.items():
        if not (name.endswith(("q_layernorm.weight", "k_layernorm.weight")) and isinstance(item, ShardedTensor)):
            continue
        stacked = item.prepend_axis_num
        offsets = [(axis, item.global_offset[axis], item.axis_fragmentations[axis]) for axis in range(stacked)]
        sharded[name] = ShardedTensor.from_rank_offsets(
            item.key, item.data, *offsets, (stacked, tp_rank, tp),
            replica_id=(item.replica_id[0], 0, item.replica_id[2]), prepend_axis_num=stacked)
    return sharded


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's padding: ``vocab_size`` rounded up to a multiple of ``divisible_by × tp``."""
    if divisible_by < 1:
        raise ValueError(f"make_vocab_size_divisible_by={divisible_by} is invalid: it must be >= 1")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="tensor", desc=desc, disable=not enabled)


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype not in SAFETENSORS_NAMES:
        raise ValueError(f"dtype {name!r} is not supported; choose from "
                         f"{', '.join(sorted(str(d).removeprefix('torch.') for d in SAFETENSORS_NAMES))}")
    return dtype


def _short(names: Iterable[str], n: int = 5) -> str:
    names = list(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


# ----------------------------------------------------------------------------- HF -> mcore
def check_hf_checkpoint(reader: CheckpointReader, spec: ModelSpec, hf_dir: Path) -> list[ParamMap]:
    """Every ParamMap of the whole model (TP1/PP1 names); raises when the files do not match the config
    or hold tensors a megatron GPTModel has no place for (they could not come back on export)."""
    maps = stage_param_maps(spec, 1, 0)
    needed = {n for pm in maps for n in pm.hf_names}
    missing = sorted(needed - set(reader.entries))
    if missing:
        raise CheckpointError(f"{hf_dir} lacks tensors the model needs: {_short(missing)}")
    wrong = [f"{name} is {reader.entry(name).shape}, config.json implies {shape}"
             for pm in maps for name, shape in pm.hf_shapes(spec).items() if reader.entry(name).shape != shape]
    if wrong:
        raise CheckpointError(f"{hf_dir} does not match its config.json: " + "; ".join(wrong[:3]))
    extra = sorted(n for n in set(reader.entries) - needed if not is_gpt_oss_stacked(n, spec))
    if extra:
        raise CheckpointError(
            f"{hf_dir} holds tensors that a megatron GPTModel of {spec.architecture} has no place for: "
            f"{_short(extra)}; they would be lost in the conversion")
    return maps


def _source_layout(reader: CheckpointReader, hf_dir: Path) -> dict[str, Any]:
    """The HF files, their tensors in file order and the index metadata: what export reproduces."""
    files: dict[str, list[str]] = {}
    stored = {name: entry for name, entry in reader.entries.items() if not reader.is_derived(name)}
    for name, entry in sorted(stored.items(), key=lambda kv: (kv[1].file.name, kv[1].offset)):
        files.setdefault(entry.file.name, []).append(name)
    index = hf_dir / INDEX_FILE
    index_metadata = json.loads(index.read_text()).get("metadata", {}) if index.is_file() else None
    return {"hf_files": files, "hf_index_metadata": index_metadata,
            "hf_tensors": {n: {"dtype": SAFETENSORS_NAMES[e.dtype], "shape": list(e.shape)}
                           for n, e in stored.items()}}


def _read_vocab_shard(reader: CheckpointReader, name: str, spec: ModelSpec, padded: int, tp: int,
                      tp_rank: int) -> torch.Tensor:
    """This TP rank's rows of the padded vocabulary matrix; padding rows are zero."""
    rows = padded // tp
    start, stop = tp_rank * rows, (tp_rank + 1) * rows
    real = reader.read(name, 0, min(start, spec.vocab_size), min(stop, spec.vocab_size))
    if real.shape[0] == rows:
        return real
    return torch.cat([real, real.new_zeros(rows - real.shape[0], *real.shape[1:])])


def build_plain_gpt(spec: ModelSpec, mesh: Any, dtype: torch.dtype, vocab_size: int):
    """This rank's shard of a megatron ``GPTModel`` for ``spec`` with ``vocab_size`` rows, no adapters,
    parameters allocated but not initialised, with transformers' RoPE inverse frequencies.

    A dense model without q/k norms gets megatron's plain local layer spec. One with q/k norms or experts
    gets the layer spec mlora builds (:func:`mlora.models.megatron_build.block_spec`: megatron's local spec
    with its MoE layer where ``moe_layer_freq`` says, SequentialMLP experts, and mlora's norms in the norm
    slots, OLMoE's full-width q/k norm included, which megatron has no module for); its parameter names
    and dist-checkpoint keys are megatron's."""
    from mlora.models.megatron_build import gpt_model, transformer_config

    config = transformer_config(spec, mesh, dtype)
    if spec.moe is None and spec.qk_norm is None:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    else:
        from mlora.models.megatron_build import block_spec
        from mlora.models.norm import QK_NORM_CONFIG_ATTR

        setattr(config, QK_NORM_CONFIG_ATTR, spec.qk_norm)
        layer_spec = block_spec(config)
    return gpt_model(spec, mesh, config, layer_spec, vocab_size)


def _hf_dtype(reader: CheckpointReader, hf_dir: Path) -> torch.dtype:
    dtypes = {e.dtype for e in reader.entries.values()}
    if len(dtypes) != 1:
        raise CheckpointError(f"{hf_dir} mixes tensor dtypes ({', '.join(sorted(map(str, dtypes)))}); "
                              "pass dtype= (--dtype) to choose the checkpoint's dtype")
    return dtypes.pop()


def _copy_side_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.iterdir()):
        if path.is_file() and not path.name.endswith(_WEIGHT_FILES):
            shutil.copyfile(path, dst / path.name)


def hf_to_mcore(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, tp: int = 1, pp: int = 1,
                dtype: str | torch.dtype | None = None, make_vocab_size_divisible_by: int = 128,
                progress: bool = True, ep: int = 1) -> Path:
    """Convert the HF checkpoint in ``hf_dir`` into a megatron-core dist checkpoint in ``out_dir``.

    Collective over :func:`ranks_needed` ``(tp, pp, ep)`` ranks (torchrun; one plain process when all are
    1): the world size must equal it. ``ep`` splits a mixture of experts' experts over ranks (each writes
    its own). ``dtype`` (default: the HF tensors' own) is the stored dtype; keep it for a bit-identical
    way back. Returns the dist checkpoint directory (``out_dir/release``). Raises ValueError/CheckpointError,
    on every rank, for a layout that does not divide the model, a non-empty ``out_dir`` or an HF checkpoint
    that does not match its config."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from mlora.formats.fp8_checkpoint import fp8_quantization_config
    from mlora.parallel.mesh import init_parallel

    for name, value in (("tp", tp), ("pp", pp), ("ep", ep)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: it must be a positive integer")
    hf, out = Path(hf_dir), Path(out_dir)
    spec = model_spec(load_hf_config(hf))
    check_layout(spec, tp, pp, ep)
    if fp8_quantization_config(json.loads((hf / "config.json").read_text())) is not None:
        raise ValueError(f"{hf} is a block-quantized FP8 checkpoint (quantization_config); hf-to-mcore converts "
                         "unquantized checkpoints (bfloat16, float16, float32) only")
    padded = padded_vocab_size(spec.vocab_size, tp, make_vocab_size_divisible_by)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not an empty directory; choose a new directory")
    world = int(os.environ.get("WORLD_SIZE", "1")) if not dist.is_initialized() else dist.get_world_size()
    needed = ranks_needed(tp, pp, ep)
    if world != needed:
        with_ep = f" with ep={ep}" if ep > 1 else ""
        raise ValueError(f"tp={tp} × pp={pp}{with_ep} needs {needed} ranks, this run has {world}: launch it with "
                         f"torchrun --nproc_per_node={needed} (a dist checkpoint is written by one rank per shard)")
    with CheckpointReader(hf) as reader:
        expose_gpt_oss_experts(reader, spec)  # gpt-oss's stacked experts, read expert by expert
        check_hf_checkpoint(reader, spec, hf)  # every rank checks the whole model: headers only
        dtype = _dtype_from_name(dtype) if isinstance(dtype, str) else dtype or _hf_dtype(reader, hf)
        layout = _source_layout(reader, hf)
        mesh = init_parallel(tp=tp, pp=pp, ep=ep)
        model = build_plain_gpt(spec, mesh, dtype, padded)
        _fill_from_hf(model, reader, spec, mesh, padded, progress and mesh.rank == 0)
    ckpt = out / RELEASE_DIR
    if mesh.rank == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    sharded = model_sharded_state_dict(model, spec, metadata=dict(CONTENT_METADATA))
    _check_sharded_keys(sharded, spec, mesh, padded)
    if mesh.rank == 0 and progress:
        print(f"hf-to-mcore: saving with megatron-core dist_checkpointing to {ckpt}", flush=True)
    dist_checkpointing.save({"model": sharded, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0},
                            str(ckpt), content_metadata=dict(CONTENT_METADATA))
    del sharded, model
    if mesh.rank == 0:
        import megatron.core

        _copy_side_files(hf, ckpt / HF_SIDE_DIR)
        info = {"format": INFO_FORMAT, "source": str(hf.resolve()), "architecture": spec.architecture,
                "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                "expert_model_parallel_size": ep,
                "dtype": str(dtype).removeprefix("torch."), "vocab_size": spec.vocab_size,
                "padded_vocab_size": padded, "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
                "megatron_core": megatron.core.__version__, **layout}
        (ckpt / CONVERT_INFO).write_text(json.dumps(info, indent=1))
        # last: Megatron-LM only sees a checkpoint once its tracker file names it
        (out / TRACKER_FILE).write_text(RELEASE_DIR)
    dist.barrier()
    return ckpt


def _fill_from_hf(model: torch.nn.Module, reader: CheckpointReader, spec: ModelSpec, mesh: Any, padded: int,
                  progress: bool) -> None:
    local_layers = [layer.layer_number - 1 for layer in model.decoder.layers]
    expected = list(stage_layers(spec, mesh.pp, mesh.pp_rank))
    if local_layers != expected:  # our HF mapping and megatron must agree on who holds which layer
        raise RuntimeError(f"megatron placed layers {local_layers} on stage {mesh.pp_rank}, expected {expected}")
    params = dict(model.named_parameters())
    maps = stage_param_maps(spec, mesh.pp, mesh.pp_rank, mesh.ep, mesh.ep_rank)
    bar = _progress(len(maps), "hf-to-mcore (rank 0's shard)", progress)
    for pm in maps:
        param = params.pop(pm.megatron_name)
        if pm.kind == VOCAB:
            shard = _read_vocab_shard(reader, pm.hf_names[0], spec, padded, mesh.tp, mesh.tp_rank)
        else:
            shard = pm.load(reader, spec, mesh.tp, mesh.tp_rank)
        if shard.shape != param.shape:
            raise CheckpointError(f"{pm.hf_names} give a shard of shape {tuple(shard.shape)} for "
                                  f"{pm.megatron_name}, which has shape {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(shard)
        del shard
        bar.update(1)
    bar.close()
    if params:
        raise RuntimeError(f"GPTModel parameters without an HF mapping: {sorted(params)}")


def _check_sharded_keys(sharded: dict, spec: ModelSpec, mesh: Any, padded: int) -> None:
    """The keys, offsets and global shapes megatron gives this rank's parameters must be the ones export
    reads (fails loudly if a megatron-core release renames or restacks them)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from mlora.formats.weight_map import local_experts

    layout = KeyLayout.written(spec)
    shapes = expected_shapes(spec, padded, layout)
    first = stage_layers(spec, mesh.pp, mesh.pp_rank).start
    first_expert = local_experts(spec, mesh.ep, mesh.ep_rank).start if spec.moe is not None else 0
    for pm in stage_param_maps(spec, mesh.pp, mesh.pp_rank, mesh.ep, mesh.ep_rank):
        item = sharded.get(pm.megatron_name)
        if is_export_copy(pm, spec):
            continue  # tied copy, stored as the embedding
        key, index = layout.key(pm.megatron_name, first, first_expert)
        if isinstance(item, ShardedTensorFactory) and item.key == key:
            continue  # linear_fc1 ([gate; up] split on save): its stored shape is checked on export
        if (not isinstance(item, ShardedTensor) or item.key != key or item.global_shape != shapes[key]
                or tuple(item.global_offset[:len(index)]) != index):
            found = (f"{item.key!r}, global shape {item.global_shape} at offset {item.global_offset}"
                     if isinstance(item, ShardedTensor) else repr(item))
            raise RuntimeError(f"megatron-core stores {pm.megatron_name} as {found}; mlora expects {key!r}, "
                               f"global shape {shapes[key]} at index {index}")


# ----------------------------------------------------------------------------- mcore -> HF
@dataclass(frozen=True)
class McoreCheckpoint:
    """A located megatron-core dist checkpoint and what is known about its source."""

    directory: Path  # the dist checkpoint itself (metadata.json, .metadata, *.distcp)
    info: dict | None  # mlora_convert.json, when written by hf_to_mcore
    config_dir: Path  # where config.json and the other HF side files are


def locate_mcore_checkpoint(path: str | os.PathLike, hf_config: str | os.PathLike | None = None) -> McoreCheckpoint:
    """Find the dist checkpoint under ``path`` (a Megatron-LM save directory with
    ``latest_checkpointed_iteration.txt``, or the ``release``/``iter_*`` directory itself) and the HF
    config that describes it (``hf_config`` or the copy stored at conversion)."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"megatron checkpoint directory {str(root)!r} does not exist")
    directory = root
    tracker = root / TRACKER_FILE
    if tracker.is_file() and not (root / "metadata.json").is_file():
        text = tracker.read_text().strip()
        directory = root / (RELEASE_DIR if text == RELEASE_DIR else f"iter_{int(text):07d}" if text.isdigit() else text)
        if not directory.is_dir():
            raise FileNotFoundError(f"{tracker} names {text!r} but {directory} does not exist")
    if not (directory / "metadata.json").is_file():
        raise CheckpointError(
            f"{directory} is not a megatron-core dist checkpoint: no metadata.json "
            f"(and no {TRACKER_FILE} pointing at one)")
    backend = json.loads((directory / "metadata.json").read_text()).get("sharded_backend")
    if backend != "torch_dist":
        raise CheckpointError(f"{directory} uses sharded_backend {backend!r}; supported: 'torch_dist'")
    info_path = directory / CONVERT_INFO
    info = json.loads(info_path.read_text()) if info_path.is_file() else None
    if info is not None and info.get("format") != INFO_FORMAT:
        raise CheckpointError(f"{info_path} has format {info.get('format')!r}; this mlora reads {INFO_FORMAT!r}")
    if hf_config is not None:
        config_dir = Path(hf_config)
    elif (directory / HF_SIDE_DIR / "config.json").is_file():
        config_dir = directory / HF_SIDE_DIR
    else:
        raise CheckpointError(
            f"{directory} holds no HF config ({HF_SIDE_DIR}/config.json: it was not written by "
            "tools/convert_checkpoint.py); pass the HF config.json directory of its model with --hf-config")
    return McoreCheckpoint(directory, info, config_dir)


def _dcp_metadata(directory: Path):
    from torch.distributed.checkpoint import FileSystemReader

    if not (directory / ".metadata").is_file():
        raise CheckpointError(f"{directory} has no .metadata: the save did not finish, or the file was removed")
    return FileSystemReader(str(directory)).read_metadata()


def check_shard_files(directory: Path, metadata: Any) -> None:
    """Raise naming every ``*.distcp`` file the checkpoint's index needs that is missing or too short."""
    needs: dict[str, tuple[int, set[str]]] = {}
    for index, info in metadata.storage_data.items():
        end, keys = needs.get(info.relative_path, (0, set()))
        keys.add(index.fqn)
        needs[info.relative_path] = (max(end, info.offset + info.length), keys)
    missing = [f"{name} (holds {_short(sorted(keys), 3)})" for name, (_, keys) in sorted(needs.items())
               if not (directory / name).is_file()]
    if missing:
        raise CheckpointError(f"dist checkpoint {directory} is missing shard files: {'; '.join(missing)}")
    short = [f"{name} is {(directory / name).stat().st_size} bytes, its index needs {end}"
             for name, (end, _) in sorted(needs.items()) if (directory / name).stat().st_size < end]
    if short:
        raise CheckpointError(f"dist checkpoint {directory} has truncated shard files: {'; '.join(short)}")


def _model_tensors(metadata: Any) -> dict[str, Any]:
    """Tensor entries of the model: optimizer state, RNG and megatron's ``_extra_state`` objects aside."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {k: md for k, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata) and not k.startswith(("optimizer.", "rng_state"))}


def check_against_config(ckpt: McoreCheckpoint, spec: ModelSpec, tensors: dict[str, Any],
                         layout: KeyLayout | None = None) -> int:
    """Raise unless the checkpoint's tensors are exactly those of ``spec``'s GPTModel in ``layout``
    (default: the one its keys show); returns the padded vocabulary size. Names the config and the first
    mismatches."""
    where = f"the HF config in {ckpt.config_dir} ({spec.architecture})"
    info = ckpt.info or {}
    if info and info.get("architecture") != spec.architecture:
        raise CheckpointError(
            f"{ckpt.directory} was converted from a {info.get('architecture')} checkpoint; {where} is another "
            "architecture: pass the config of the model it was converted from")
    emb = tensors.get("embedding.word_embeddings.weight")
    if emb is None:
        raise CheckpointError(f"{ckpt.directory} has no embedding.word_embeddings.weight: not a GPT checkpoint")
    padded = int(emb.size[0])
    if padded < spec.vocab_size:
        raise CheckpointError(f"{ckpt.directory} has {padded} vocabulary rows; {where} says vocab_size="
                              f"{spec.vocab_size}")
    if info and info.get("padded_vocab_size", padded) != padded:
        raise CheckpointError(f"{ckpt.directory} has {padded} vocabulary rows, {CONVERT_INFO} recorded "
                              f"{info['padded_vocab_size']}")
    expected = expected_shapes(spec, padded, layout or KeyLayout.stored(spec, tensors))
    unexpected = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    wrong = [f"{k} is {tuple(tensors[k].size)} in the checkpoint, the config implies {shape}"
             for k, shape in expected.items() if k in tensors and tuple(tensors[k].size) != shape]
    problems = []
    if unexpected:
        problems.append(f"it holds tensors {spec.architecture} has no place for: {_short(unexpected)}")
    if missing:
        problems.append(f"it lacks tensors {spec.architecture} needs: {_short(missing)}")
    if wrong:
        problems.append("; ".join(wrong[:3]))
    if problems:
        raise CheckpointError(
            f"dist checkpoint {ckpt.directory} does not match {where}: " + "; ".join(problems)
            + ". It is a checkpoint of another model or architecture, or its stored config disagrees with it")
    return padded


@functools.cache
def _slice_planner_class() -> type:
    """A torch.distributed.checkpoint load planner reading given slices of stored tensors into given
    buffers (one process, no process group): ``requests`` maps a key to (buffer, offsets in the stored
    tensor). Only the saved chunks that overlap a slice are read. Built once (torch imported lazily);
    a class made per call would sit in a reference cycle holding its buffers until the next gc run."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SlicePlanner(DefaultLoadPlanner):
        def __init__(self, requests: dict[str, tuple[torch.Tensor, tuple[int, ...]]]) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.requests = requests

        def create_local_plan(self) -> LoadPlan:
            items = []
            for key, (buffer, offsets) in self.requests.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=buffer.shape)
                items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index):
            return self.requests[index.fqn][0]

    return SlicePlanner


class DistCheckpointReader:
    """Slices of the tensors of a ``torch_dist`` checkpoint, one small read at a time."""

    def __init__(self, directory: Path, tensors: dict[str, Any]) -> None:
        from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
            CachedMetadataFileSystemReader,
        )

        self.directory = directory
        self.tensors = tensors
        self._reader = CachedMetadataFileSystemReader(str(directory))  # the index is parsed once

    def read(self, reads: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """``{key: index}`` -> ``{key: tensor}``: the slice ``key[index]`` of a stored tensor (``index`` on
        its leading, stacked axes: layer, expert; ``()`` for the whole tensor), in the stored dtype."""
        import torch.distributed.checkpoint as dcp

        requests = {}
        for key, index in reads.items():
            md = self.tensors[key]
            inner = tuple(md.size)[len(index):]
            buffer = torch.empty((1,) * len(index) + inner, dtype=md.properties.dtype)
            requests[key] = (buffer, tuple(index) + (0,) * len(inner))
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.load({k: b for k, (b, _) in requests.items()}, storage_reader=self._reader,
                     planner=_slice_planner_class()(requests), no_dist=True)
        return {k: b.reshape(b.shape[len(reads[k]):]) for k, (b, _) in requests.items()}


def _hf_sources(spec: ModelSpec) -> dict[str, list[ParamMap]]:
    """HF tensor name -> the TP1 ParamMaps it comes from (the tied copy left out): one, or for a gpt-oss stacked
    expert tensor every expert's (:func:`~mlora.formats.fused_experts.fuse_gpt_oss_experts`)."""
    sources: dict[str, list[ParamMap]] = {}
    for pm in stage_param_maps(spec, 1, 0):
        if is_export_copy(pm, spec):
            continue
        for name in gpt_oss_layout({n: (None, s) for n, s in pm.hf_shapes(spec).items()}, spec):
            if pm not in sources.setdefault(name, []):
                sources[name].append(pm)
    return sources


def _hf_shapes(sources: dict[str, list[ParamMap]], names: Iterable[str], spec: ModelSpec) -> dict[str, tuple]:
    """The HF shapes of ``names`` (gpt-oss's stacked expert tensors whole)."""
    per_expert = {n: (None, s) for name in names for pm in sources[name] for n, s in pm.hf_shapes(spec).items()}
    return {n: shape for n, (_, shape) in gpt_oss_layout(per_expert, spec).items()}


def _convert_all(pms: list[ParamMap], reader: "DistCheckpointReader", spec: ModelSpec, layout: "KeyLayout"
                 ) -> dict[str, torch.Tensor]:
    """The HF tensors of ``pms`` (gpt-oss's per-expert pieces stacked)."""
    tensors: dict[str, torch.Tensor] = {}
    for pm in pms:
        tensors.update(_convert(pm, reader, spec, layout))
    return dict(fuse_gpt_oss_experts(tensors.items(), spec))


def _default_layout(sources: dict[str, list[ParamMap]], spec: ModelSpec, dtype: torch.dtype
                    ) -> dict[str, list[str]]:
    """HF file names and tensor order for a checkpoint without a recorded source layout: HF's order,
    split into ``model-0000i-of-0000n.safetensors`` at 5 GiB like ``save_pretrained``."""
    item = torch.empty((), dtype=dtype).element_size()
    shapes = _hf_shapes(sources, sources, spec)
    groups: list[list[str]] = [[]]
    size = 0
    for name in sources:
        nbytes = torch.Size(shapes[name]).numel() * item
        if groups[-1] and size + nbytes > HF_SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}


def mcore_to_hf(mcore_dir: str | os.PathLike, out_dir: str | os.PathLike,
                hf_config: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Convert a megatron-core dist checkpoint into an HF checkpoint in ``out_dir``; returns ``out_dir``.

    One process, no process group; a few tensors in memory at a time. The architecture comes from
    the HF config stored at conversion, or ``hf_config`` (a directory with ``config.json``) for a
    checkpoint written by Megatron-LM or Megatron-Bridge. Files, tensor order, names and dtypes follow
    the recorded source layout, so a checkpoint made by :func:`hf_to_mcore` comes back bit-identical.
    Raises CheckpointError for missing or truncated shard files and for a checkpoint whose tensors
    do not match the config (another architecture or size)."""
    from mlora.formats.safetensors_writer import SafetensorsWriter

    out = Path(out_dir)
    ckpt = locate_mcore_checkpoint(mcore_dir, hf_config)
    spec = model_spec(load_hf_config(ckpt.config_dir))
    metadata = _dcp_metadata(ckpt.directory)
    check_shard_files(ckpt.directory, metadata)
    tensors = _model_tensors(metadata)
    layout = KeyLayout.stored(spec, tensors)
    check_against_config(ckpt, spec, tensors, layout)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not an empty directory; choose a new directory")
    if out.resolve() == ckpt.config_dir.resolve():
        raise ValueError(f"--out {out} is the HF config directory; choose another directory")
    sources = _hf_sources(spec)
    info = ckpt.info or {}
    if info:
        files = info["hf_files"]
        recorded = {n for names in files.values() for n in names}
        if recorded != set(sources):
            raise CheckpointError(f"{CONVERT_INFO} in {ckpt.directory} lists HF tensors {spec.architecture} "
                                  f"does not produce: {_short(sorted(recorded ^ set(sources)))}")
        dtypes = {n: SAFETENSORS_DTYPES[t["dtype"]] for n, t in info["hf_tensors"].items()}
    else:
        stored = tensors["embedding.word_embeddings.weight"].properties.dtype
        files = _default_layout(sources, spec, stored)
        dtypes = {}
    reader = DistCheckpointReader(ckpt.directory, tensors)
    out.mkdir(parents=True, exist_ok=True)
    pending: dict[str, torch.Tensor] = {}  # HF tensors converted with a sibling, not yet written
    total_bytes = 0
    bar = _progress(len(sources), "mcore-to-hf", progress)
    for file, names in files.items():
        shapes = _hf_shapes(sources, names, spec)
        file_layout = {}
        for name in names:
            key, _ = layout.key(sources[name][0].megatron_name)
            file_layout[name] = (dtypes.get(name, tensors[key].properties.dtype), shapes[name])
            total_bytes += torch.Size(shapes[name]).numel() * file_layout[name][0].itemsize
        writer = SafetensorsWriter(out / file, file_layout, metadata={"format": "pt"})
        try:
            for name in names:
                if name not in pending:
                    pending.update(_convert_all(sources[name], reader, spec, layout))
                tensor = pending.pop(name)
                writer.write(name, tensor.to(file_layout[name][0]))
                del tensor  # hold no written tensor while the next one is read
                bar.update(1)
        except BaseException:
            writer.abort()
            raise
        writer.close()
    bar.close()
    if len(files) > 1:
        index_md = dict(info.get("hf_index_metadata") or {})
        index_md["total_size"] = total_bytes
        weight_map = {n: f for f, names in files.items() for n in names}
        (out / INDEX_FILE).write_text(json.dumps({"metadata": index_md, "weight_map": dict(sorted(weight_map.items()))},
                                                 indent=2) + "\n")
    _copy_side_files(ckpt.config_dir, out)
    return out


def _convert(pm: ParamMap, reader: DistCheckpointReader, spec: ModelSpec, layout: KeyLayout
             ) -> dict[str, torch.Tensor]:
    """The HF tensors of one megatron parameter, read as its TP1 form (one layer's or expert's slice)."""
    key, index = layout.key(pm.megatron_name)
    full = reader.read({key: index})[key]
    if pm.kind == VOCAB:  # drop the padding rows without a copy (to_hf concatenates TP shards first)
        return {pm.hf_names[0]: full[: spec.vocab_size]}
    return pm.to_hf([full], spec)
