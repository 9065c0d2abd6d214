"""Asynchronous training (``trainer.fully_async``) as SkyRL runs it: prompt groups generate continuously, admitted
by SkyRL's capacity rule, and each step trains the first ``B`` groups to *finish* (SkyRL's finish-time FIFO).

The unit is a *group*: one prompt and its ``n_samples_per_prompt`` samples. Groups are numbered in the run's
order and start in that order (group ``g`` is prompt ``g`` of the synchronous loop's order); they finish in any
order. While step ``s`` is being worked on (``s - 1`` updates applied), generation may have started at most
``(S + s)·B`` groups in all, counting those trained and those running (``S = max_staleness_steps``,
``B = trainer.train_batch_size``; SkyRL's ``_AsyncStalenessManager``: ``accepted + running <= (S + step)·B``), and
at most ``W`` may be generating at once (``W = num_parallel_generation_workers``). A group started while step
``i`` was worked on (policy version ``i - 1``) and trained at step ``j`` has staleness ``j - i``: the rule bounds
it by ``S`` in steady state (SkyRL's own caveat: a group slower than ``S`` steps still trains, counted in
``async/staleness_violation_count``). The engines take each update in flight (pause, sync, resume), so a group's
later tokens may come from newer versions; its staleness counts from its start, as SkyRL's.

:class:`GroupSchedule` is the bookkeeping; :class:`AsyncGeneration` runs it on the rank holding the engines:
a thread admits groups as capacity opens, worker threads wait for each group (and play its environment's
turns), and the trainer takes finished groups in the order they finished.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field


@dataclass
class Finished:
    """A generated group: its index, the policy version (updates applied) when it started, its generations and
    rewards, and when it started and finished (seconds of ``time.monotonic``)."""

    group: int
    version: int
    gens: list
    rewards: list
    started: float
    finished: float


@dataclass
class GroupSchedule:
    """Which groups may start now. ``first``: the groups trained before this launch (a resumed run: its
    checkpoint's step x batch, SkyRL's ``accepted := consumed``); ``total``: groups in the whole run; ``order``:
    the groups still to generate, in the order they start (default ``first .. total - 1``; a resumed run's are
    the groups its checkpoint did not train, SkyRL's non-consumed uids)."""

    batch: int
    max_staleness: int
    workers: int
    first: int
    total: int
    order: list[int] | None = None
    submitted: int = field(init=False)  # groups started so far, those trained before included (= accepted + running)
    accepted: int = field(init=False)  # groups that finished generating

    def __post_init__(self) -> None:
        if self.batch < 1 or self.max_staleness < 0 or self.workers < self.batch:
            raise ValueError(f"batch={self.batch}, max_staleness={self.max_staleness}, workers={self.workers}: "
                             "need batch >= 1, max_staleness >= 0, workers >= batch")
        if self.order is None:
            self.order = list(range(self.first, self.total))
        if self.first + len(self.order) != self.total:
            raise ValueError(f"{len(self.order)} groups to generate after {self.first} trained: the run has {self.total}")
        self.submitted = self.accepted = self.first

    def capacity(self, step: int) -> int:
        """Groups that may have started in all while step ``step`` is worked on."""
        return (self.max_staleness + step) * self.batch

    def admit(self, step: int) -> list[int]:
        """The groups to start now at step ``step`` (maybe none): as many as the capacity, the free workers and the
        run's remaining groups allow."""
        running = self.submitted - self.accepted
        n = min(self.capacity(step) - self.submitted, self.workers - running, self.total - self.submitted)
        if n <= 0:
            return []
        start, self.submitted = self.submitted, self.submitted + n
        return self.order[start - self.first:self.submitted - self.first]

    def accept(self) -> None:
        """A group finished generating (SkyRL's ``on_rollout_accepted``): its worker is free."""
        if self.accepted >= self.submitted:
            raise RuntimeError("a group finished that was never started")
        self.accepted += 1


class AsyncGeneration:
    """Continuous generation of prompt groups on the rank holding the engines.

    ``start(groups, version)``: starts groups (their indices) sampled with policy ``version`` and returns, per group,
    a call that waits for it and returns ``(generations, rewards)`` (:meth:`mlora.train.rollouts.Rollouts.
    start_groups`); it runs in the admitting thread, the returned calls in worker threads. ``step``: the step
    being worked on now (the first of this launch)."""

    def __init__(self, schedule: GroupSchedule, start: Callable[[list[int], int], Sequence[Callable[[], tuple]]],
                 step: int) -> None:
        self.schedule, self._start, self.step = schedule, start, step
        self._cond = threading.Condition()
        self._finished: list[Finished] = []
        self._failure: BaseException | None = None
        self._stop = False
        self._pool = ThreadPoolExecutor(max(1, schedule.workers), thread_name_prefix="mlora-group")
        self._admitter = threading.Thread(target=self._admit_loop, name="mlora-admit", daemon=True)
        self._admitter.start()

    def take(self, n: int) -> list[Finished]:
        """The next ``n`` groups to finish, in the order they finished (waits for them)."""
        with self._cond:
            while len(self._finished) < n and self._failure is None:
                self._cond.wait()
            if self._failure is not None:
                raise RuntimeError(f"asynchronous generation failed: {self._failure}") from self._failure
            out, self._finished = self._finished[:n], self._finished[n:]
        return out

    def advance(self, step: int) -> None:
        """Step ``step`` is worked on now (the previous update is in the engines): capacity opens."""
        with self._cond:
            self.step = step
            self._cond.notify_all()

    def state(self) -> tuple[int, int]:
        """Groups generating now, and finished groups waiting to be trained."""
        with self._cond:
            return self.schedule.submitted - self.schedule.accepted, len(self._finished)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._admitter.join(timeout=30)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _admit_loop(self) -> None:
        try:
            with self._cond:
                while not self._stop and self._failure is None:
                    groups = self.schedule.admit(self.step)
                    if not groups:
                        self._cond.wait()
                        continue
                    version, started = self.step - 1, time.monotonic()
                    for g, wait in zip(groups, self._start(groups, version)):
                        self._pool.submit(self._finish, g, version, started, wait)
        except BaseException as exc:  # noqa: BLE001 — the trainer raises it at its next take
            self._fail(exc)

    def _finish(self, group: int, version: int, started: float, wait: Callable[[], tuple]) -> None:
        try:
            gens, rewards = wait()
        except BaseException as exc:  # noqa: BLE001
            self._fail(exc)
            return
        with self._cond:
            self._finished.append(Finished(group, version, gens, rewards, started, time.monotonic()))
            self.schedule.accept()
            self._cond.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._failure is None:
                self._failure = exc
            self._cond.notify_all()
