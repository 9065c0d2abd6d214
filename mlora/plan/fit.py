"""Which TP × PP × DP layouts of N GPUs hold a workload, best first.

"Best" is the least model parallelism that fits, because everything else costs throughput:

1. fewest GPUs per model replica (TP·PP): the most data-parallel replicas, and the least TP
   traffic (two all-reduces of the activations per layer per micro-batch) and pipeline bubble;
2. TP within one node (≤ 8 GPUs) before TP across nodes: TP's per-layer collectives need NVLink;
3. for the same replica size, less pipelining (smaller PP): the 1F1B bubble, (PP − 1) / (M + PP − 1)
   of each step, idles GPUs, while TP inside a node mostly costs bandwidth;
4. then the most headroom.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlora.formats.hf_config import ModelSpec, check_layout
from mlora.plan.memory import MemoryPlan, plan_memory
from mlora.plan.workload import Engine, Layout, Workload

GIB = 1 << 30
NODE_GPUS = 8


@dataclass(frozen=True)
class Fit:
    """One candidate layout and its plan; ``need`` = peak + reserve, against ``capacity``."""

    plan: MemoryPlan
    need: int
    capacity: int

    @property
    def fits(self) -> bool:
        return self.need <= self.capacity

    @property
    def headroom(self) -> int:
        return self.capacity - self.need


def candidate_layouts(spec: ModelSpec, gpus: int, sp: bool = False, ep: int = 1) -> list[Layout]:
    """Every ``tp × pp × dp = gpus`` the model can be split into (TP divides the heads, query groups
    and FFN width; PP divides the layers; ``ep`` divides the experts and each stage's TP × DP ranks).
    ``sp`` applies wherever TP > 1, and always on a mixture of experts (megatron's MoE layer needs it there)."""
    out = []
    for tp in range(1, gpus + 1):
        for pp in range(1, gpus // tp + 1):
            if gpus % (tp * pp):
                continue
            layout = Layout(tp=tp, pp=pp, dp=gpus // (tp * pp), sp=(sp or spec.moe is not None) and tp > 1, ep=ep)
            try:
                layout.check(spec)
            except ValueError:
                continue
            out.append(layout)
    return out


def rank_key(fit: Fit) -> tuple:
    """Sort key: the order of the module docstring."""
    layout = fit.plan.layout
    return (layout.tp * layout.pp, layout.tp > NODE_GPUS, layout.pp, -fit.headroom)


def fit_layouts(spec: ModelSpec, workload: Workload, gpus: int, gpu_bytes: int, reserve: int = 0,
                engine: Engine | None = None, sp: bool = False, ep: int = 1) -> list[Fit]:
    """Every valid layout of ``gpus`` GPUs (experts split ``ep`` ways on a mixture of experts) with its plan,
    those that fit first (best first), then those that do not (closest first). ValueError when there is no
    valid layout at all."""
    if gpus < 1:
        raise ValueError(f"gpus={gpus} must be >= 1")
    if gpu_bytes <= 0:
        raise ValueError(f"GPU memory must be positive, got {gpu_bytes / GIB:g} GiB")
    if ep != 1:  # the layouts' own checks would skip every candidate silently
        check_layout(spec, 1, 1, ep)
    layouts = candidate_layouts(spec, gpus, sp, ep)
    if not layouts:
        experts = f", {spec.moe.num_experts} experts over ep={ep}" if spec.moe is not None else ""
        raise ValueError(f"no TP x PP x DP layout of {gpus} GPUs splits {spec.architecture} ({spec.num_heads} heads, "
                         f"{spec.num_kv_heads} query groups, {spec.num_layers} layers{experts})")
    fits = []
    for layout in layouts:
        plan = plan_memory(spec, layout, workload, engine)
        fits.append(Fit(plan, plan.peak + reserve, gpu_bytes))
    good = sorted((f for f in fits if f.fits), key=rank_key)
    bad = sorted((f for f in fits if not f.fits), key=lambda f: f.need)
    return good + bad


def require_fit(fits: list[Fit], gpus: int, gpu_bytes: int, reserve: int) -> list[Fit]:
    """The fitting layouts, or ValueError saying what came closest and by how much."""
    good = [f for f in fits if f.fits]
    if good:
        return good
    best = fits[0]
    over = best.need - best.capacity
    raise ValueError(
        f"no layout of {gpus} GPUs fits in {gpu_bytes / GIB:g} GiB per GPU; closest: {best.plan.layout} "
        f"needs {best.need / GIB:.1f} GiB (peak {best.plan.peak / GIB:.1f} GiB + reserve {reserve / GIB:g} GiB), "
        f"{over / GIB:.1f} GiB over. Try recompute, an FP8 base, a smaller micro-batch or sequence, or more GPUs")
