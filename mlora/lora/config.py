"""LoraConfig: the adapter hyper-parameters users know from PEFT and SkyRL."""

from __future__ import annotations

import hashlib
import math
import warnings
from dataclasses import dataclass, field
from typing import Sequence, Union

TargetSpec = Union[str, Sequence[str], None]

# How A starts (B always starts at zero). "kaiming" and "gaussian" are PEFT's ``init_lora_weights``
# True / "gaussian"; "xavier", "normal", "zero" are Megatron-Bridge's ``lora_A_init_method``.
INIT_METHODS = ("kaiming", "gaussian", "xavier", "normal", "zero")


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (e.g. seed, adapter name, layer, projection), stable across
    processes, Python versions and meshes: Python's ``hash()`` is salted per process, and seeds
    built by arithmetic on positions collide (two projections at the same index share one)."""
    key = "|".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


def master_dtype(dtype):
    """The dtype trainable adapters and heads are kept in on a base of ``dtype``: float32 under a
    16-bit base (bf16 factors barely move at LoRA learning rates: most AdamW updates round away, as
    PEFT and Megatron's float32 main parameters avoid), else the base's own."""
    import torch

    return torch.float32 if dtype.itemsize < 4 else dtype


@dataclass(frozen=True)
class LoraConfig:
    """One LoRA adapter's shape and scaling.

    Args:
        rank: r, the inner dimension of ``B @ A`` (any positive integer; no relation to TP needed).
        alpha: ``lora_alpha``; the branch is scaled by ``alpha / rank`` (``alpha / sqrt(rank)``
            with ``use_rslora``).
        dropout: dropout on the branch input, active in training mode only; as in PEFT each
            projection (q, k, v, gate, up ...) draws its own mask. Masks do not depend on TP/PP
            (see :class:`mlora.lora.layers.DropoutKey`); each forward call in training mode draws
            new ones (an activation recompute would have to replay the call index).
        target_modules: ``"all-linear"``, HF names (``q_proj k_proj v_proj o_proj gate_proj
            up_proj down_proj``), Megatron names (``linear_qkv linear_proj linear_fc1
            linear_fc2``) or layer-indexed paths such as ``layers.0.self_attn.q_proj``.
        exclude_modules: same forms; removed from the targets.
        use_rslora: rank-stabilised scaling.
        expert_rank: r of every MoE expert's projections (None: ``rank``), scaled ``alpha / expert_rank``
            (``alpha / sqrt(expert_rank)`` with ``use_rslora``) as PEFT scales a module of its
            ``rank_pattern``. "LoRA Without Regret" (Thinking Machines, 2025) suggests the total rank
            divided by the active experts per token. One rank for all experts and projections: vLLM's
            MoE LoRA and PEFT's fused experts take no other.
        seed: seeds the initialisation of A (B starts at 0) and the dropout masks. Each module's
            stream is derived from (seed, adapter name, layer, HF projection), so projections,
            layers and adapters of one config never share draws, and the result is the same on
            every TP/PP/DP mesh.
        init_method: how A starts (the full unsharded ``[rank, in_features]`` matrix is drawn, then
            sharded, so every mesh gets the same adapter):

            - ``"kaiming"`` (default): PEFT's default, kaiming-uniform with a=√5, i.e.
              ``U(-1/√in, 1/√in)``.
            - ``"gaussian"``: PEFT's ``init_lora_weights="gaussian"``, ``N(0, std=1/rank)``.
            - ``"xavier"``: Megatron-Bridge's default, xavier (Glorot) normal,
              ``N(0, std=√(2 / (in + rank)))``. Bridge applies it to the A it builds, which with
              GPU initialisation is the TP shard (its fans then depend on TP); here the fans are
              always those of the full matrix.
            - ``"normal"``: Megatron-Bridge's ``N(0, std=0.2)``, whatever the shape.
            - ``"zero"``: Megatron-Bridge's constant 0. With B = 0 too, both factors get zero
              gradients and the adapter never trains (a warning says so); it only makes sense
              for an adapter whose factors are overwritten afterwards.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: TargetSpec = "all-linear"
    exclude_modules: TargetSpec = None
    use_rslora: bool = False
    seed: int = 0
    init_method: str = "kaiming"
    expert_rank: int | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoRA rank={self.rank!r} is invalid: it must be a positive integer")
        if self.expert_rank is not None and (isinstance(self.expert_rank, bool) or not isinstance(
                self.expert_rank, int) or self.expert_rank <= 0):
            raise ValueError(f"LoRA expert_rank={self.expert_rank!r} is invalid: it must be a positive integer "
                             "(or None: the experts take rank)")
        if self.expert_rank == self.rank:  # the same adapter as without it (and as its PEFT files read back)
            object.__setattr__(self, "expert_rank", None)
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha={self.alpha!r} is invalid: it must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout={self.dropout!r} is invalid: it must be in [0, 1)")
        if self.init_method not in INIT_METHODS:
            raise ValueError(f"LoRA init_method={self.init_method!r} is invalid; valid: {', '.join(INIT_METHODS)}")
        if self.init_method == "zero":
            warnings.warn("LoRA init_method='zero' starts A and B at zero: both gradients are zero and the "
                          "adapter will not train unless its factors are set afterwards", stacklevel=3)

    @property
    def scaling(self) -> float:
        """The factor s in ``W x + s · B A x`` (of a module that is not a MoE expert)."""
        return self.scaling_of(False)

    def rank_of(self, expert: bool) -> int:
        """r of an expert's projection (``expert``) or of any other module."""
        return self.expert_rank if expert and self.expert_rank is not None else self.rank

    def scaling_of(self, expert: bool) -> float:
        """s of an expert's projection (``expert``) or of any other module."""
        r = self.rank_of(expert)
        return self.alpha / (math.sqrt(r) if self.use_rslora else r)

    @property
    def max_rank(self) -> int:
        """The largest r of any module (what an engine's ``max_lora_rank`` must hold)."""
        return max(self.rank, self.expert_rank or 0)
