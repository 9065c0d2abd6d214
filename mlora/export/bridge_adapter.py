"""Megatron-Bridge / NeMo LoRA checkpoints -> PEFT adapters, exactly and tensor by tensor.

Megatron-Bridge keeps a LoRA factor next to the base linear it adapts (``peft/lora.py``,
``peft/canonical_lora.py``, ``peft/utils.py:ParallelLinearAdapter``)::

    decoder.layers.N.self_attention.linear_qkv.adapter.linear_in.weight    A  [r, in]
    decoder.layers.N.self_attention.linear_qkv.adapter.linear_out.weight   B  [out, r]

- *performant* LoRA (``LoRA``): one adapter per fused layer. ``linear_qkv``'s A is shared by
  q, k and v; its B is fused in Megatron's QKV layout (per query group: the group's q heads, then
  its k head, then its v head). ``linear_fc1``'s A is shared by gate and up; its B is ``[gate; up]``
  (the global layout megatron-core's swiglu sharded factory writes at any TP). In PEFT terms this
  is q/k/v (gate/up) with one common ``lora_A`` and each ``lora_B`` a row block of the fused B:
  an exact re-expression, since ``B·A`` row blocks are ``B_q·A``, ``B_k·A``, ``B_v·A``.
- *canonical* LoRA (``CanonicalLoRA``): separate adapters ``linear_qkv.adapter.adapter_q`` /
  ``adapter_k`` / ``adapter_v`` and ``linear_fc1.adapter.adapter_gate`` / ``adapter_up``, each
  with its own ``linear_in`` / ``linear_out`` in HF row order.
- ``linear_proj`` (o_proj) and ``linear_fc2`` (down_proj) carry one plain adapter in both.

The branch is scaled by ``alpha / dim`` (Bridge's ``dim`` is PEFT's ``r``), so ``lora_alpha =
alpha``. Stored checkpoints (read without Megatron-LM, on CPU):

- a megatron-core ``dist_checkpointing`` directory (``torch_dist``; Bridge's ``iter_NNNNNNN/``
  or a run directory with ``latest_checkpointed_iteration.txt``; NeMo 2's ``weights/``). Global
  tensors, so the TP/PP of the run does not matter (but see :meth:`DistCheckpointSource.swiglu_tp`
  for canonical gate/up); layers either stacked on a leading axis
  (``decoder.layers.self_attention...`` of shape ``[L, ...]``) or one key per layer.
  ``run_config.yaml`` (in the iteration or the run directory) gives ``peft.dim/alpha/dropout``.
- a plain state dict of the adapter parameters (``.safetensors`` or ``.pt``) with the same
  names as a TP1/PP1 model's ``state_dict()`` (``module.``/``model.`` prefixes allowed).
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from mlora.export.peft_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_adapter_config, peft_tensor_name
from mlora.formats.dtypes import SAFETENSORS_DTYPES
from mlora.formats.hf_config import ModelSpec, load_hf_config, model_spec
from mlora.formats.safetensors_writer import SafetensorsWriter
from mlora.formats.weight_map import FC1, QKV, ParamMap
from mlora.lora.config import LoraConfig
from mlora.lora.sites import factor_shapes, model_sites

RUN_CONFIG = "run_config.yaml"
_FACTOR_DTYPES = ("F64", "F32", "F16", "BF16")  # the safetensors dtypes a LoRA factor may have
TRACKER = "latest_checkpointed_iteration.txt"

# Bridge module -> the HF projections it carries, in its fused order.
MODULE_PROJECTIONS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
# CanonicalLoRA's sub-adapters (peft/canonical_lora.py) -> HF projection.
CANONICAL_PARTS = {
    "linear_qkv": {"adapter_q": "q_proj", "adapter_k": "k_proj", "adapter_v": "v_proj"},
    "linear_fc1": {"adapter_gate": "gate_proj", "adapter_up": "up_proj"},
}
_PARENT = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}

_KEY = re.compile(
    r"^(?:(?:module|model|language_model)\.)*decoder\.layers\.(?:(?P<layer>\d+)\.)?(?P<parent>self_attention|mlp)\."
    r"(?P<module>linear_qkv|linear_proj|linear_fc1|linear_fc2)\.adapter\."
    r"(?:(?P<part>adapter_[a-z]+)\.)?(?P<factor>linear_in|linear_out)\.weight$")
VALID_FORMS = ("decoder.layers.N.self_attention.linear_qkv.adapter.linear_in.weight (and .linear_out; "
               "linear_proj, mlp.linear_fc1, mlp.linear_fc2)",
               "decoder.layers.N.self_attention.linear_qkv.adapter.adapter_q.linear_in.weight (canonical: "
               "adapter_q/adapter_k/adapter_v; mlp.linear_fc1.adapter.adapter_gate/adapter_up)",
               "the same without the layer number N for layers stacked on a leading axis")


class BridgeCheckpointError(ValueError):
    """A Megatron-Bridge adapter checkpoint that cannot be converted (names, shapes, settings)."""


# ------------------------------------------------------------------ sources
@dataclass(frozen=True)
class SourceTensor:
    """One stored tensor: its key, dtype and shape (read lazily)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class AdapterSource:
    """Tensors of a stored checkpoint, listed from metadata and read one key at a time."""

    path: Path
    kind: str
    tensors: dict[str, SourceTensor]

    def read(self, key: str) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        """Release files and process groups."""

    def __enter__(self) -> "AdapterSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DistCheckpointSource(AdapterSource):
    """A megatron-core ``dist_checkpointing`` directory, read with megatron-core's own loader.

    megatron-core loads through ``torch.distributed``; a plain process gets a one-rank gloo group
    on an in-memory store (no network) for the duration, torn down on ``close``.
    """

    kind = "megatron-core dist checkpoint"

    def __init__(self, path: Path) -> None:
        import torch.distributed as dist
        from megatron.core import dist_checkpointing

        self.path = path
        self._own_group = False
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self._own_group = True
        self._dc = dist_checkpointing
        try:
            meta = dist_checkpointing.load_tensors_metadata(str(path))
        except Exception as exc:
            self.close()
            raise BridgeCheckpointError(f"{path}: megatron-core cannot read this dist checkpoint: {exc}") from exc
        self.tensors = {k: SourceTensor(k, v.dtype, tuple(v.global_shape)) for k, v in meta.items()}
        # How each tensor was cut when saved (torch DCP metadata: one chunk per saved piece).
        from torch.distributed.checkpoint import FileSystemReader

        try:
            storage = FileSystemReader(str(path)).read_metadata().state_dict_metadata
            self._chunks = {k: [tuple(c.offsets) for c in getattr(v, "chunks", ())] for k, v in storage.items()}
        except Exception:  # noqa: BLE001 - not torch_dist (e.g. the old zarr backend): only swiglu_tp needs it
            self._chunks = None

    def swiglu_tp(self, key: str) -> int:
        """The TP size of a ``linear_fc1`` adapter's B saved through megatron-core's swiglu factory.

        Bridge applies the factory to every ``linear_out`` under ``linear_fc1`` of a gated MLP,
        canonical ``adapter_gate`` / ``adapter_up`` included: TP rank r's rows are halved and the
        halves stored as fragments r and TP + r of 2·TP. For the fused B (rank r holds
        ``[gate_r; up_r]``) that is ``[gate; up]`` at any TP; for a canonical B it permutes rows
        unless TP is 1, so the saved TP (half the fragments on the row axis) is needed to undo it.
        """
        if self._chunks is None:
            raise BridgeCheckpointError(f"{self.path}: cannot read how {key} was cut when saved (not a torch_dist "
                                        "checkpoint), so the TP that permuted its rows is unknown")
        offsets = self._chunks.get(key, [])
        axis = len(self.tensors[key].shape) - 2
        starts = {o[axis] for o in offsets}
        return len(starts) // 2 if len(starts) >= 2 and len(starts) % 2 == 0 else 1

    def read(self, key: str) -> torch.Tensor:
        from megatron.core.dist_checkpointing import ShardedTensor

        t = self.tensors[key]
        # The whole global tensor as one "shard": megatron-core assembles it from however many
        # TP/PP pieces were saved. One key at a time keeps memory at one key (all layers of one
        # factor when layers are stacked).
        want = ShardedTensor.from_rank_offsets(key, torch.empty(t.shape, dtype=t.dtype))
        # Every rank of a multi-rank caller reads the whole tensor: no partition to validate.
        return self._dc.load({"t": want}, str(self.path), validate_access_integrity=False)["t"]

    def close(self) -> None:
        if self._own_group:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._own_group = False


class SafetensorsSource(AdapterSource):
    """A ``.safetensors`` state dict, read lazily."""

    kind = "safetensors state dict"

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = path
        self._f = safe_open(str(path), framework="pt")
        self.tensors = {}
        for k in self._f.keys():
            sl = self._f.get_slice(k)
            self.tensors[k] = SourceTensor(k, _safetensors_dtype(sl.get_dtype(), path, k), tuple(sl.get_shape()))

    def read(self, key: str) -> torch.Tensor:
        return self._f.get_tensor(key)


class TorchSource(AdapterSource):
    """A ``torch.save``d state dict (memory-mapped, ``weights_only``: no code is run), possibly
    nested under ``"model"`` or ``"state_dict"`` as training scripts save it."""

    kind = "torch state dict"

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # files in torch's legacy (pre-zip) format cannot be memory-mapped
            obj = None
        except Exception as exc:
            raise BridgeCheckpointError(f"{path}: not a loadable torch state dict ({exc})") from exc
        if obj is None:
            try:
                obj = torch.load(str(path), map_location="cpu", weights_only=True)
            except Exception as exc:
                raise BridgeCheckpointError(f"{path}: not a loadable torch state dict ({exc})") from exc
        for nest in ("model", "state_dict"):
            if isinstance(obj, dict) and isinstance(obj.get(nest), dict):
                obj = obj[nest]
        if not isinstance(obj, dict):
            raise BridgeCheckpointError(f"{path}: holds a {type(obj).__name__}, expected a state dict")
        self._sd = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        self.tensors = {k: SourceTensor(k, v.dtype, tuple(v.shape)) for k, v in self._sd.items()}

    def read(self, key: str) -> torch.Tensor:
        return self._sd[key]


def _safetensors_dtype(name: str, path: Path, key: str) -> torch.dtype:
    table = {n: SAFETENSORS_DTYPES[n] for n in _FACTOR_DTYPES}
    if name not in table:
        raise BridgeCheckpointError(f"{path}: tensor {key!r} has dtype {name}; LoRA factors must be one of "
                                    f"{', '.join(table)}")
    return table[name]


def resolve_checkpoint(path: str | os.PathLike) -> tuple[Path, str]:
    """The concrete checkpoint behind ``path`` and its kind ("dist", "safetensors", "torch").

    Accepts a dist checkpoint directory (``metadata.json``), a Bridge run directory (its
    ``latest_checkpointed_iteration.txt`` names the iteration; else the newest ``iter_*``), a
    NeMo 2 checkpoint (``weights/``), or a ``.safetensors`` / ``.pt`` / ``.pth`` / ``.bin`` file.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"adapter checkpoint {str(p)!r} does not exist")
    if p.is_file():
        if p.suffix == ".safetensors":
            return p, "safetensors"
        if p.suffix in (".pt", ".pth", ".bin"):
            return p, "torch"
        raise BridgeCheckpointError(f"{p}: unknown file type {p.suffix!r}; expected a megatron-core dist "
                                    "checkpoint directory or a .safetensors / .pt / .pth / .bin state dict")
    if (p / "metadata.json").is_file():
        return p, "dist"
    if (p / TRACKER).is_file():
        tag = (p / TRACKER).read_text().strip()
        it = p / ("release" if tag == "release" else f"iter_{int(tag):07d}")
        if not it.is_dir():
            raise FileNotFoundError(f"{p / TRACKER} names iteration {tag!r} but {it} does not exist")
        return resolve_checkpoint(it)
    iters = sorted((d for d in p.glob("iter_*") if d.is_dir() and d.name[5:].isdigit()), key=lambda d: int(d.name[5:]))
    if iters:
        return resolve_checkpoint(iters[-1])
    if (p / "weights" / "metadata.json").is_file():
        return p / "weights", "dist"
    files = sorted(f.name for f in p.iterdir())[:10]
    raise FileNotFoundError(
        f"{p} is not an adapter checkpoint: no metadata.json (megatron-core dist checkpoint), no {TRACKER} "
        f"or iter_* directories (Megatron-Bridge run), no weights/ (NeMo 2); it holds {files or 'nothing'}")


def open_source(path: Path, kind: str) -> AdapterSource:
    """An :class:`AdapterSource` for a path from :func:`resolve_checkpoint`."""
    return {"dist": DistCheckpointSource, "safetensors": SafetensorsSource, "torch": TorchSource}[kind](path)


# ------------------------------------------------------------------ settings
@dataclass(frozen=True)
class BridgeLoraSettings:
    """Adapter hyper-parameters of a Bridge run (``run_config.yaml``'s ``peft`` section)."""

    rank: int | None = None
    alpha: float | None = None
    dropout: float = 0.0
    dropout_position: str = "pre"
    flavour: str | None = None  # "lora" / "canonical_lora", from ``_target_``
    source: str | None = None  # where they came from, for messages


def read_run_config(ckpt: Path) -> BridgeLoraSettings:
    """The ``peft`` settings from ``run_config.yaml`` in ``ckpt`` or its parent (where Bridge's
    ``export_adapter_ckpt`` looks too: an iteration directory, then its run directory); empty
    settings if there is none."""
    import yaml

    for d in (ckpt, ckpt.parent):
        f = d / RUN_CONFIG
        if f.is_file():
            raw = yaml.safe_load(f.read_text()) or {}
            peft = raw.get("peft") if isinstance(raw, dict) else None
            if not isinstance(peft, dict):
                raise BridgeCheckpointError(f"{f} has no 'peft' section: not a LoRA run "
                                            "(full fine-tuning checkpoints hold no adapter)")
            target = str(peft.get("_target_", ""))
            if "DoRA" in target:
                raise BridgeCheckpointError(f"{f}: peft {target!r} (DoRA) is not plain LoRA; PEFT's LoRA files "
                                            "cannot express its magnitude vector")
            flavour = "canonical_lora" if "CanonicalLoRA" in target else "lora" if target.endswith("LoRA") else None
            return BridgeLoraSettings(
                rank=int(peft["dim"]) if peft.get("dim") is not None else None,
                alpha=float(peft["alpha"]) if peft.get("alpha") is not None else None,
                dropout=float(peft.get("dropout") or 0.0), dropout_position=str(peft.get("dropout_position", "pre")),
                flavour=flavour, source=str(f))
    return BridgeLoraSettings()


# ------------------------------------------------------------------ plan
@dataclass
class _Factor:
    """Where one HF LoRA factor comes from: a source key (and layer of a stacked key) and how to cut it."""

    hf_name: str
    key: str
    layer_slot: int | None  # index on the stacked axis, None for a per-layer key
    # None: the tensor itself; "qkv:q_proj"... / "fc1:up_proj": a row block of a fused B;
    # "unswiglu:T": a canonical gate/up B saved at TP T (DistCheckpointSource.swiglu_tp)
    cut: str | None
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class ImportPlan:
    """Everything :func:`import_bridge_adapter` will write, decided from metadata alone."""

    factors: list[_Factor]
    modules: set[tuple[int, str]]
    rank: int
    layout: str  # "performant", "canonical", "mixed", or "plain" (only linear_proj / linear_fc2 adapted)
    ignored: list[str] = field(default_factory=list)


def _parse(source: AdapterSource) -> tuple[list[tuple[dict, SourceTensor]], list[str], list[str]]:
    """Adapter tensors (parsed key, tensor), unknown adapter-looking keys, ignored other keys."""
    parsed, unknown, ignored = [], [], []
    for key, t in source.tensors.items():
        if key.endswith("_extra_state") or key.startswith(("optimizer.", "rng_state", "rerun_state")):
            continue
        m = _KEY.match(key)
        if m is None:
            (unknown if ("adapter" in key or "lora" in key.lower()) else ignored).append(key)
            continue
        g = m.groupdict()
        if _PARENT[g["module"]] != g["parent"]:
            unknown.append(key)
            continue
        if g["part"] is not None and g["part"] not in CANONICAL_PARTS.get(g["module"], {}):
            unknown.append(key)
            continue
        parsed.append((g, t))
    return parsed, unknown, ignored


def plan_import(source: AdapterSource, spec: ModelSpec, rank: int | None = None,
                dtype: torch.dtype | None = None) -> ImportPlan:
    """Map every adapter tensor of ``source`` onto PEFT factors of ``spec``'s model and check shapes.

    ``rank``: expected r (from the run config or the user); None takes it from the tensors.
    Raises :class:`BridgeCheckpointError` naming unknown keys, missing or conflicting factors and
    shapes the base does not have.
    """
    parsed, unknown, ignored = _parse(source)
    if unknown:
        shown = "\n  ".join(sorted(unknown)[:20])
        more = f"\n  ... and {len(unknown) - 20} more" if len(unknown) > 20 else ""
        raise BridgeCheckpointError(
            f"{source.path}: {len(unknown)} adapter tensors with unknown module names:\n  {shown}{more}\n"
            "supported names:\n  " + "\n  ".join(VALID_FORMS))
    if not parsed:
        hint = f" (it holds {len(ignored)} other tensors, e.g. {sorted(ignored)[:3]})" if ignored else ""
        raise BridgeCheckpointError(f"{source.path}: no LoRA adapter tensors found{hint}; expected names like "
                                    + VALID_FORMS[0])
    sites = model_sites(spec, 1)
    swiglu_tp = getattr(source, "swiglu_tp", lambda key: 1)  # plain state dicts are TP1: nothing to undo
    # r: the inner dimension every factor shares (A's rows, B's columns).
    ranks = {t.shape[-2] if g["factor"] == "linear_in" else t.shape[-1] for g, t in parsed if len(t.shape) >= 2}
    if rank is None:
        if len(ranks) != 1:
            raise BridgeCheckpointError(f"{source.path}: factors disagree on the LoRA rank: {sorted(ranks)}")
        rank = ranks.pop()
    factors: list[_Factor] = []
    have: dict[tuple[int, str], dict[str, str]] = defaultdict(dict)  # (layer, proj) -> factor -> key
    flavours: set[str] = set()
    for g, t in sorted(parsed, key=lambda gt: gt[1].key):
        module, part, factor = g["module"], g["part"], g["factor"]
        stacked = g["layer"] is None
        layers = range(t.shape[0]) if stacked else [int(g["layer"])]
        shape = t.shape[1:] if stacked else t.shape
        if stacked and t.shape[0] != spec.num_layers:
            raise BridgeCheckpointError(f"{source.path}: {t.key} stacks {t.shape[0]} layers, the base has "
                                        f"{spec.num_layers}: an adapter for another base?")
        projs = MODULE_PROJECTIONS[module] if part is None else (CANONICAL_PARTS[module][part],)
        if len(projs) > 1:
            flavours.add("performant")
        elif part is not None:
            flavours.add("canonical")
        letter = "A" if factor == "linear_in" else "B"
        for layer in layers:
            if layer >= spec.num_layers:
                raise BridgeCheckpointError(f"{source.path}: {t.key} is for layer {layer}, the base has only "
                                            f"{spec.num_layers} layers: an adapter for another base?")
            site = sites[(layer, projs[0])]
            a_shape, _ = factor_shapes(site, projs[0], rank)
            b_rows = sum(site.out_full[site.subs.index(p)] for p in projs)
            want = a_shape if letter == "A" else (b_rows, rank)
            if tuple(shape) != tuple(want):
                what = f"{'+'.join(projs)} {'lora_A' if letter == 'A' else 'lora_B'}"
                raise BridgeCheckpointError(
                    f"{source.path}: {t.key} has shape {tuple(t.shape)}; {what} of this base with r={rank} needs "
                    f"{(spec.num_layers, *want) if stacked else want} (hidden {spec.hidden_size}, {spec.num_heads} "
                    f"heads / {spec.num_kv_heads} kv heads of {spec.head_dim}, intermediate "
                    f"{spec.intermediate_size}): an adapter for another base, or another rank?")
            for proj in projs:
                if letter in have[(layer, proj)]:
                    raise BridgeCheckpointError(
                        f"{source.path}: {proj} lora_{letter} of layer {layer} is given twice: by "
                        f"{have[(layer, proj)][letter]} and {t.key} (performant and canonical adapters mixed?)")
                have[(layer, proj)][letter] = t.key
                cut = None
                if letter == "B" and len(projs) > 1:
                    cut = f"{'qkv' if module == 'linear_qkv' else 'fc1'}:{proj}"
                elif letter == "B" and module == "linear_fc1" and swiglu_tp(t.key) > 1:
                    cut = f"unswiglu:{swiglu_tp(t.key)}"
                out_shape = a_shape if letter == "A" else (site.out_full[site.subs.index(proj)], rank)
                factors.append(_Factor(peft_tensor_name(layer, proj, letter), t.key, layer if stacked else None,
                                       cut, tuple(out_shape), dtype or t.dtype))
    incomplete = sorted(f"layer {layer} {proj} (has only lora_{''.join(v)})" for (layer, proj), v in have.items()
                        if set(v) != {"A", "B"})
    if incomplete:
        raise BridgeCheckpointError(f"{source.path}: LoRA modules without both linear_in and linear_out: "
                                    f"{incomplete[:5]}")
    layout = "mixed" if len(flavours) > 1 else flavours.pop() if flavours else "plain"
    return ImportPlan(factors, set(have), rank, layout, ignored)


# ------------------------------------------------------------------ conversion
def _cut(tensor: torch.Tensor, cut: str | None, spec: ModelSpec) -> torch.Tensor:
    if cut is None:
        return tensor
    kind, proj = cut.split(":")
    if kind == "unswiglu":  # stored [w_0..w_{t-1}, v_0..v_{t-1}], rank r's rows were [w_r; v_r]
        t = int(proj)
        rows = tensor.shape[0]
        return tensor.reshape(2, t, rows // (2 * t), -1).transpose(0, 1).reshape(rows, -1).contiguous()
    if kind == "qkv":  # de-interleave Megatron's per-query-group QKV rows (mlora.formats.weight_map)
        parts = ParamMap("lora_B", ("q_proj", "k_proj", "v_proj"), QKV).to_hf([tensor], spec)
    else:  # [gate; up]
        parts = ParamMap("lora_B", ("gate_proj", "up_proj"), FC1).to_hf([tensor], spec)
    return parts[proj].contiguous()


def _tensors(source: AdapterSource, plan: ImportPlan, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT name, tensor) in plan order, reading each source key once."""
    current, data = None, None
    for f in plan.factors:
        if f.key != current:
            current, data = f.key, None
            data = source.read(f.key)
        t = data if f.layer_slot is None else data[f.layer_slot]
        yield f.hf_name, _cut(t, f.cut, spec).to(f.dtype)


def import_bridge_adapter(checkpoint: str | os.PathLike, base: str | os.PathLike, out_dir: str | os.PathLike,
                          alpha: float | None = None, rank: int | None = None, dropout: float | None = None,
                          dtype: torch.dtype | None = None, progress: bool = True,
                          log: Callable[[str], None] = print) -> Path:
    """Convert a Megatron-Bridge / NeMo LoRA checkpoint into a PEFT adapter directory.

    Args:
        checkpoint: dist checkpoint directory, Bridge run directory, or ``.safetensors``/``.pt`` file.
        base: the HF model directory the adapter was trained on (shapes are checked against it
            and it is recorded as ``base_model_name_or_path``).
        out_dir: where ``adapter_model.safetensors`` and ``adapter_config.json`` are written
            (each appears atomically).
        alpha: lora_alpha, used where ``run_config.yaml`` does not give it; a value that contradicts
            it is an error. No default (scaling is ``alpha / r``).
        rank: r, likewise; defaults to the factors' shared inner dimension.
        dropout: lora_dropout to record, likewise (default: the run's, or 0).
        dtype: cast factors to this dtype (default: as stored).
        progress: show a progress bar.
        log: where one-line notes go.

    Returns ``out_dir``. Memory: one stored key (all layers of one factor when layers are stacked)
    plus the tensor being written.
    """
    top = Path(checkpoint)
    path, kind = resolve_checkpoint(top)
    spec = model_spec(load_hf_config(base))
    settings = read_run_config(path if path.is_dir() else path.parent)
    alpha = _agree("alpha", settings.alpha, alpha, settings.source)
    rank = _agree("rank", settings.rank, rank, settings.source)
    dropout = _agree("dropout", settings.dropout if settings.source else None, dropout, settings.source) or 0.0
    if alpha is None:
        raise BridgeCheckpointError(
            f"no LoRA alpha for {top}: no {RUN_CONFIG} with a peft.alpha was found next to it; pass --alpha "
            "(the branch is scaled by alpha / r, so it cannot be guessed)")
    with open_source(path, kind) as source:
        plan = plan_import(source, spec, rank, dtype)
        if settings.flavour == "canonical_lora" and plan.layout == "performant" or \
                settings.flavour == "lora" and plan.layout == "canonical":
            raise BridgeCheckpointError(f"{settings.source} says {settings.flavour!r}, but the tensors of {path} "
                                        f"are in the {plan.layout} layout")
        log(f"{source.kind} {path}: {len(plan.factors)} PEFT factors from {len({f.key for f in plan.factors})} "
            f"stored tensors ({plan.layout} LoRA, r={plan.rank}, alpha={alpha:g})"
            + (f"; ignored {len(plan.ignored)} non-adapter tensors" if plan.ignored else ""))
        undone = sorted({f.cut.split(":")[1] for f in plan.factors if f.cut and f.cut.startswith("unswiglu")})
        if undone:
            log(f"note: canonical gate/up adapters saved at TP{'/'.join(undone)}: undoing megatron-core's swiglu "
                "split of their B rows")
        if settings.dropout_position == "post" and dropout:
            log("note: the run used dropout after the LoRA branch (dropout_position=post); PEFT applies "
                "lora_dropout before it (training only; inference is unaffected)")
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        layout = {f.hf_name: (f.dtype, f.shape) for f in plan.factors}
        writer = SafetensorsWriter(out / ADAPTER_WEIGHTS, layout, metadata={"format": "pt"})
        bar = _progress(len(plan.factors), progress)
        try:
            for name, tensor in _tensors(source, plan, spec):
                writer.write(name, tensor)
                bar.update(1)
        except BaseException:
            writer.abort()
            raise
        finally:
            bar.close()
        writer.close()
    lora = LoraConfig(rank=plan.rank, alpha=alpha, dropout=dropout)
    config = peft_adapter_config(lora, plan.modules, spec.num_layers, str(base), spec.architecture)
    tmp = out / (ADAPTER_CONFIG + ".tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / ADAPTER_CONFIG)
    return out


def _agree(name: str, stored, given, source: str | None):
    if stored is not None and given is not None and float(stored) != float(given):
        raise BridgeCheckpointError(f"--{name} {given} contradicts {name}={stored} in {source}; "
                                    "drop the flag or fix the run config")
    return stored if stored is not None else given


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="tensor", desc="import", disable=not enabled)
