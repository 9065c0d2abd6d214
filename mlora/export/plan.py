"""Planning mode: what an adapter export will contain, for any model config and mesh, no weights.

Factor shapes are built as meta-device tensors and cut with the same ``shard`` functions the
live model uses, so the per-rank sizes are those a real run would hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlora.export.peft_files import peft_tensor_name
from mlora.formats.hf_config import ModelSpec, check_layout
from mlora.formats.weight_map import shard
from mlora.lora.config import LoraConfig
from mlora.lora.sites import factor_kinds, factor_shapes, model_sites
from mlora.lora.targets import attention_projections, projection_order, resolve_targets


@dataclass
class AdapterPlan:
    """Exported PEFT tensors (name -> shape) and how many bytes each (PP stage, TP rank) holds."""

    spec: ModelSpec
    tp: int
    pp: int
    lora: LoraConfig
    dtype: torch.dtype
    tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)
    rank_bytes: dict[tuple[int, int], int] = field(default_factory=dict)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def total_bytes(self) -> int:
        return sum(torch.Size(s).numel() for s in self.tensors.values()) * self.itemsize

    @property
    def num_parameters(self) -> int:
        return sum(torch.Size(s).numel() for s in self.tensors.values())

    @property
    def _expert_rank(self) -> str:
        return f" (experts {self.lora.expert_rank})" if self.lora.expert_rank is not None else ""

    def summary(self) -> str:
        worst = max(self.rank_bytes.values())
        return (f"{self.spec.architecture}: {self.spec.num_layers} layers, hidden {self.spec.hidden_size}; "
                f"LoRA r {self.lora.rank}{self._expert_rank} on {len(self.tensors) // 2} modules -> {len(self.tensors)} tensors, "
                f"{self.num_parameters:,} parameters, {self.total_bytes / 2**20:.1f} MiB in {str(self.dtype)[6:]}; "
                f"at TP{self.tp}xPP{self.pp} the largest rank shard is {worst / 2**20:.2f} MiB")


def plan_adapter(spec: ModelSpec, tp: int, pp: int, lora: LoraConfig, dtype: torch.dtype = torch.bfloat16
                 ) -> AdapterPlan:
    """The export plan of ``lora`` on the model ``spec`` split ``tp`` × ``pp`` ways."""
    check_layout(spec, tp, pp)
    modules = resolve_targets(lora.target_modules, lora.exclude_modules, spec.num_layers, spec.moe,
                              attention_projections(spec))
    sites = model_sites(spec, tp)
    plan = AdapterPlan(spec, tp, pp, lora, dtype)
    per_stage = spec.num_layers // pp
    order = sorted(modules, key=lambda m: (m[0], projection_order(m[1], spec.moe)))
    for layer, proj in order:
        site = sites[(layer, proj)]
        for factor, shape, kind in zip("AB", factor_shapes(site, proj, lora.rank_of(site.expert is not None)), factor_kinds(site)):
            full = torch.empty(shape, device="meta", dtype=dtype)
            plan.tensors[peft_tensor_name(layer, proj, factor)] = tuple(full.shape)
            for tp_rank in range(tp):
                key = (layer // per_stage, tp_rank)
                plan.rank_bytes[key] = plan.rank_bytes.get(key, 0) + shard(full, kind, tp, tp_rank).numel() * plan.itemsize
    return plan
