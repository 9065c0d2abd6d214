"""Generation over engines that several ranks started (each node's local rank 0 starts its node's
engines, :mod:`mlora.rollout.placement`), collective over the trainer's default group.

The engines have global indices ``0..total-1``; prompt ``i`` of a batch goes to engine ``i mod total``
whichever rank holds it, and samples prompt ``i`` with seed ``seed + i`` (:class:`~mlora.rollout.generator.
SamplingConfig`; or with the seed of its own config, when the batch has one per prompt), so the results do
not depend on how many ranks hold engines. A batch may mix adapters: one adapter name per prompt. Each
holder scores what its engines produced (reward functions run beside the engine that answered), then every
rank gets every (generation, reward) in prompt order.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch.distributed as dist

from mlora.rollout.generator import Generation, SamplingConfig


def submit_generation(engines, slots: Sequence[int], total: int, prompts: list[list[int]],
                      sampling: SamplingConfig | Sequence[SamplingConfig], adapters: Sequence[str] | None = None
                      ) -> tuple | None:
    """Queue a batch's generation on this rank's engines (None where it holds none); not collective.
    ``sampling``: one config or one per prompt; ``adapters``: None (the engines' one adapter) or one adapter
    name per prompt (:meth:`~mlora.rollout.vllm_engine.EngineGroup.submit_generate`). :func:`collect_scored`
    waits for it."""
    if engines is None:
        return None
    return (engines.submit_generate(prompts, sampling, slots=list(slots), total=total, adapters=adapters),
            time.perf_counter())


def collect_scored(engines, pending: tuple | None, score: Callable[[int, Generation], float]
                   ) -> tuple[list[Generation], list[float], float]:
    """Collective: ``(generations, rewards, seconds)`` of a :func:`submit_generation` batch on every rank.

    ``score(prompt index, generation)``: the reward, computed beside the engine that answered. ``seconds``: the
    slowest holder's time from submitting to having scored (for a batch queued ahead, it includes the wait
    behind the earlier work)."""
    part: tuple = ([], [], 0.0)
    if pending is not None:
        calls, t0 = pending
        gens = engines.finish_generate(calls)
        part = (gens, [score(g.prompt_index, g) for g in gens], time.perf_counter() - t0)
    return gather_scored(part)


def gather_scored(part: tuple[list[Generation], list[float], float]) -> tuple[list[Generation], list[float], float]:
    """Collective: every rank's ``(generations, rewards, seconds)`` part (empty where it holds no engine) as one
    batch in prompt order, with the slowest part's seconds."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    pairs = [(g, r) for gens, rewards, _ in parts for g, r in zip(gens, rewards)]
    pairs.sort(key=lambda pair: pair[0].prompt_index)  # stable: the samples of a prompt keep their order
    return [g for g, _ in pairs], [r for _, r in pairs], max(p[2] for p in parts)


def generate_scored(engines, slots: Sequence[int], total: int, prompts: list[list[int]],
                    sampling: SamplingConfig | Sequence[SamplingConfig], score: Callable[[int, Generation], float],
                    adapters: Sequence[str] | None = None) -> tuple[list[Generation], list[float], float]:
    """Collective: ``(generations, rewards, seconds)`` of the whole batch on every rank, generated now.

    ``engines``: this rank's :class:`~mlora.rollout.vllm_engine.EngineGroup` (None where it holds none),
    engines ``slots`` of ``total``; ``sampling``, ``adapters``: see :func:`submit_generation`;
    ``score(prompt index, generation)``: the reward. ``seconds``: the slowest holder's time to generate and
    score."""
    return collect_scored(engines, submit_generation(engines, slots, total, prompts, sampling, adapters), score)
