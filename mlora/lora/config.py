"""LoraConfig: the adapter hyper-parameters users know from PEFT and SkyRL."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence, Union

TargetSpec = Union[str, Sequence[str], None]


@dataclass(frozen=True)
class LoraConfig:
    """One LoRA adapter's shape and scaling.

    Args:
        rank: r, the inner dimension of ``B @ A`` (any positive integer; no relation to TP needed).
        alpha: ``lora_alpha``; the branch is scaled by ``alpha / rank`` (``alpha / sqrt(rank)``
            with ``use_rslora``).
        dropout: dropout on the branch input, active in training mode only.
        target_modules: ``"all-linear"``, HF names (``q_proj k_proj v_proj o_proj gate_proj
            up_proj down_proj``), Megatron names (``linear_qkv linear_proj linear_fc1
            linear_fc2``) or layer-indexed paths such as ``layers.0.self_attn.q_proj``.
        exclude_modules: same forms; removed from the targets.
        use_rslora: rank-stabilised scaling.
        seed: seeds the deterministic, mesh-independent initialisation of A (B starts at 0).
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: TargetSpec = "all-linear"
    exclude_modules: TargetSpec = None
    use_rslora: bool = False
    seed: int = 0
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoRA rank={self.rank!r} is invalid: it must be a positive integer")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha={self.alpha!r} is invalid: it must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout={self.dropout!r} is invalid: it must be in [0, 1)")

    @property
    def scaling(self) -> float:
        """The factor s in ``W x + s · B A x``."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)
