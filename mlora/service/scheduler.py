"""The service's one worker: runs client requests on the model in order, many clients' ``forward_backward``
at once.

Each client model's requests carry a ``seq_id`` (1, 2, ...): the SDK sends them pipelined, and a large batch's
chunks concurrently with the first one last, so a model's requests run strictly in ``seq_id`` order, whatever
their arrival. Requests that create or free models run in arrival order. When several models' next requests
are ``forward_backward`` calls (ready ones wait up to ``batch_window`` seconds for the others, and for one turn
behind other models' optim_step and the like, which brings those models' next forward_backward), they run together
as one mixed-adapter batch
(:meth:`mlora.service.tenants.Tenants.forward_backward`); a batch that fails is retried request by request, so
one client's bad request fails that client's future only.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from mlora.service.store import Store

log = logging.getLogger("mlora.service")
GAP_TIMEOUT = 60.0  # seconds a model's later requests wait for a missing seq_id before it is skipped


@dataclass
class Job:
    """One request's work: ``run()`` returns ``(content_type, payload)`` or raises."""

    request_id: str
    run: Callable[[], tuple[str, bytes]] | None = None
    model_id: str | None = None
    seq_id: int | None = None
    fb: object = None  # a ForwardBackward request: batched with other models' instead of run alone
    deferred: bool = False  # a forward_backward already passed over once for other models' requests
    arrived: float = field(default_factory=time.time)


def error_payload(message: str, category: str) -> tuple[str, bytes]:
    """The SDK's failed-future body (``tinker.RequestFailedError``; category ``user`` or ``server``)."""
    return "application/json", json.dumps({"error": message, "category": category}).encode()


class Scheduler:
    """Queues jobs and runs them on one thread (torch and the mesh's collectives stay on it)."""

    def __init__(self, store: Store, run_fb_batch: Callable[[list[Job]], list[tuple[str, bytes]]],
                 batch_window: float = 0.01) -> None:
        self.store = store
        self.run_fb_batch = run_fb_batch
        self.batch_window = batch_window  # seconds a ready forward_backward waits for other clients' to join it
        self._cond = threading.Condition()
        self._global: list[Job] = []  # model creation and removal, in arrival order
        self._pending: dict[str, dict[int, Job]] = {}  # model -> seq_id -> job
        self._next: dict[str, int] = {}  # model -> the seq_id it runs next
        self._freed: set[str] = set()  # models forgotten: their later requests fail at once
        self._late: list[Job] = []  # requests whose seq_id the model went on without (after GAP_TIMEOUT)
        self._done: dict[str, threading.Event] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="mlora-service-worker", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ submission
    def submit(self, job: Job) -> None:
        with self._cond:
            self._done.setdefault(job.request_id, threading.Event())
            freed = job.model_id in self._freed
            if not freed and (job.model_id is None or job.seq_id is None):
                self._global.append(job)
            elif not freed:
                self._pending.setdefault(job.model_id, {})[job.seq_id] = job
            self._cond.notify_all()
        if freed:  # accepted while its model was being freed: it would wait for ever
            self._fail_freed(job)

    def start_model(self, model_id: str, next_seq: int = 1) -> None:
        """``model_id``'s first request to run is ``next_seq`` (called when the model is created)."""
        with self._cond:
            self._next[model_id] = next_seq
            self._freed.discard(model_id)
            self._cond.notify_all()

    def forget_model(self, model_id: str) -> None:
        """Stop scheduling ``model_id``: its queued requests fail now, and so do later ones."""
        with self._cond:
            self._next.pop(model_id, None)
            self._freed.add(model_id)
            queued = list(self._pending.pop(model_id, {}).values())
        for job in queued:
            self._fail_freed(job)

    def _fail_freed(self, job: Job) -> None:
        self._finish(job, (*error_payload(f"model {job.model_id!r} was freed (its session ended or it was unloaded) "
                                          "before this request could run", "user"), "error"))

    def wait(self, request_id: str, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``request_id`` to finish; True when it has (or is not queued here)."""
        with self._cond:
            event = self._done.get(request_id)
        return True if event is None else event.wait(timeout)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the worker
    def _ready(self) -> tuple[list[Job], list[Job]]:
        """(global jobs, each model's next job) runnable now; called with the lock held."""
        glob, self._global = self._global, []
        ready = []
        now = time.time()
        for model_id, jobs in self._pending.items():
            if not jobs or model_id not in self._next:
                continue
            want = self._next[model_id]
            for seq_id in [q for q in jobs if q < want]:  # arrived after the model went on without it
                self._late.append(jobs.pop(seq_id))
            if not jobs:
                continue
            if want in jobs:
                ready.append(jobs[want])
            elif min(jobs) > want and now - min(j.arrived for j in jobs.values()) > GAP_TIMEOUT:
                log.warning("model %s: seq_id %d never arrived; going on with %d", model_id, want, min(jobs))
                ready.append(jobs[min(jobs)])
        return glob, ready

    def _loop(self) -> None:
        while True:
            with self._cond:
                glob, ready = self._ready()
                while not glob and not ready and not self._late and not self._stop:
                    self._cond.wait(timeout=1.0)
                    glob, ready = self._ready()
                if self._stop:
                    return
                fbs = [j for j in ready if j.fb is not None]
                if len(fbs) < len(ready) and not any(j.deferred for j in fbs):
                    # the other requests first, once: a model whose optim_step runs now has its next forward_backward
                    # ready for the batch, where running the two kinds side by side would keep clients out of phase
                    for job in fbs:
                        job.deferred = True
                    ready = [j for j in ready if j.fb is None]
                elif fbs and self.batch_window > 0:
                    more, ready = self._wait_for_batch()
                    glob += more
                for job in ready:
                    del self._pending[job.model_id][job.seq_id]
                    self._next[job.model_id] = job.seq_id + 1
                late, self._late = self._late, []
            for job in late:
                self._finish(job, (*error_payload(
                    f"seq_id {job.seq_id} of model {job.model_id!r} arrived after the server had waited "
                    f"{GAP_TIMEOUT:.0f} s for it and gone on with the model's later requests", "user"), "error"))
            for job in glob:
                self._finish(job, self._call(job.run))
            singles = [j for j in ready if j.fb is None]
            for kind in (False, True):  # training batches, then forward-only ones
                batch = [j for j in ready if j.fb is not None and j.fb.forward_only == kind]
                if batch:
                    self._run_batch(batch)
            for job in singles:
                self._finish(job, self._call(job.run))

    def _wait_for_batch(self) -> tuple[list[Job], list[Job]]:
        """Up to ``batch_window`` seconds for other models' forward_backward to join the ready ones (the whole window:
        a request of a model already in the batch wakes the wait without ending it); then :meth:`_ready`'s jobs, the
        requests that are not forward_backward left for the next turn. Called with the lock held."""
        deadline, glob = time.time() + self.batch_window, []
        while (left := deadline - time.time()) > 0:
            self._cond.wait(left)
            more, ready = self._ready()
            glob += more
            if len(ready) == len(self._next):  # every model has its forward_backward here: nobody else to wait for
                break
        more, ready = self._ready()
        return glob + more, [j for j in ready if j.fb is not None]

    def _run_batch(self, batch: list[Job]) -> None:
        if len(batch) == 1:  # its failure is its own: reported, not run again
            self._finish(batch[0], self._call(lambda: self.run_fb_batch(batch)[0]))
            return
        try:
            results = self.run_fb_batch(batch)
        except Exception:
            log.warning("a batch of %d forward_backward requests failed; running them one by one", len(batch))
            for job in batch:
                self._finish(job, self._call(lambda job=job: self.run_fb_batch([job])[0]))
            return
        for job, result in zip(batch, results):
            self._finish(job, result)

    @staticmethod
    def _call(run: Callable[[], tuple[str, bytes]]) -> tuple[str, bytes] | tuple[str, bytes, str]:
        try:
            return run()
        except (ValueError, KeyError, FileNotFoundError) as e:
            message = f"model {e.args[0]!r} is not loaded on this server" if isinstance(e, KeyError) else str(e)
            return (*error_payload(message, "user"), "error")
        except Exception as e:  # a fault of the server, not of the request: said in the log with its traceback
            log.error("request failed:\n%s", traceback.format_exc())
            return (*error_payload(f"{type(e).__name__}: {e}", "server"), "error")

    def _finish(self, job: Job, result) -> None:
        content_type, payload = result[0], result[1]
        self.store.finish_future(job.request_id, result[2] if len(result) > 2 else "done", content_type, payload)
        with self._cond:
            event = self._done.pop(job.request_id, None)
        if event is not None:
            event.set()
