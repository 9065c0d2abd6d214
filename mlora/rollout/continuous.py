"""Continuous batching on the trainer's side: one thread per engine steps it, requests join its running batch
between two steps and are answered as they finish, and every other engine call (an adapter swap, an
evaluation's batch) runs between two steps too.

This is the engine path the Tinker service's sampler also takes (``VLLMServer.add`` / ``run`` / ``abort``,
:mod:`mlora.rollout.vllm_engine`). Asynchronous training (``trainer.fully_async``) generates through it:
prompt groups start whenever the staleness bound admits them and finish in any order, and an adapter swap is
SkyRL's pause, sync, resume in its ``keep`` mode: the engine stops stepping, loads the new adapter in place
under the same ``LoRARequest`` id, and the requests in flight go on under the new weights (their KV cache kept;
the tokens each version sampled carry that version's log-probs, which is what the losses on the engine's
log-probs need).

A :class:`ContinuousEngine` has the ``submit`` / ``result`` pair of the engines it wraps, so an
:class:`~mlora.rollout.vllm_engine.EngineGroup` holds it in their place: the group's calls then wait for the
next step boundary instead of queueing behind generation.
"""

from __future__ import annotations

import itertools
import logging
import threading
import traceback
from concurrent.futures import Future

log = logging.getLogger("mlora.rollout")
STEP_SECONDS = 0.05  # the longest the engine steps before waiting calls and new requests get in


class Refused(ValueError):
    """The engine refused a request (bad sampling parameters, an adapter it cannot load): the caller's error."""


class ContinuousEngine:
    """One engine (:class:`~mlora.rollout.vllm_engine.LocalVLLMEngine` or ``RayVLLMEngine``) stepped by a thread
    of its own. ``generate(requests)`` adds requests (``VLLMServer.add``'s dicts, without ``id``) and returns a
    future per request, resolved with its result (``request_result``), or failed with :class:`Refused` (vLLM
    refused it) or ``RuntimeError`` (the step it ran in failed: the requests then running are aborted and the engine
    goes on; if it cannot abort them, it is gone and every later call fails); ``submit(method, *args)`` runs any
    other engine call between two steps. ``starting``: the engine was started with ``wait=False``; the thread
    first waits for it to be ready, and calls may come at once. ``batch_window``: an idle engine waits this long
    after a first request so that the rest of a burst starts with it. ``label`` names the engine in errors and in
    the log; ``log_batches``: log how many requests (of how many adapters) run whenever requests join others."""

    def __init__(self, engine, label: str = "vLLM engine", step_seconds: float = STEP_SECONDS,
                 batch_window: float = 0.0, starting: bool = False, log_batches: bool = False) -> None:
        self.engine, self.label, self.step_seconds, self.batch_window = engine, label, step_seconds, batch_window
        self._starting, self._log_batches = starting, log_batches
        self._adapters: dict[str, str] = {}  # running request id -> its adapter, for the log
        self._cond = threading.Condition()
        self._new: list[tuple[dict, Future]] = []
        self._calls: list[tuple[str, tuple, Future]] = []
        self._running: dict[str, Future] = {}
        self._ids = itertools.count()
        self._stop = False
        self._failure: BaseException | None = None
        self.state = "starting"  # then "ready", or "failed" (it did not start, or died)
        self._thread = threading.Thread(target=self._loop, name=f"mlora-continuous-{label}", daemon=True)
        self._thread.start()

    def generate(self, requests: list[dict]) -> list[Future]:
        """Add ``requests`` to the engine's running batch at its next step (all in one ``add``); a future each."""
        futures = [Future() for _ in requests]
        with self._cond:
            self._check()
            for r, f in zip(requests, futures):
                self._new.append(({**r, "id": f"c{next(self._ids)}"}, f))
            self._cond.notify_all()
        return futures

    def submit(self, method: str, *args) -> Future:
        """``method(*args)`` on the engine between two of its steps (the generation in flight pauses)."""
        future: Future = Future()
        with self._cond:
            self._check()
            self._calls.append((method, args, future))
            self._cond.notify_all()
        return future

    @staticmethod
    def result(handle: Future):
        return handle.result()

    def close(self) -> None:
        """Stop the thread (requests in flight fail), then close the engine."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
        self.engine.close()

    def _check(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"{self.label} stopped: {self._failure}") from self._failure
        if self._stop:
            raise RuntimeError(f"{self.label} is closed")

    def _loop(self) -> None:
        try:
            if self._starting:
                self.engine.wait_ready()
            self.state = "ready"
            while True:
                with self._cond:
                    while not (self._new or self._calls or self._running or self._stop):
                        self._cond.wait()
                    if self._new and not self._running and self.batch_window > 0 and not self._stop:
                        self._cond.wait(self.batch_window)  # an idle engine: the rest of a burst starts with its first
                    if self._stop:
                        break
                    calls, self._calls = self._calls, []
                    new, self._new = self._new, []
                for method, args, future in calls:  # paused: nothing steps while they run
                    try:
                        future.set_result(self._call(method, *args))
                    except Exception as exc:  # the caller's error, not the engine's death
                        future.set_exception(exc)
                self._add(new)
                self._step()
        except BaseException as exc:  # the engine is gone: everyone waiting learns why
            log.error("%s: continuous generation stopped:\n%s", self.label, traceback.format_exc())
            self._failure = exc
            self.state = "failed"
        error = RuntimeError(f"{self.label} stopped: {self._failure}" if self._failure else f"{self.label} closed")
        with self._cond:
            pending = [f for _, f in self._new] + [f for *_, f in self._calls] + list(self._running.values())
            self._new, self._calls, self._running = [], [], {}
        for future in pending:
            if not future.done():
                future.set_exception(error)

    def _add(self, new: list[tuple[dict, Future]]) -> None:
        if not new:
            return
        try:
            refused = self._call("add", [r for r, _ in new])
        except Exception as exc:
            self._recover([f for _, f in new], exc)
            return
        for (r, future), why in zip(new, refused):
            if why is None:
                self._running[r["id"]] = future
                self._adapters[r["id"]] = str(r.get("adapter"))
            else:
                future.set_exception(Refused(why))
        if self._log_batches and len(self._running) > 1:
            log.info("%s: %d requests running (%d adapters)", self.label, len(self._running),
                     len(set(self._adapters.values())))

    def _step(self) -> None:
        if not self._running:
            return
        try:
            finished = self._call("run", self.step_seconds)
        except Exception as exc:
            self._recover(list(self._running.values()), exc)
            return
        for request_id, result in finished:
            self._adapters.pop(request_id, None)
            self._running.pop(request_id).set_result(result)

    def _recover(self, futures: list[Future], exc: Exception) -> None:
        """A failed ``add`` or step: its requests (and every running one) fail with it, the engine aborts them and
        goes on; an engine that cannot abort them is gone (the loop ends)."""
        log.error("%s: a generation step failed, %d requests with it:\n%s", self.label,
                  len(set(futures) | set(self._running.values())), traceback.format_exc())
        error = RuntimeError(f"{self.label} failed: {exc}")
        for future in set(futures) | set(self._running.values()):
            if not future.done():
                future.set_exception(error)
        self._running.clear()
        self._adapters.clear()
        self._call("abort")  # raises when the engine is gone: the loop's end

    def _call(self, method: str, *args):
        return self.engine.result(self.engine.submit(method, *args))

    def __getattr__(self, name: str):  # the engine's other attributes (its model, its placement)
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)
