"""Exact bytes of the frozen base, the adapters and the heads on each (pipeline stage, TP rank).

No weights are read: every shard shape comes from :meth:`mlora.formats.weight_map.ParamMap.load`, the
function the loader uses, run on meta tensors (a reader that returns meta slices of the shapes the
HF config implies), and adapter shards from :func:`mlora.export.plan.plan_adapter`, which cuts
factors with the live model's ``shard``. So these numbers equal ``MLoraModel.parameter_bytes()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlora.export.plan import plan_adapter
from mlora.formats.hf_config import ModelSpec
from mlora.formats.weight_map import ParamMap, stage_param_maps
from mlora.fp8.quant import FP8_DTYPE, FP8_LINEARS
from mlora.lora.config import LoraConfig


@dataclass(frozen=True)
class _MetaEntry:
    shape: tuple[int, ...]


class MetaReader:
    """The reading interface of :class:`mlora.formats.checkpoint_reader.CheckpointReader`, backed by
    the shapes an HF config implies: ``read`` returns meta tensors, so nothing is allocated."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> None:
        self.shapes, self.dtype = shapes, dtype

    def entry(self, name: str) -> _MetaEntry:
        return _MetaEntry(self.shapes[name])

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        shape = list(self.shapes[name])
        if dim is not None:
            shape[dim] = (shape[dim] if stop is None else stop) - start
        return torch.empty(shape, dtype=self.dtype, device="meta")


def shard_shape(pm: ParamMap, spec: ModelSpec, tp: int, tp_rank: int) -> tuple[int, ...]:
    """The shape of this TP rank's shard of ``pm``, by the loader's own slicing (on meta tensors)."""
    reader = MetaReader(pm.hf_shapes(spec), torch.float32)
    with torch.device("meta"):  # ParamMap.load pads vocabulary shards with torch.zeros on the default device
        return tuple(pm.load(reader, spec, tp, tp_rank).shape)


def _is_fp8_weight(pm: ParamMap) -> bool:
    owner, _, leaf = pm.megatron_name.rpartition(".")
    return leaf == "weight" and owner.rsplit(".", 1)[-1] in FP8_LINEARS


def base_bytes(spec: ModelSpec, tp: int, pp: int, stage: int, tp_rank: int, dtype: torch.dtype,
               fp8: str | None = None) -> int:
    """Bytes of the frozen parameters of one rank, counted as ``MLoraModel.parameter_bytes()["base"]``:
    every parameter of the stage's shard in ``dtype``; with ``fp8="torch"`` the weights of the four
    frozen linears in e4m3 (1 byte) plus one float32 scale per local output row."""
    item = torch.empty((), dtype=dtype).element_size()
    fp8_item = torch.empty((), dtype=FP8_DTYPE).element_size()
    total = 0
    shapes: dict[tuple, tuple[int, ...]] = {}  # every layer repeats the same few parameter shapes
    for pm in stage_param_maps(spec, pp, stage):
        key = (pm.kind, tuple(pm.hf_shapes(spec).values()))
        if key not in shapes:
            shapes[key] = shard_shape(pm, spec, tp, tp_rank)
        shape = shapes[key]
        numel = torch.Size(shape).numel()
        if fp8 == "torch" and _is_fp8_weight(pm):
            total += numel * fp8_item + shape[0] * 4  # e4m3 weight + float32 weight_scale per output row
        else:
            total += numel * item
    return total


def adapter_bytes(spec: ModelSpec, tp: int, pp: int, lora: LoraConfig, dtype: torch.dtype
                  ) -> dict[tuple[int, int], int]:
    """Bytes of one adapter on each (stage, TP rank) that holds any of it (a stage without targeted
    layers holds none)."""
    plan = plan_adapter(spec, tp, pp, lora, dtype)
    return {(stage, r): plan.rank_bytes.get((stage, r), 0) for stage in range(pp) for r in range(tp)}


def head_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    """A scalar value head ``Linear(hidden, 1)`` with bias, held whole by every TP rank of the last stage."""
    return (spec.hidden_size + 1) * torch.empty((), dtype=dtype).element_size()
