"""Exact bytes of the frozen base, the adapters and the heads on each (pipeline stage, TP rank).

No weights are read: every shard shape comes from :meth:`mlora.formats.weight_map.ParamMap.load`, the
function the loader uses, run on meta tensors (a reader that returns meta slices of the shapes the
HF config implies), and adapter shards from :func:`mlora.export.plan.plan_adapter`, which cuts
factors with the live model's ``shard`` (on a mixture of experts, the same sites and ``shard`` for the
attention and dense-MLP factors, and the experts' by arithmetic). So these numbers equal
``MLoraModel.parameter_bytes()``.

Mixture-of-experts models under expert parallelism: the rank at EP rank ``ep_rank`` holds, in each sparse
layer of its stage, the router ``[E, hidden]`` (replicated) and ``E / EP`` whole experts (expert TP is
1, whatever the attention's TP): the expert map the loader reads (:func:`stage_param_maps`). An adapter
on the experts' projections is one LoRA per expert and projection (gate ``r·(hidden + ffn)``, up the
same, down ``r·(ffn + hidden)``), held whole with its expert; every EP rank holds as many bytes when the
targets reach every expert alike.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mlora.export.plan import plan_adapter
from mlora.formats.hf_config import ModelSpec, check_layout
from mlora.formats.weight_map import EXPERT_BIAS, ParamMap, shard, stage_param_maps
from mlora.fp8.quant import FP8_DTYPE, FP8_LINEARS
from mlora.lora.config import LoraConfig
from mlora.lora.sites import factor_kinds, factor_shapes, model_sites
from mlora.lora.targets import GQA_PROJECTIONS, attention_projections, expert_of, resolve_targets


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
               fp8: str | None = None, ep: int = 1, ep_rank: int = 0) -> int:
    """Bytes of the frozen parameters of one rank, counted as ``MLoraModel.parameter_bytes()["base"]``:
    every parameter of the stage's shard in ``dtype`` (in sparse layers the router, its float32 correction bias
    where it has one, and EP rank ``ep_rank``'s ``E / ep`` experts); with ``fp8="torch"`` the weights of the four
    frozen linears in e4m3 (1 byte) plus one float32 scale per local output row."""
    item = torch.empty((), dtype=dtype).element_size()
    fp8_item = torch.empty((), dtype=FP8_DTYPE).element_size()
    total = 0
    shapes: dict[tuple, tuple[int, ...]] = {}  # every layer repeats the same few parameter shapes
    for pm in stage_param_maps(spec, pp, stage, ep, ep_rank):
        # an expert's linear is not TP-split, unlike a dense MLP's of the same HF shape
        key = (pm.kind, pm.expert, tuple(pm.hf_shapes(spec).values()))
        if key not in shapes:
            shapes[key] = shard_shape(pm, spec, tp, tp_rank)
        shape = shapes[key]
        numel = torch.Size(shape).numel()
        if fp8 == "torch" and _is_fp8_weight(pm):
            total += numel * fp8_item + shape[0] * 4  # e4m3 weight + float32 weight_scale per output row
        elif pm.megatron_name.endswith(EXPERT_BIAS):
            total += numel * 4
        else:
            total += numel * item
    return total


def split_targets(spec: ModelSpec, target_modules, exclude_modules) -> tuple[frozenset[tuple[int, str]],
                                                                             frozenset[tuple[int, str]]]:
    """The (layer, projection) pairs an adapter adapts, as ``(dense, experts)``: ``experts`` are the experts'
    projections (``mlp.experts.{e}.gate_proj`` and the like, :mod:`mlora.lora.targets`)."""
    return resolved_split(spec.num_layers, spec.moe, hashable_targets(target_modules),
                          hashable_targets(exclude_modules), attention_projections(spec))


def hashable_targets(modules):
    """A target or exclude spec as a cache key: a list of names becomes a tuple."""
    return modules if modules is None or isinstance(modules, str) else tuple(modules)


@functools.lru_cache(maxsize=16)
def resolved_split(num_layers: int, moe, target_modules, exclude_modules,
                   attention: tuple[str, ...] = GQA_PROJECTIONS) -> tuple[frozenset, frozenset]:
    """:func:`split_targets` by the spec's hashable parts, resolved once per target spec: a large mixture of
    experts has tens of thousands of expert projections."""
    chosen = resolve_targets(target_modules, exclude_modules, num_layers, moe, attention)
    experts = frozenset((i, p) for i, p in chosen if expert_of(p) is not None)
    return frozenset(chosen) - experts, experts


def expert_adapter_bytes(spec: ModelSpec, pp: int, experts: frozenset[tuple[int, str]], rank: int, ep: int,
                         dtype: torch.dtype) -> dict[int, int]:
    """Bytes of the expert LoRA factors one rank of each stage holds: A and B of each targeted projection of
    its EP rank's ``E / ep`` experts (megatron's contiguous split), ``rank · (hidden + ffn)`` elements
    whichever the projection (gate and up read hidden and write ffn, down the reverse). Where the targets
    reach some experts and not others, the EP rank holding the most of them."""
    if not experts:
        return {stage: 0 for stage in range(pp)}
    per_stage, per_rank = spec.num_layers // pp, spec.moe.num_experts // ep
    held = {(stage, r): 0 for stage in range(pp) for r in range(ep)}  # targeted expert projections per EP rank
    for i, proj in experts:
        held[(i // per_stage, expert_of(proj) // per_rank)] += 1
    size = rank * (spec.hidden_size + spec.moe.ffn_size) * torch.empty((), dtype=dtype).element_size()
    return {stage: max(held[(stage, r)] for r in range(ep)) * size for stage in range(pp)}


def _site_bytes(spec: ModelSpec, tp: int, pp: int, pairs: set[tuple[int, str]], rank: int, dtype: torch.dtype
                ) -> dict[tuple[int, int], int]:
    """Bytes of the factors of ``pairs`` (attention and dense-MLP projections) on each (stage, TP rank), cut
    as :func:`mlora.export.plan.plan_adapter` and the live model cut them."""
    item = torch.empty((), dtype=dtype).element_size()
    sites, per_stage = model_sites(spec, tp), spec.num_layers // pp
    out: dict[tuple[int, int], int] = {}
    sizes: dict[tuple, list[int]] = {}  # every layer repeats the same few shapes
    for layer, proj in pairs:
        site = sites[(layer, proj)]
        for shape, kind in zip(factor_shapes(site, proj, rank), factor_kinds(site)):
            if (shape, kind) not in sizes:
                full = torch.empty(shape, device="meta")
                sizes[(shape, kind)] = [shard(full, kind, tp, r).numel() * item for r in range(tp)]
            for r, n in enumerate(sizes[(shape, kind)]):
                out[(layer // per_stage, r)] = out.get((layer // per_stage, r), 0) + n
    return out


def adapter_bytes(spec: ModelSpec, tp: int, pp: int, lora: LoraConfig, dtype: torch.dtype, ep: int = 1
                  ) -> dict[tuple[int, int], int]:
    """Bytes of one adapter on each (stage, TP rank) that holds any of it (a stage without targeted
    layers holds none): the attention and dense-MLP factors as the export plan cuts them, plus, on a
    mixture of experts, the experts' (whole, on the EP rank holding the expert, alike on every TP rank)."""
    if spec.moe is None:
        plan = plan_adapter(spec, tp, pp, lora, dtype)
        return {(stage, r): plan.rank_bytes.get((stage, r), 0) for stage in range(pp) for r in range(tp)}
    check_layout(spec, tp, pp, ep)
    dense, experts = split_targets(spec, lora.target_modules, lora.exclude_modules)
    cut = _site_bytes(spec, tp, pp, dense, lora.rank, dtype)
    held = expert_adapter_bytes(spec, pp, experts, lora.rank_of(True), ep, dtype)
    return {(stage, r): cut.get((stage, r), 0) + held[stage] for stage in range(pp) for r in range(tp)}


def head_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    """A scalar value head ``Linear(hidden, 1)`` with bias, held whole by every TP rank of the last stage."""
    return (spec.hidden_size + 1) * torch.empty((), dtype=dtype).element_size()
