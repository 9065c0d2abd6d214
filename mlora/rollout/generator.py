"""The generator protocol: prompts in, sampled token ids and the engine's log-probs out."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling parameters (``generator.sampling_params.*``).

    The engine samples from ``softmax(z / temperature)`` truncated by min-p, then top-k, then
    top-p (vLLM's order); the trainer must use the same ``temperature``, ``top_k``, ``top_p``,
    ``min_p`` (PPOConfig) so that its log-probs are of the distribution that was sampled.
    """

    temperature: float = 1.0
    top_p: float = 1.0  # nucleus: smallest set of most likely tokens with mass >= top_p; 1 = off
    top_k: int = -1  # keep the k most likely tokens; -1 (SkyRL) or 0 (vLLM) = off
    min_p: float = 0.0  # keep tokens with p >= min_p * max p; 0 = off
    max_generate_length: int = 64
    n_samples_per_prompt: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (generator.sampling_params.stop)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"sampling temperature={self.temperature} must be >= 0 (0 = greedy)")
        check_truncation(self.top_p, self.top_k, self.min_p, "sampling ")


def per_prompt_configs(s: SamplingConfig, indices: Iterable[int]) -> list[SamplingConfig]:
    """One config per prompt, each with the seed prompt ``i`` of a batch sampled with ``s`` gets (``s.seed + i``:
    reproducible, independent of how many engines share the batch, yet prompts do not share a stream), for the
    prompts at ``indices`` of that batch. Batches that mix configs (or adapters) pass such lists to the engines,
    which use each config's seed as it is: a prompt samples as it would in its own batch."""
    return [replace(s, seed=None if s.seed is None else s.seed + i) for i in indices]


def check_truncation(top_p: float, top_k: int, min_p: float, prefix: str = "") -> None:
    """Raise a ValueError naming the bad one of vLLM's truncation parameters."""
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"{prefix}top_p={top_p} must be in (0, 1] (1 = off)")
    if top_k < -1:
        raise ValueError(f"{prefix}top_k={top_k} must be >= 1, or -1 / 0 for off")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"{prefix}min_p={min_p} must be in [0, 1] (0 = off)")


@dataclass
class Generation:
    """One sampled response: its token ids and the engine's log-prob of each."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str = ""
    finish_reason: str = ""
    extra: dict = field(default_factory=dict)


class Generator(Protocol):
    """What the RL loop needs from a rollout backend."""

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig | Sequence[SamplingConfig],
                 adapters: Sequence[str] | None = None) -> list[Generation]:
        """``n_samples_per_prompt`` generations per prompt, grouped by prompt, in prompt order. ``sampling``: one
        config for all (prompt ``i`` seeded ``seed + i``) or one per prompt (:func:`per_prompt_configs`);
        ``adapters``: the adapter of each prompt (None: the one adapter served)."""

    def update_adapter(self, adapter_dir: Path, name: str) -> float:
        """Serve the PEFT adapter in ``adapter_dir`` as ``name`` from now on, in place of the adapter of that name
        (hot swap); returns seconds taken."""

    def close(self) -> None:
        """Release engines and processes."""
