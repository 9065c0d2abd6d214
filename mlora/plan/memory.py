"""Memory of each rank during one PPO step of the shared-base engine, from shapes alone.

:func:`plan_memory` combines the exact weight terms (:mod:`mlora.plan.weights`) with the
activation and logits formulas (:mod:`mlora.plan.activations`, :mod:`mlora.plan.logits`) phase by
phase, following :meth:`mlora.train.engine.ActorCriticEngine.step`:

1. ``forward``: old log-probs (actor), reference log-probs (adapters off), values (critic): no
   grad, one forward micro-batch at a time; the last stage holds the logits of one micro-batch
   and their float32 temporaries.
2. ``actor``: forward + backward of the ``policy`` adapter under megatron's schedule: stage ``i``
   of ``P`` keeps the activations of ``min(P - i, M)`` micro-batches (1F1B), the last stage the
   logits of one; the moment of the peak is either the loss of the last in-flight micro-batch
   (logits and their temporaries on top of everything kept) or the backward of a layer
   (gradients in flight, plus a recomputed group under full recompute).
3. ``critic``: the same for ``critic`` + value head (hidden states, no logits).
4. ``reduce``: gradients flattened into one bucket for the TP/DP all-reduce.

Persistent in every phase: the frozen base, both adapters, the value head, and both AdamW states
(two moments per trainable element, in float32 under a 16-bit base like the adapters: the steady state from the second step
on; the first step is lower by the critic's moments during the actor update). A colocated vLLM
engine that sleeps while the trainer works (vLLM's sleep mode, mlora's default on CUDA) adds a fifth
phase, ``generate``: its weights and KV cache over the persistent bytes, with no activations, gradients
or logits; one that stays awake adds them to every phase. Gradients exist only inside their update (the
engine sets them to None after each optimizer step).

What is not counted: the CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation (the
caching allocator on GPU, glibc's heap on CPU: see ``bench/memory_plan.py``), the rollout batch in
host memory, and per-tensor bookkeeping under a kilobyte (AdamW's step counters).

Mixtures of experts at ``layout.ep``: each rank holds its stage's attention split over TP, the router and
``E / ep`` whole experts of every sparse layer (and their LoRA factors, when the adapter targets MLP
projections); the activations assume balanced routing, scaled by ``workload.expert_load`` (see
:mod:`mlora.plan.activations`). Every EP rank then holds the same, so a row of the plan stands for each
of them.

Where the numbers come from and what carries over to GPUs: the saved-tensor terms are counted, not
estimated, for every dtype, FP8, attention and recompute setting the planner takes
(``tests/test_memory_plan.py``), and the peaks are measured on CPU in float32 at TP, PP, DP and SP
(``bench/memory_plan.py``: within 10% on its grid). On a GPU the same autograd graph is built, so
the kept activations hold as they are; what the CPU cannot check is the GPU kernels' own
workspace: SDPA is assumed to run a flash kernel (q, k, v, output and a float32 log-sum-exp, as the
CPU's fused kernel; a math fallback would materialise the scores), and batched GEMMs are assumed
to read stride-0 operands in place. (On CPU in bf16 the output layer's frozen-weight backward
materialises its weight once per sequence position, ``s · V/TP · hidden`` bytes, because torch's
CPU bmm copies the expanded operand; float32 and, presumably, GPUs do not. That temporary is not
modelled.)
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, replace

import torch

from mlora.formats.hf_config import ModelSpec
from mlora.formats.weight_map import stage_layers
from mlora.lora.config import LoraConfig, master_dtype
from mlora.lora.targets import GQA_PROJECTIONS, MLP_PROJECTIONS, attention_projections, is_router
from mlora.plan.activations import (
    Experts,
    Geometry,
    LayerLora,
    backward_workspace,
    forward_workspace,
    layer_saved,
    mask_bytes,
)
from mlora.plan.logits import logits_forward_only, logits_training
from mlora.plan.weights import (
    adapter_bytes,
    base_bytes,
    expert_adapter_bytes,
    hashable_targets,
    head_bytes,
    resolved_split,
    split_targets,
)
from mlora.plan.workload import Engine, Layout, Workload

SITE_OF = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "proj",
           "gate_proj": "fc1", "up_proj": "fc1", "down_proj": "fc2",
           # multi-latent attention's (its q_proj, without q_lora_rank, counts as "qkv")
           "q_a_proj": "q_a", "q_b_proj": "q_b", "kv_a_proj_with_mqa": "kv_a", "kv_b_proj": "kv_b"}
FIELDS = ("base", "adapters", "grads", "optimizer", "heads", "activations", "logits", "engine")


@dataclass(frozen=True)
class RankMemory:
    """Bytes on one (pipeline stage, TP rank) at the moment of its peak; ``peak`` is their sum.
    Every DP replica of the rank holds the same."""

    stage: int
    tp_rank: int
    base: int
    adapters: int
    grads: int
    optimizer: int
    heads: int
    activations: int
    logits: int
    engine: int
    peak: int
    phase: str  # where the peak happens: forward, actor, critic, reduce or generate (a sleeping colocated engine)
    phases: dict = field(default_factory=dict)  # the peak of every phase considered, bytes

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class MemoryPlan:
    """Per-rank memory of one PPO step on ``layout``."""

    spec: ModelSpec
    layout: Layout
    workload: Workload
    engine: Engine | None
    ranks: list[RankMemory] = field(default_factory=list)

    @property
    def peak(self) -> int:
        """The largest per-rank peak: what each GPU of the layout must hold."""
        return max(r.peak for r in self.ranks)

    def as_dict(self) -> dict:
        return {"model": self.spec.architecture, "layout": str(self.layout), "peak": self.peak,
                "ranks": [r.as_dict() for r in self.ranks]}


def _item(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def geometry(spec: ModelSpec, layout: Layout, workload: Workload, batch: int) -> Geometry:
    """This rank's view of a micro-batch of ``batch`` sequences (every TP rank sees the same sizes)."""
    return Geometry(batch=batch, seq=workload.padded_seq(layout), hidden=spec.hidden_size,
                    heads=spec.num_heads // layout.tp, kv_heads=spec.num_kv_heads // layout.tp,
                    head_dim=spec.head_dim, ffn=spec.intermediate_size // layout.tp, tp=layout.tp, sp=layout.sp,
                    item=_item(workload.dtype), fp8=workload.fp8 is not None,
                    lora_item=_item(workload.lora_compute_dtype or master_dtype(workload.dtype)), qk_norm=spec.qk_norm,
                    rotary_dim=spec.rotary_dim, mla=spec.mla, sinks=spec.attention_sinks)


def layer_geometries(spec: ModelSpec, layout: Layout, workload: Workload, batch: int, layers: range
                     ) -> list[Geometry]:
    """:func:`geometry` for each of ``layers``, with its :class:`Experts` where the layer is sparse."""
    g = geometry(spec, layout, workload, batch)
    if spec.layer_windows is not None:  # gpt-oss: each layer's own window
        return [replace(_sparse(g, spec, layout, workload), window=spec.layer_windows[i]) for i in layers]
    if spec.moe is None:
        return [g] * len(layers)
    sparse = _sparse(g, spec, layout, workload)
    return [sparse if spec.is_sparse(i) else g for i in layers]


def _sparse(g: Geometry, spec: ModelSpec, layout: Layout, workload: Workload) -> Geometry:
    """``g`` with the :class:`Experts` of ``spec``'s sparse layers."""
    moe = spec.moe
    return replace(g, experts=Experts(moe.num_experts, moe.top_k, moe.ffn_size, layout.ep, moe.normalize_topk,
                                      workload.expert_load, (moe.shared_ffn_size or 0) // layout.tp,
                                      shared_gate=moe.shared_gate, sigmoid=moe.score == "sigmoid",
                                      router_fp32=moe.router_fp32, clamped=moe.gpt_oss))


def _site_of(proj: str) -> str:
    """The :class:`LayerLora` site of a dense projection key; a shared expert's (``mlp.shared_expert.gate_proj``,
    :mod:`mlora.lora.targets`) has its own, ``shared_fc1``/``shared_fc2``, and a MoE router its own, ``router``."""
    if is_router(proj):
        return "router"
    leaf = proj.rsplit(".", 1)[-1]
    return SITE_OF[leaf] if leaf == proj else "shared_" + SITE_OF[leaf]


def layer_loras(spec: ModelSpec, workload: Workload, layers: range) -> list[LayerLora]:
    """The trainable LoRA of each of ``layers``; in a sparse layer ``fc1`` and ``fc2`` count the experts'
    projections (gate and up, down) that any of its experts adapts."""
    adapted = _adapted(spec.num_layers, spec.moe, hashable_targets(workload.target_modules),
                       hashable_targets(workload.exclude_modules), attention_projections(spec))
    out = []
    for i in layers:
        sites: dict[str, int] = {}
        for proj in adapted[i]:
            site = _site_of(proj)
            sites[site] = sites.get(site, 0) + 1
        out.append(LayerLora(sites, workload.rank, workload.expert_rank))
    return out


@functools.lru_cache(maxsize=16)
def _adapted(num_layers: int, moe, target_modules, exclude_modules, attention: tuple[str, ...] = GQA_PROJECTIONS
             ) -> tuple[frozenset[str], ...]:
    """Per layer, the HF projections an adapter adapts, an expert's by its canonical name (Mixtral's w1 is
    gate_proj) once however many experts it reaches; computed once per target spec."""
    dense, experts = resolved_split(num_layers, moe, target_modules, exclude_modules, attention)
    layers: list[set[str]] = [set() for _ in range(num_layers)]
    for i, proj in dense:
        layers[i].add(proj)
    for i, proj in experts:
        layers[i].add(MLP_PROJECTIONS[moe.projections.index(proj.rsplit(".", 1)[1])])
    return tuple(frozenset(p) for p in layers)


@dataclass(frozen=True)
class _StageActivations:
    kept: int  # per micro-batch, for the whole backward
    recomputed: int  # one recompute group's activations while it runs backward (full recompute)
    tail: int  # of ``kept``, what the last stage frees before its layers run backward (final norm, head input)


def stage_activations(spec: ModelSpec, layout: Layout, workload: Workload, stage: int, critic: bool
                      ) -> _StageActivations:
    """Bytes one micro-batch keeps on ``stage`` between its forward and its backward, for the actor
    (``critic=False``) or the critic; and what a recomputed group adds while it runs backward."""
    g = geometry(spec, layout, workload, workload.micro_batch)
    first, last = stage == 0, stage == layout.pp - 1
    layers = stage_layers(spec, layout.pp, stage)
    loras = list(zip(layer_geometries(spec, layout, workload, workload.micro_batch, layers),
                     layer_loras(spec, workload, layers)))  # (geometry, LoRA) of each layer
    stream = g.stream_tokens * g.hidden * g.item  # one hidden-state tensor of the residual stream
    rotary = g.seq * g.head_dim * 4  # megatron's float32 RoPE frequencies, kept by each checkpoint
    kept = recomputed = 0
    # the embedding output requires grad under recompute (mlora.models.recompute); a received stage input always
    grad = not first or workload.recompute != "none"
    selective = workload.recompute_modules if workload.recompute == "selective" else ()
    if workload.recompute == "full":
        n = workload.recompute_num_layers
        if workload.recompute_method == "uniform":
            kept = len(loras) // n * stream + rotary
            groups = [loras[i:i + n] for i in range(0, len(loras), n)]
        else:  # block: the first n layers one by one, the rest keep everything
            kept = min(n, len(loras)) * stream + rotary
            groups = [[pair] for pair in loras[:n]]
            for lg, lora in loras[n:]:
                kept += layer_saved(lg, lora, workload.attention, True)[0]
        recomputed = max((sum(layer_saved(lg, lora, workload.attention, True)[0] for lg, lora in grp)
                          for grp in groups), default=0)
    else:
        if not first and g.item != 4:
            kept += stream  # the schedule keeps the received input; the first norm keeps a float32 copy
        for lg, lora in loras:
            saved, grad = layer_saved(lg, lora, workload.attention, grad, selective)
            kept += saved
    tail = 0
    if last:
        tail = g.stream_tokens * (g.hidden + 1) * 4  # final norm
        if critic:
            tail += g.tokens * g.hidden * g.item  # the value head's input (gathered under SP)
    else:
        kept += stream  # the schedule keeps this stage's output until its backward
    return _StageActivations(kept + tail, recomputed, tail)


def _vocab_local(spec: ModelSpec, tp: int, tp_rank: int) -> tuple[int, bool]:
    """Columns of this rank's logits shard and whether any of them is TP padding."""
    per = spec.padded_vocab_size(tp) // tp
    real = max(0, min(per, spec.vocab_size - tp_rank * per))
    return per, real < per


def _stage_geometries(spec: ModelSpec, layout: Layout, workload: Workload, stage: int, batch: int
                      ) -> list[Geometry]:
    return layer_geometries(spec, layout, workload, batch, stage_layers(spec, layout.pp, stage))


@dataclass(frozen=True)
class _Phase:
    name: str
    grads: int
    activations: int
    logits: int
    engine: int = 0  # a colocated engine's bytes, where it is awake


def _update_phase(spec: ModelSpec, layout: Layout, workload: Workload, stage: int, tp_rank: int, critic: bool,
                  grads: int) -> _Phase:
    """The peak moment of the actor's or the critic's update on one rank."""
    g = geometry(spec, layout, workload, workload.micro_batch)
    acts = stage_activations(spec, layout, workload, stage, critic)
    micro_batches = workload.micro_batches if workload.micro_batches is not None else layout.pp
    held = workload.in_flight(layout.pp, stage) * acts.kept + micro_batches * mask_bytes(g, workload.attention)
    name = "critic" if critic else "actor"
    workspace = max(backward_workspace(lg, workload.attention) for lg in set(_stage_geometries(
        spec, layout, workload, stage, g.batch)))
    backward = held - acts.tail + acts.recomputed + workspace
    if stage == layout.pp - 1 and not critic:
        vocab, padded = _vocab_local(spec, layout.tp, tp_rank)
        logits = logits_training(g.batch, g.seq, vocab, g.item, padded)
        if held + logits >= backward:
            return _Phase(f"{name} loss", grads, held, logits)
    return _Phase(f"{name} backward", grads, backward, 0)


def _forward_phase(spec: ModelSpec, layout: Layout, workload: Workload, stage: int, tp_rank: int) -> _Phase:
    """The no-grad log-prob and value passes (forward micro-batches, one at a time)."""
    g = geometry(spec, layout, workload, workload.forward_batch)
    rows = workload.micro_batch * (workload.micro_batches or layout.pp)
    masks = -(-rows // workload.forward_batch) * mask_bytes(g, workload.attention)
    logits = 0
    if stage == layout.pp - 1:
        vocab, padded = _vocab_local(spec, layout.tp, tp_rank)
        logits = logits_forward_only(g.batch, g.seq, vocab, g.item, padded)
    # the layers' temporaries and the logits never coexist: the logits come after the last layer
    workspace = max(forward_workspace(lg, workload.attention)
                    for lg in set(_stage_geometries(spec, layout, workload, stage, g.batch)))
    if logits > workspace:
        return _Phase("forward", 0, masks, logits)
    return _Phase("forward", 0, masks + workspace, 0)


def engine_bytes(spec: ModelSpec, engine: Engine, lora: LoraConfig, slots: int = 1) -> int:
    """A colocated vLLM engine's share of one GPU: its TP shard of the base (the trainer's sharding
    functions; vLLM pads the vocabulary slightly differently), ``slots`` LoRA slots of the adapter's rank
    (one per experiment), and the KV cache of ``kv_tokens`` tokens (K and V of every layer for this GPU's KV heads).
    vLLM's own activation workspace and CUDA graphs are not counted. A mixture of experts' experts count as
    ``E / tp`` whole experts per GPU: the bytes of vLLM's TP-sharded experts and of its expert parallelism alike."""
    ep = engine.tp if spec.moe is not None and spec.moe.num_experts % engine.tp == 0 else 1
    weights = base_bytes(spec, engine.tp, 1, 0, 0, engine.dtype, engine.fp8, ep)
    # vLLM's slots hold its max_lora_rank on every module
    slot = adapter_bytes(spec, engine.tp, 1, replace(lora, rank=lora.max_rank, expert_rank=None),
                         engine.dtype, ep)[(0, 0)]
    return weights + slots * slot + engine.kv_tokens * kv_token_bytes(spec, engine.tp, engine.dtype)


def kv_token_bytes(spec: ModelSpec, tp: int, dtype: torch.dtype) -> int:
    """KV-cache bytes of one token on one GPU of a TP ``tp`` engine: K and V of every layer for its KV heads (KV
    heads are replicated when TP exceeds them, as vLLM does); with multi-head latent attention, vLLM's latent cache:
    the ``kv_lora_rank`` latent and the ``qk_rope_head_dim`` RoPE key of every layer, on every TP rank."""
    item = _item(dtype)
    if spec.mla is not None:
        return spec.num_layers * (spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim) * item
    return spec.num_layers * 2 * max(1, spec.num_kv_heads // tp) * spec.head_dim * item


def _reduce_bucket(layout: Layout, grads: int, experts: int) -> int:
    """The largest flat copy :func:`mlora.lora.grads.finalize_grads` makes of ``grads`` (bytes; ``experts`` of
    them an expert's): the non-expert gradients over TP x DP (one bucket here, an upper bound of its two),
    the experts' over the ranks holding the same experts; a group of one rank makes none."""
    dense = grads - experts if layout.tp * layout.dp > 1 else 0
    expert = experts if layout.tp * layout.dp > layout.ep else 0
    return max(dense, expert)


def plan_memory(spec: ModelSpec, layout: Layout, workload: Workload, engine: Engine | None = None) -> MemoryPlan:
    """Per-rank bytes of one PPO step of ``workload`` on ``layout`` (see the module docstring)."""
    layout.check(spec)
    workload.check(spec, layout)
    if engine is not None:
        engine.check(spec)
    lora = workload.lora_config()
    # adapters, heads and their AdamW moments are float32 masters under a 16-bit base (mlora.lora.config.master_dtype)
    per_adapter = adapter_bytes(spec, layout.tp, layout.pp, lora, master_dtype(workload.dtype), layout.ep)
    per_expert_part = expert_adapter_bytes(spec, layout.pp, split_targets(spec, lora.target_modules,
                                                                          lora.exclude_modules)[1],
                                           lora.rank_of(True), layout.ep, master_dtype(workload.dtype))  # of per_adapter
    k = workload.experiments
    colocated = engine_bytes(spec, engine, lora, k) if engine is not None else 0
    plan = MemoryPlan(spec, layout, workload, engine)
    for stage in range(layout.pp):
        last = stage == layout.pp - 1
        for tp_rank in range(layout.tp):
            # every EP rank holds as many experts (E / ep) as EP rank 0
            base = base_bytes(spec, layout.tp, layout.pp, stage, tp_rank, workload.dtype, workload.fp8, layout.ep)
            actor = k * per_adapter[(stage, tp_rank)]  # every experiment's policy (and critic, head)
            critic = actor if workload.critic else 0
            heads = k * head_bytes(spec, master_dtype(workload.dtype)) if workload.critic and last else 0
            optimizer = 2 * (actor + critic + heads)  # AdamW: exp_avg and exp_avg_sq per trainable element
            # a sleeping engine is on the GPU only while it generates; one that stays awake, throughout
            awake = colocated if engine is not None and not engine.sleeps else 0
            persistent = base + actor + critic + heads + optimizer + awake
            phases = [_forward_phase(spec, layout, workload, stage, tp_rank),
                      _update_phase(spec, layout, workload, stage, tp_rank, False, actor)]
            if engine is not None and engine.sleeps:
                phases.append(_Phase("generate", 0, 0, 0, colocated))
            if workload.critic:
                phases.append(_update_phase(spec, layout, workload, stage, tp_rank, True, critic + heads))
            experts = k * per_expert_part[stage]
            grads, bucket = max((actor, _reduce_bucket(layout, actor, experts)),
                                (critic + heads, _reduce_bucket(layout, critic + heads, experts if critic else 0)),
                                key=sum)
            if bucket:
                phases.append(_Phase("reduce", grads, bucket, 0))
            top = max(phases, key=lambda p: p.grads + p.activations + p.logits + p.engine)
            plan.ranks.append(RankMemory(
                stage=stage, tp_rank=tp_rank, base=base, adapters=actor + critic, grads=top.grads,
                optimizer=optimizer, heads=heads, activations=top.activations, logits=top.logits,
                engine=awake + top.engine, peak=persistent + top.grads + top.activations + top.logits + top.engine,
                phase=top.name, phases={p.name: persistent + p.grads + p.activations + p.logits + p.engine
                                        for p in phases}))
    return plan


def packed_step_bytes(spec: ModelSpec, tokens: int, dtype: torch.dtype, rank: int) -> int:
    """Peak activation and logits bytes of one packed forward + backward micro-batch of ``tokens`` tokens on one
    process (TP 1, PP 1): the actor update's peak (:func:`_update_phase`) with a LoRA of ``rank`` on every linear
    layer (a LoRA on the output layer adds ``rank`` values per token: nothing next to its logits)."""
    workload = Workload.packed_budget(tokens, rank=rank, critic=False, dtype=dtype,
                                      target_modules="all-linear")
    phase = _update_phase(spec, Layout(), workload, 0, 0, False, 0)
    return phase.activations + phase.logits


def microbatch_tokens(spec: ModelSpec, budget: int, dtype: torch.dtype, rank: int, longest: int) -> int:
    """The most tokens (up to ``longest``) a packed forward + backward micro-batch may hold for its activations and
    logits (:func:`packed_step_bytes`) to stay within ``budget`` bytes; at least 1."""
    lo, hi = 1, max(1, longest)
    if packed_step_bytes(spec, hi, dtype, rank) <= budget:
        return hi
    while lo < hi:  # the bytes grow with the tokens: bisect
        mid = (lo + hi + 1) // 2
        if packed_step_bytes(spec, mid, dtype, rank) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo
