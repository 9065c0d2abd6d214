"""The generator protocol: prompts in, sampled token ids and the engine's log-probs out."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling parameters (``generator.sampling_params.*``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_generate_length: int = 64
    n_samples_per_prompt: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


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

    def update_adapter(self, adapter_dir: Path) -> float:
        """Serve the PEFT adapter in ``adapter_dir`` from now on (hot swap); returns seconds taken."""

    def close(self) -> None:
        """Release engines and processes."""
