"""Admission control of asynchronous training (``trainer.fully_async``): SkyRL's capacity rule on prompt groups.

The unit is a *group*: one prompt and its ``n_samples_per_prompt`` samples. Groups are numbered in the run's
order (step ``s`` trains groups ``(s-1)·B .. s·B-1``, ``B = trainer.train_batch_size``: the prompts the
synchronous loop would train at that step). While step ``s`` is being worked on (``s - 1`` updates applied),
generation may have submitted at most ``(S + s)·B`` groups in all (``S = max_staleness_steps``; SkyRL's
``AsyncStalenessManager``: ``accepted + running <= (S + current_global_step)·B``) and at most ``W`` may be
generating at once (``W = num_parallel_generation_workers``). A group submitted with policy version ``v`` and
trained at step ``s`` has staleness ``s - 1 - v <= S``: the rule bounds it, it does not fix it (groups that
open late, after updates, sample with a newer version). ``S = 0`` admits each step's groups only after the
previous update: the synchronous loop.

This module is the bookkeeping only (no engines, no collectives): :class:`GroupSchedule` says which groups to
submit now; the RL stage submits them, collects finished chunks in order and trains.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Chunk:
    """Groups ``start .. end - 1`` submitted together with the adapter of policy ``version``."""

    start: int
    end: int
    version: int
    pending: Any = None  # what the engines return for the submission (Rollouts.submit)


@dataclass
class GroupSchedule:
    """Which groups may generate now. ``first``: the first group of this launch (a resumed run starts at its
    checkpoint's step: SkyRL's ``accepted := consumed``); ``total``: groups in the whole run."""

    batch: int
    max_staleness: int
    workers: int
    first: int
    total: int
    submitted: int = field(init=False)  # groups submitted so far (= accepted + running)
    accepted: int = field(init=False)  # groups whose generation was collected
    chunks: deque = field(init=False, default_factory=deque)  # submitted, not yet collected, in order

    def __post_init__(self) -> None:
        if self.batch < 1 or self.max_staleness < 0 or self.workers < self.batch:
            raise ValueError(f"batch={self.batch}, max_staleness={self.max_staleness}, workers={self.workers}: "
                             "need batch >= 1, max_staleness >= 0, workers >= batch")
        self.submitted = self.accepted = self.first

    def capacity(self, step: int) -> int:
        """Groups that may have been submitted in all while step ``step`` is worked on."""
        return (self.max_staleness + step) * self.batch

    def admit(self, step: int) -> tuple[int, int] | None:
        """The groups ``(start, end)`` to submit now at step ``step``, or None: as many as the capacity, the
        free workers and the run's remaining groups allow."""
        running = self.submitted - self.accepted
        n = min(self.capacity(step) - self.submitted, self.workers - running, self.total - self.submitted)
        if n <= 0:
            return None
        start, self.submitted = self.submitted, self.submitted + n
        return start, self.submitted

    def add(self, chunk: Chunk) -> None:
        self.chunks.append(chunk)

    def next_chunk(self) -> Chunk:
        """The oldest chunk not collected yet (the engines answer in submission order); counted accepted."""
        chunk = self.chunks.popleft()
        self.accepted = chunk.end
        return chunk

    @staticmethod
    def step_of(group: int, batch: int) -> int:
        """The step that trains ``group``."""
        return group // batch + 1
