"""Text for people and JSON for programs, from memory plans."""

from __future__ import annotations

import json
from dataclasses import replace

from mlora.formats.hf_config import ModelSpec
from mlora.lora.config import master_dtype
from mlora.plan.fit import GIB, Fit
from mlora.plan.memory import FIELDS, MemoryPlan, engine_bytes, plan_memory
from mlora.plan.workload import Engine, Workload, worst_expert_load


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def describe(plan: MemoryPlan) -> str:
    """One line: model, layout and workload."""
    spec, w, layout = plan.spec, plan.workload, plan.layout
    micro = w.micro_batches if w.micro_batches is not None else layout.pp
    base = f"{str(w.dtype).removeprefix('torch.')}" + (" + FP8 (torch) linears" if w.fp8 else "")
    recompute = w.recompute + (f" ({w.recompute_method}, {w.recompute_num_layers})" if w.recompute == "full" else "")
    engine = (f"; colocated vLLM TP{plan.engine.tp}, {plan.engine.kv_tokens:,} KV tokens" if plan.engine else "")
    moe = spec.moe
    experts = (f", {moe.num_experts} experts top-{moe.top_k} (FFN {moe.ffn_size}) in {len(moe.sparse_layers)} layers"
               if moe is not None else "")
    return (f"{spec.architecture}: {spec.num_layers} layers, hidden {spec.hidden_size}, vocab {spec.vocab_size}"
            f"{experts} | "
            f"{layout} | " + (f"packed micro-batch of {w.seq} tokens" if w.packed else
                              f"micro-batch {w.micro_batch} x {w.seq} tokens") + f", {micro} per update | base {base} | "
            f"{w.attention} attention | recompute {recompute} | LoRA r {w.rank}"
            + (f" (experts {w.expert_rank})" if w.expert_rank is not None else "") + " actor"
            + (" + critic + value head" if w.critic else "")
            + f" ({str(master_dtype(w.dtype)).removeprefix('torch.')} masters and AdamW state)" + engine)


def _rows(plan: MemoryPlan) -> list[tuple[str, str, object]]:
    """Ranks of one stage with identical numbers collapse into one row (``tp 0-7``)."""
    rows = []
    for stage in range(plan.layout.pp):
        ranks = [r for r in plan.ranks if r.stage == stage]
        groups: list[list] = []
        for r in ranks:
            key = tuple(getattr(r, f) for f in (*FIELDS, "peak"))
            if groups and groups[-1][0] == key:
                groups[-1][1].append(r)
            else:
                groups.append([key, [r]])
        for _, members in groups:
            lo, hi = members[0].tp_rank, members[-1].tp_rank
            rows.append((str(stage), str(lo) if lo == hi else f"{lo}-{hi}", members[0]))
    return rows


def memory_table(plan: MemoryPlan) -> str:
    """The per-rank table, in GiB, with the peak's phase."""
    head = ("stage", "tp", *FIELDS, "peak", "at")
    alike = "every DP replica and EP rank alike" if plan.layout.ep > 1 else "every DP replica alike"
    lines = [describe(plan), f"GiB per GPU ({alike}):",
             "  ".join(f"{h:>11s}" if i > 1 else f"{h:>5s}" for i, h in enumerate(head))]
    for stage, tp, r in _rows(plan):
        cells = [f"{stage:>5s}", f"{tp:>5s}", *(f"{_gib(getattr(r, f)):>11s}" for f in (*FIELDS, "peak"))]
        lines.append("  ".join(cells) + f"  {r.phase}")
    lines.append(f"peak per GPU: {plan.peak / GIB:.2f} GiB ({plan.peak:,} bytes); not counted: CUDA context, NCCL and "
                 "cuBLAS workspaces, allocator fragmentation")
    experts = moe_line(plan)
    if experts is not None:
        lines.append(experts)
    return "\n".join(lines)


def moe_line(plan: MemoryPlan) -> str | None:
    """For a mixture of experts: the experts each GPU holds, the routing the activations assume, and the peak
    under the worst routing (every token of the EP group sent to one GPU's experts); None for a dense model."""
    spec, layout, w = plan.spec, plan.layout, plan.workload
    if spec.moe is None:
        return None
    worst = worst_expert_load(spec, layout)
    line = (f"experts: {spec.moe.num_experts // layout.ep} of {spec.moe.num_experts} per GPU in each sparse layer "
            f"(EP{layout.ep}, whole experts), router replicated; activations for "
            + ("balanced routing" if w.expert_load == 1 else f"{w.expert_load:g}x balanced routing")
            + f" ({w.expert_load:g} x top-{spec.moe.top_k} token copies per GPU)")
    if worst > w.expert_load:
        skewed = plan_memory(spec, layout, replace(w, expert_load=worst), plan.engine)
        line += (f"; worst case, every token of the EP group routed to one GPU's experts ({worst:g}x): peak "
                 f"{skewed.peak / GIB:.2f} GiB")
    return line


def engine_line(spec: ModelSpec, engine: Engine, workload: Workload, separate: bool) -> str:
    """A vLLM engine's bytes per GPU (weights, LoRA slots, KV cache) and where they count: on GPUs of its own
    (``separate``) or in the trainer's table (colocated: its ``engine`` column)."""
    lora = workload.lora_config()
    weights = engine_bytes(spec, Engine(tp=engine.tp, kv_tokens=0, dtype=engine.dtype, fp8=engine.fp8), lora,
                           workload.experiments)
    total = engine_bytes(spec, engine, lora, workload.experiments)
    where = ("on GPUs of its own (not in the trainer's table)" if separate else
             "colocated: the table's engine column, " + ("only while it generates (it sleeps during the updates)"
                                                         if engine.sleeps else "throughout (it stays awake)"))
    return (f"vLLM engine TP{engine.tp} ({str(engine.dtype).removeprefix('torch.')}) per GPU: weights and LoRA slots "
            f"{_gib(weights)} + KV cache {_gib(total - weights)} ({engine.kv_tokens:,} tokens) = {_gib(total)} GiB, "
            f"{where}; vLLM's workspace (CUDA context, activations) not counted")


def memory_json(plan: MemoryPlan) -> str:
    return json.dumps(plan.as_dict(), indent=1)


def fit_table(fits: list[Fit], gpus: int, gpu_bytes: int, reserve: int) -> str:
    """Fitting layouts, best first (see :mod:`mlora.plan.fit` for the order), then the others."""
    lines = [describe(fits[0].plan).split(" | ", 2)[0] + f" on {gpus} GPUs of {gpu_bytes / GIB:g} GiB, reserve "
             f"{reserve / GIB:g} GiB per GPU (CUDA context, NCCL, fragmentation)",
             "best first: fewest GPUs per model replica, TP within a node, shallower pipeline, most headroom",
             f"{'layout':>18s}  {'peak GiB':>9s}  {'free GiB':>9s}  fits  at"]
    for f in fits:
        worst = max(f.plan.ranks, key=lambda r: r.peak)
        lines.append(f"{str(f.plan.layout):>18s}  {_gib(f.plan.peak):>9s}  {_gib(f.headroom):>9s}  "
                     f"{'yes ' if f.fits else 'no  '}  stage {worst.stage} {worst.phase}")
    return "\n".join(lines)


def fit_json(fits: list[Fit], gpus: int, gpu_bytes: int, reserve: int) -> str:
    return json.dumps({"gpus": gpus, "gpu_bytes": gpu_bytes, "reserve": reserve,
                       "layouts": [{"layout": str(f.plan.layout), "tp": f.plan.layout.tp, "pp": f.plan.layout.pp,
                                    "dp": f.plan.layout.dp, "sp": f.plan.layout.sp, "fits": f.fits,
                                    "peak": f.plan.peak, "headroom": f.headroom, **f.plan.as_dict()} for f in fits]},
                      indent=1)
