"""What the memory planner is asked about: a mesh layout, a training workload, a colocated engine.

Plain frozen dataclasses with the checks that turn bad input into clear errors; no arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlora.formats.hf_config import ModelSpec, check_layout
from mlora.models.attention import ATTENTION_IMPLS
from mlora.models.recompute import RECOMPUTE, RECOMPUTE_METHODS, RECOMPUTE_MODULES

FP8 = (None, "torch")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: it must be a positive integer")


@dataclass(frozen=True)
class Layout:
    """A TP × PP × DP mesh (``sp``: megatron sequence parallelism over the TP group); ``ep``: a mixture
    of experts' experts split over ``ep`` ranks of each stage's TP × DP plane (expert TP 1), as
    :func:`mlora.init_parallel` builds it."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sp: bool = False
    ep: int = 1

    def check(self, spec: ModelSpec) -> None:
        """ValueError when the numbers are not positive or the model cannot be split this way."""
        for name in ("tp", "pp", "dp", "ep"):
            _positive(name, getattr(self, name))
        if self.sp and self.tp == 1:
            raise ValueError("sp=True needs tp > 1: sequence parallelism splits activations over TP ranks")
        check_layout(spec, self.tp, self.pp, self.ep)
        plane = self.tp * self.dp  # the ranks of one pipeline stage, which the experts are split over
        if plane % self.ep:
            valid = [d for d in range(1, plane + 1) if plane % d == 0 and spec.moe.num_experts % d == 0]
            raise ValueError(f"ep={self.ep} does not divide the {plane} ranks of a pipeline stage (tp={self.tp} x "
                             f"dp={self.dp}): experts are split over ranks of the TP x DP plane; valid ep: {valid}, "
                             f"or a dp that makes tp x dp a multiple of {self.ep}")
        if spec.moe is not None and self.tp > 1 and not self.sp:
            raise ValueError(f"{spec.architecture} is a mixture of experts: at tp={self.tp} megatron's MoE layer needs "
                             "sequence parallelism (sp=True, --sp)")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        return (f"TP{self.tp}xPP{self.pp}xDP{self.dp}" + (f"xEP{self.ep}" if self.ep > 1 else "")
                + ("+SP" if self.sp else ""))


@dataclass(frozen=True)
class Workload:
    """One PPO step as :class:`mlora.train.engine.ActorCriticEngine` runs it.

    ``micro_batch`` sequences of ``seq`` tokens per micro-batch (``forward_micro_batch`` for the
    forward-only passes, default the same); ``micro_batches`` per update and DP rank (None: at least
    ``pp``, so the 1F1B pipeline is full). LoRA ``rank`` on ``target_modules`` for the actor and,
    with ``critic``, the critic (+ value head). ``dtype``: the base's compute dtype (adapters, heads and
    AdamW moments are float32 under a 16-bit one); ``lora_compute_dtype`` the LoRA branches' (as in
    :func:`mlora.from_pretrained`);
    ``fp8="torch"`` stores the four frozen linears in e4m3. ``attention`` and ``recompute*`` as in
    :func:`mlora.from_pretrained`.

    ``experiments``: K experiments trained side by side on the base (``experiments``, :mod:`mlora.train.engine`
    ``step_experiments``), each with this rank, critic and AdamW state: the adapters, heads and moments are K
    times one experiment's, and so are the gradients of an update round; the micro-batches (and so the
    activations and logits) are the same size whatever their rows' experiments.

    ``expert_load``: on a mixture of experts, the token copies an EP rank's experts receive per sparse layer
    relative to balanced routing (1.0, the plan's assumption: ``tokens · top_k`` per rank; exact at EP 1). Up to
    ``ep · min(top_k, E / ep) / top_k``, every token of the EP group routed to one rank's experts.

    ``packed``: sequence packing (``trainer.use_sample_packing`` with ``max_tokens_per_microbatch = seq``):
    each micro-batch is one row of ``seq`` tokens holding several sequences (``micro_batch`` must be 1).
    Its memory is that row's: every linear, norm and the logits see ``seq`` tokens, and the fused attention
    run per sequence keeps ``O(tokens)`` (its log-sum-exp), never more than one sequence of ``seq`` tokens
    would; so the planner sizes the token budget (:meth:`packed_budget`).
    """

    micro_batch: int = 1
    seq: int = 4096
    micro_batches: int | None = None
    forward_micro_batch: int | None = None
    rank: int = 32
    expert_rank: int | None = None  # r of the MoE experts' projections (None: rank)
    target_modules: str | tuple[str, ...] = "all-linear"
    exclude_modules: tuple[str, ...] | None = None
    critic: bool = True
    dtype: torch.dtype = torch.bfloat16
    lora_compute_dtype: torch.dtype | None = None  # None: the adapters' (float32 masters under a 16-bit dtype)
    fp8: str | None = None
    attention: str = "sdpa"
    recompute: str = "none"
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    recompute_modules: tuple[str, ...] = ("core_attn",)
    packed: bool = False
    experiments: int = 1
    expert_load: float = 1.0

    @classmethod
    def packed_budget(cls, tokens: int, **kwargs) -> "Workload":
        """Packed micro-batches of ``tokens`` tokens (forward passes too)."""
        return cls(micro_batch=1, seq=tokens, forward_micro_batch=1, packed=True, **kwargs)

    def lora_config(self):
        """The actor's LoraConfig (alpha 2·rank: bytes do not depend on it)."""
        from mlora.lora.config import LoraConfig

        return LoraConfig(rank=self.rank, alpha=2 * self.rank, target_modules=self.target_modules,
                          exclude_modules=self.exclude_modules, expert_rank=self.expert_rank)

    def check(self, spec: ModelSpec, layout: Layout) -> None:
        """ValueError naming the first bad field."""
        for name in ("micro_batch", "seq", "rank", "recompute_num_layers", "experiments"):
            _positive(name, getattr(self, name))
        for name in ("micro_batches", "forward_micro_batch", "expert_rank"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point or self.dtype.itemsize < 2:
            raise ValueError(f"dtype={self.dtype!r}: use torch.bfloat16, torch.float16 or torch.float32")
        if self.lora_compute_dtype not in (None, torch.float32, self.dtype):
            raise ValueError(f"lora_compute_dtype={self.lora_compute_dtype!r}: valid are None, torch.float32 or "
                             f"the compute dtype {self.dtype}")
        if self.fp8 not in FP8:
            raise ValueError(f"fp8={self.fp8!r} is not planned; valid: None, 'torch' (Transformer Engine's "
                             "memory is not modelled)")
        if self.fp8 is not None and spec.moe is not None:
            raise ValueError(f"fp8={self.fp8!r} on {spec.architecture}, a mixture of experts: FP8 experts are not "
                             "built yet; valid: fp8=None")
        if spec.moe is not None:
            worst = worst_expert_load(spec, layout)
            load = self.expert_load
            if isinstance(load, bool) or not isinstance(load, (int, float)) or not 1.0 <= load <= worst:
                raise ValueError(f"expert_load={self.expert_load!r}: valid from 1.0 (balanced routing) to {worst:g} "
                                 f"(every token of the EP group sent to one rank's experts at ep={layout.ep})")
        elif self.expert_load != 1.0:
            raise ValueError(f"expert_load={self.expert_load!r} on {spec.architecture}, which has no experts; "
                             "valid: 1.0")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention={self.attention!r}; valid: {', '.join(ATTENTION_IMPLS)}")
        if self.packed and (self.micro_batch != 1 or self.forward_batch != 1):
            raise ValueError(f"a packed workload is one row of seq={self.seq} tokens per micro-batch: micro_batch "
                             f"and forward_micro_batch must be 1, got {self.micro_batch} and {self.forward_batch}")
        if self.packed and self.attention != "sdpa":
            raise ValueError(f"packed sequences need the fused attention (attention='sdpa'), got {self.attention!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r}; valid: {', '.join(RECOMPUTE)}")
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(f"recompute_method={self.recompute_method!r}; valid: {', '.join(RECOMPUTE_METHODS)}")
        bad = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        if bad or not self.recompute_modules:
            raise ValueError(f"recompute_modules={list(self.recompute_modules)!r}; valid: a non-empty list of "
                             f"{', '.join(RECOMPUTE_MODULES)}")
        per_stage = spec.num_layers // layout.pp
        if self.recompute == "full" and self.recompute_method == "uniform" and per_stage % self.recompute_num_layers:
            raise ValueError(f"recompute_num_layers={self.recompute_num_layers} must divide the {per_stage} layers "
                             "of each pipeline stage (recompute_method=uniform)")

    def in_flight(self, pp: int, stage: int) -> int:
        """Micro-batches whose activations stage ``stage`` holds at once under 1F1B: ``pp - stage``
        (warm-up forwards plus the one in steady state), at most the micro-batches there are."""
        total = self.micro_batches if self.micro_batches is not None else pp
        return min(pp - stage, total)

    @property
    def forward_batch(self) -> int:
        return self.forward_micro_batch or self.micro_batch

    def padded_seq(self, layout: Layout) -> int:
        """Tokens per sequence inside the model: under SP the model right-pads to a multiple of TP."""
        return -(-self.seq // layout.tp) * layout.tp if layout.sp else self.seq


def worst_expert_load(spec: ModelSpec, layout: Layout) -> float:
    """The largest :attr:`Workload.expert_load`: every token of an EP group sends all the copies it can (one
    per expert, ``top_k`` at most) to one rank's ``E / ep`` experts."""
    moe = spec.moe
    return layout.ep * min(moe.top_k, moe.num_experts // layout.ep) / moe.top_k


@dataclass(frozen=True)
class Engine:
    """A vLLM engine colocated with the trainer: ``tp`` GPUs per engine, a KV cache of ``kv_tokens``
    tokens per engine, weights and cache in ``dtype`` (``fp8``: the engine's base in e4m3). ``sleeps``:
    it sleeps while the trainer works (vLLM's sleep mode, level 1, as mlora runs colocated engines on
    CUDA), so it holds its memory only while it generates, when the trainer's activations, gradients and
    logits are freed; False: it holds it throughout."""

    tp: int = 1
    kv_tokens: int = 0
    dtype: torch.dtype = torch.bfloat16
    fp8: str | None = None
    sleeps: bool = True

    def check(self, spec: ModelSpec) -> None:
        """vLLM's rule: TP divides the attention heads; KV heads are split, or replicated when TP
        exceeds them (then TP must be a multiple of them)."""
        _positive("engine_tp", self.tp)
        if isinstance(self.kv_tokens, bool) or not isinstance(self.kv_tokens, int) or self.kv_tokens < 0:
            raise ValueError(f"kv_tokens={self.kv_tokens!r} is invalid: it must be an integer >= 0")
        kv = spec.num_kv_heads
        if spec.num_heads % self.tp or (kv % self.tp if self.tp <= kv else self.tp % kv):
            raise ValueError(f"engine_tp={self.tp} does not split num_attention_heads={spec.num_heads} / "
                             f"num_key_value_heads={kv}")
        if self.fp8 not in FP8:
            raise ValueError(f"engine fp8={self.fp8!r}; valid: None, 'torch'")
