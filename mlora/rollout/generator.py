"""The generator protocol: prompts in, sampled token ids and the engine's log-probs out."""

from __future__ import annotations

from dataclasses import dataclass, field
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

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[Generation]:
        """``n_samples_per_prompt`` generations per prompt, grouped by prompt, in prompt order."""

    def update_adapter(self, adapter_dir: Path, name: str) -> float:
        """Serve the PEFT adapter in ``adapter_dir`` as ``name`` from now on (hot swap); returns seconds taken."""

    def close(self) -> None:
        """Release engines and processes."""
