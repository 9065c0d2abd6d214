"""Preemption: SIGTERM or SIGUSR1 make the trainer finish its step, save, release the engines and
exit with 75 (EX_TEMPFAIL, "try again"), after rank 0 wrote ``<run_dir>/preempted.json``.

A signal may reach only some ranks (or reach them during different steps), so the ranks agree:
each step ends with one all-reduce (MAX) of "was I signalled?", and all stop after the same step.
The handlers only set a flag, never raise: a second signal during the save changes nothing, and
the checkpoint becomes visible by an atomic rename anyway (:mod:`mlora.checkpoint.dirs`).

The handlers are installed by the trainer entry (:func:`mlora.train.loop.run`, through
:class:`PreemptionGuard`), never at import, and the previous handlers come back when a run ends
normally.

torchrun: a worker that exits with 75 makes torchrun exit with 1 (ChildFailedError); a torchrun
that received SIGTERM itself forwards it to its workers, waits ``--shutdown-timeout`` seconds
(default 30) before SIGKILL, and exits with 1 (SignalException). SIGUSR1 kills torchrun unless it
is in ``--signals-to-handle``. So a job script should requeue on ``preempted.json``, not on
torchrun's exit code.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("mlora")

EX_TEMPFAIL = 75  # sysexits.h: a temporary failure, the job should be retried (requeued)
MARKER = "preempted.json"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(SystemExit):
    """The run stopped early for preemption: exit code 75. ``step`` None: during start-up (model
    loading, engine start), before any step of this run, so there was nothing new to save."""

    def __init__(self, step: int | None, checkpoint: Path | None) -> None:
        super().__init__(EX_TEMPFAIL)
        self.step, self.checkpoint = step, checkpoint


class PreemptionGuard:
    """Context manager for SIGTERM and SIGUSR1 during a run.

    During start-up (loading a 70B base, starting engines: minutes, and nothing new to save) the first
    signal raises :class:`Preempted` at once, so the process exits 75 instead of ignoring it. Once
    :meth:`defer` was called (the training loop starts), signals only record that a stop was asked
    for; the loop stops after the current step. Later signals only count.
    """

    def __init__(self, signals=SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received: str | None = None  # name of the first signal received
        self.count = 0
        self.deferring = False
        self._previous: dict = {}

    def defer(self) -> None:
        """From now on a signal means: finish the step, checkpoint, then exit 75."""
        self.deferring = True

    def _handler(self, signum: int, frame) -> None:
        self.count += 1
        if self.received is not None:
            return
        self.received = signal.Signals(signum).name
        # os.write, not log: a handler may interrupt the logging module while it holds its lock
        if not self.deferring:
            os.write(2, f"mlora: {self.received} received during start-up: exiting {EX_TEMPFAIL}\n".encode())
            raise Preempted(None, None)
        os.write(2, f"mlora: {self.received} received: finishing the step, then checkpoint and exit "
                    f"{EX_TEMPFAIL}\n".encode())

    def __enter__(self) -> "PreemptionGuard":
        if threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: SIGTERM/SIGUSR1 will not checkpoint before exiting")
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if isinstance(exc, Preempted):
            return  # keep recording: the process is about to exit 75, a late SIGTERM must not turn it into -15
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        """Whether this process received a stop signal."""
        return self.received is not None

    def agreed(self, device: torch.device | str = "cpu", group=None) -> bool:
        """Collective: True on every rank when any rank was signalled (call once per step, on every rank)."""
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=device)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())


def write_marker(run_dir: Path, step: int | None, checkpoint: Path | None, signal_name: str | None) -> Path:
    """``<run_dir>/preempted.json``: {"step", "checkpoint", "signal", "time", "exit_code"}, written
    atomically; step and checkpoint are null when the run was stopped during start-up."""
    from mlora.formats.durable import write_text_atomic

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / MARKER
    body = {"step": step, "checkpoint": None if checkpoint is None else str(Path(checkpoint).resolve()),
            "signal": signal_name, "time": time.time(), "exit_code": EX_TEMPFAIL}
    write_text_atomic(path, json.dumps(body, indent=1) + "\n")
    return path


def clear_marker(run_dir: Path) -> None:
    """A run that completed all its steps leaves no marker behind (nothing to requeue)."""
    (run_dir / MARKER).unlink(missing_ok=True)
