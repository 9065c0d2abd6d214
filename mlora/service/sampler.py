"""Tinker's sampling on a vLLM engine: every client's sampler weights served as a LoRA adapter of one engine, the
``asample`` requests batched continuously (each joins the engine's running batch at its next step, whatever adapter
it names, and is answered when it finishes).

A sampler checkpoint (``save_weights_for_sampler``) is a PEFT adapter directory; each directory (each version of
a name that was overwritten) gets a ``LoRARequest`` id of its own, so vLLM loads it on first use, keeps the
``max_loras`` most recently used in its cache, and never serves KV blocks computed under other weights. The
engine runs in a child process (:class:`mlora.rollout.vllm_engine.LocalVLLMEngine`), started in the background
when the server starts; requests wait for it.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mlora.rollout.vllm_engine import LocalVLLMEngine, VLLMServer
from mlora.service.scheduler import error_payload

log = logging.getLogger("mlora.service")
STOP, LENGTH = 0, 1  # tinker_public_pb2.StopReason
STEP_SECONDS = 0.05  # the longest the engine steps before new requests may join (it returns earlier when one finishes)
MASK_LOGPROB = -99999.0  # the SDK's sentinel of a top-k cell (token 0) or row not computed (tinker.types.topk_logprobs)


@dataclass
class SampleJob:
    """One ``asample`` request: ``adapter`` is ``(name, lora_id, directory)`` or None (the base model)."""

    request_id: str
    prompt: list[int]
    num_samples: int
    params: dict
    adapter: tuple[str, int, str] | None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    arrived: float = field(default_factory=time.time)

    def engine_request(self) -> dict:
        return {"id": self.request_id, "prompt": self.prompt, "n": self.num_samples, "params": self.params,
                "adapter": self.adapter, "prompt_logprobs": self.prompt_logprobs, "topk_prompt": self.topk_prompt_logprobs,
                "topk_sample": self.topk_sample_logprobs}


def sampling_params(params: dict, vocab_size: int) -> dict:
    """The engine's arguments of a Tinker ``SamplingParams`` (JSON), or ValueError naming the bad field.

    ``stop``: None stops at the model's EOS; a string or list of strings are stop strings; a list of ints are
    stop token ids; ``[]`` disables every stop, EOS included (generation runs to ``max_tokens``)."""
    out = {"temperature": float(params.get("temperature", 1.0)), "top_k": int(params.get("top_k", -1)),
           "top_p": float(params.get("top_p", 1.0)), "seed": params.get("seed"), "stop": [], "stop_token_ids": [],
           "ignore_eos": False}
    max_tokens = params.get("max_tokens")
    if max_tokens is None or int(max_tokens) < 1:
        raise ValueError(f"sampling_params.max_tokens={max_tokens!r}: give the number of tokens to sample (>= 1)")
    out["max_tokens"] = int(max_tokens)
    if not out["temperature"] >= 0:
        raise ValueError(f"sampling_params.temperature={out['temperature']} must be >= 0 (0 = greedy)")
    if not 0.0 < out["top_p"] <= 1.0:
        raise ValueError(f"sampling_params.top_p={out['top_p']} must be in (0, 1]")
    if out["top_k"] == 0 or out["top_k"] < -1:
        raise ValueError(f"sampling_params.top_k={out['top_k']} must be >= 1, or -1 for no limit")
    stop = params.get("stop")
    if isinstance(stop, str):
        out["stop"] = [stop]
    elif isinstance(stop, list):
        if not stop:
            out["ignore_eos"] = True
        elif all(isinstance(s, str) for s in stop):
            out["stop"] = list(stop)
        elif all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
            bad = [s for s in stop if not 0 <= s < vocab_size]
            if bad:
                raise ValueError(f"sampling_params.stop token ids {bad} are outside the vocabulary [0, {vocab_size})")
            out["stop_token_ids"] = list(stop)
        else:
            raise ValueError(f"sampling_params.stop={stop!r}: give strings or token ids, not a mix")
    elif stop is not None:
        raise ValueError(f"sampling_params.stop={stop!r}: give a string, a list of strings or a list of token ids")
    if out["seed"] is not None:
        out["seed"] = int(out["seed"])
    return out


class TinkerEngineServer(VLLMServer):
    """The engine process's side, continuously batched: :meth:`add` puts requests into the running engine between
    two of its steps, :meth:`run` steps it until some finish. A request that arrives while others decode joins
    them at the next step instead of waiting for the whole batch to end."""

    def __init__(self, model: str, kwargs: dict, cpu_cores: list[int] | None = None) -> None:
        super().__init__(model, kwargs, cpu_cores)
        self._running: dict[str, dict] = {}  # request id -> its Tinker request, until it finishes

    def add(self, requests: list[dict]) -> list[str | None]:
        """Add each request (``id``: its Tinker request id) to the engine; per request None, or why vLLM refused it
        (then it is not running)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind

        refused = []
        for r in requests:
            p = r["params"]
            ask_prompt = r["prompt_logprobs"] or r["topk_prompt"] > 0
            try:
                params = SamplingParams(
                    n=r["n"], temperature=p["temperature"], top_k=p["top_k"], top_p=p["top_p"],
                    max_tokens=p["max_tokens"], seed=p["seed"], stop=p["stop"] or None,
                    stop_token_ids=p["stop_token_ids"] or None, ignore_eos=p["ignore_eos"],
                    include_stop_str_in_output=True, logprobs=r["topk_sample"],
                    prompt_logprobs=r["topk_prompt"] if ask_prompt else None,
                    output_kind=RequestOutputKind.FINAL_ONLY)  # one output per request, when it has finished
                self.llm.llm_engine.add_request(r["id"], TokensPrompt(prompt_token_ids=r["prompt"]), params,
                                                lora_request=None if r["adapter"] is None else LoRARequest(*r["adapter"]))
            except (ValueError, TypeError) as e:
                refused.append(f"{type(e).__name__}: {e}")
            else:
                self._running[r["id"]] = r
                refused.append(None)
        return refused

    def run(self, seconds: float) -> list[tuple[str, dict]]:
        """Step the engine until a request finishes or ``seconds`` have passed; the finished requests' results
        (sequences with tokens, log-probs, stop reason, top-k ids and log-probs or None; ``prompt_logprobs``, NaN at
        position 0, and ``topk_prompt`` when asked)."""
        engine = self.llm.llm_engine
        deadline = time.monotonic() + seconds
        done = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done.append((out.request_id, _result(self._running.pop(out.request_id), out)))
            if done or time.monotonic() >= deadline:
                break
        return done

    def abort(self) -> list[str]:
        """Stop every running request (after a failed step); their ids."""
        ids = list(self._running)
        self.llm.llm_engine.abort_request(ids)
        self._running.clear()
        return ids


def _topk(steps, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The ``k`` most likely tokens of each step (vLLM's logprob dicts, by rank; the chosen token, which vLLM adds
    when it is not among them, left out), as ids and log-probs."""
    ids, lps = [], []
    for step in steps:
        ranked = sorted(((lp.rank, t, lp.logprob) for t, lp in step.items()
                         if lp.rank is not None and lp.rank <= k), key=lambda x: x[0])[:k]
        ids.append([t for _, t, _ in ranked] + [0] * (k - len(ranked)))
        lps.append([v for _, _, v in ranked] + [MASK_LOGPROB] * (k - len(ranked)))
    return ids, lps


def _result(request: dict, out) -> dict:
    sequences = []
    for c in out.outputs:
        tokens = list(c.token_ids)
        logprobs = [step[t].logprob for step, t in zip(c.logprobs, tokens)]
        topk = _topk(c.logprobs, request["topk_sample"]) if request["topk_sample"] > 0 else None
        sequences.append({"tokens": tokens, "logprobs": logprobs, "topk": topk,
                          "stop_reason": LENGTH if c.finish_reason == "length" else STOP})
    result = {"sequences": sequences, "prompt_logprobs": None, "topk_prompt": None}
    if request["prompt_logprobs"] or request["topk_prompt"] > 0:
        steps = out.prompt_logprobs or []
        prompt = request["prompt"]
        if request["prompt_logprobs"]:
            result["prompt_logprobs"] = [math.nan] + [steps[i][prompt[i]].logprob for i in range(1, len(prompt))]
        if request["topk_prompt"] > 0:
            ids, lps = _topk(steps[1:], request["topk_prompt"])
            k = request["topk_prompt"]
            result["topk_prompt"] = ([[0] * k] + ids, [[MASK_LOGPROB] * k] + lps)
    return result


def encode_sample_response(result: dict) -> bytes:
    """The SDK's protobuf ``SampleResponse`` of one request's :meth:`TinkerEngineServer.sample` result."""
    from mlora.service.wire import _pb

    pb = _pb()
    out = pb.SampleResponse()
    for s in result["sequences"]:
        seq = out.sequences.add()
        seq.stop_reason = s["stop_reason"]
        seq.tokens = np.asarray(s["tokens"], dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s["logprobs"], dtype=np.float32).tobytes()
        if s["topk"] is not None:
            _fill_topk(seq.topk_sampled_logprobs, *s["topk"])
    if result["prompt_logprobs"] is not None:
        out.prompt_logprobs = np.asarray(result["prompt_logprobs"], dtype=np.float32).tobytes()
    if result["topk_prompt"] is not None:
        _fill_topk(out.topk_prompt_logprobs, *result["topk_prompt"])
    return out.SerializeToString()


def _fill_topk(msg, ids: list[list[int]], logprobs: list[list[float]]) -> None:
    msg.length = len(ids)
    msg.k = len(ids[0]) if ids else 0
    msg.token_ids = np.asarray(ids, dtype=np.int32).tobytes()
    msg.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()


class Sampler:
    """One vLLM engine and the thread that feeds it, continuously: ``asample`` requests join the engine's running
    batch as they arrive (whatever adapters they name), and each is answered as soon as it has finished."""

    def __init__(self, model_dir: str | Path, finish: Callable[[str, str, str, bytes], None] | None = None, *,
                 dtype: str,
                 max_lora_rank: int, max_loras: int, kv_cache_memory_bytes: int | None, max_model_len: int | None,
                 batch_window: float = 0.01, seed: int = 0) -> None:
        """``finish(request_id, state, content_type, payload)`` records a request's outcome (the service sets it
        to its store's). The engine starts now, in the background; requests wait for it."""
        self.finish, self.batch_window = finish, batch_window
        self.max_lora_rank, self.max_model_len = max_lora_rank, max_model_len
        extra = {} if kv_cache_memory_bytes is None else {"kv_cache_memory_bytes": kv_cache_memory_bytes}
        from mlora.rollout.vllm_engine import _sees_cuda

        if not _sees_cuda():
            # vLLM's CPU sampler cannot rewind a seeded generator ("CPU Generator does not use offset"), so a seeded
            # prompt must never be prefilled in chunks, which a prompt joining a running batch would be when the
            # step's token budget runs out: whole prompts only, and a step may hold one of the longest
            from mlora.rollout.model_len import read_context_limit

            longest = max_model_len or read_context_limit(model_dir)
            if longest is None:
                raise ValueError(f"{model_dir} has no config.json context length: give the engine's max_model_len")
            extra.update(enable_chunked_prefill=False, max_num_batched_tokens=int(longest))
        self.engine = LocalVLLMEngine(model_dir, max_lora_rank=max_lora_rank, dtype=dtype, seed=seed,
                                      max_loras=max_loras, max_model_len=max_model_len,
                                      server_factory=TinkerEngineServer, wait=False, **extra)
        self._ids: dict[str, int] = {}  # adapter directory (and version) -> its LoRARequest id
        self._next_id = itertools.count(1)
        self._cond = threading.Condition()
        self._queue: list[SampleJob] = []
        self._events: dict[str, threading.Event] = {}
        self._stop = False
        self.state = "starting"  # then "ready", or "failed" (the engine did not start)
        self._thread = threading.Thread(target=self._loop, name="mlora-service-sampler", daemon=True)
        self._thread.start()

    def adapter(self, directory: str | Path, version: str) -> tuple[str, int, str]:
        """The ``LoRARequest`` arguments of the adapter in ``directory`` at ``version`` (a new id when it changed)."""
        key = f"{directory}#{version}"
        with self._cond:
            if key not in self._ids:
                self._ids[key] = next(self._next_id)
            lora_id = self._ids[key]
        return f"a{lora_id}", lora_id, str(directory)

    def submit(self, job: SampleJob) -> None:
        with self._cond:
            self._events[job.request_id] = threading.Event()
            self._queue.append(job)
            self._cond.notify_all()

    def wait(self, request_id: str, timeout: float) -> bool:
        with self._cond:
            event = self._events.get(request_id)
        return True if event is None else event.wait(timeout)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        self.engine.close()

    def _loop(self) -> None:
        try:
            self.engine.wait_ready()
            log.info("the sampling engine is ready")
        except Exception as e:
            log.error("the sampling engine did not start: %s", e)
            failure = f"the server's sampling engine did not start: {e}"
            self.state = "failed"
        else:
            failure = None
            self.state = "ready"
        running: dict[str, SampleJob] = {}
        while True:
            with self._cond:
                while not self._queue and not running and not self._stop:
                    self._cond.wait(1.0)
                if self._stop:
                    return
                if self.batch_window > 0 and not running:
                    self._cond.wait(self.batch_window)  # an idle engine: the rest of a burst starts with its first
                new, self._queue = self._queue, []
            if failure is not None:
                for job in new:
                    self._done(job.request_id, "error", *error_payload(failure, "server"))
                continue
            try:
                if new:
                    refused = self._call("add", [j.engine_request() for j in new])
                    for job, why in zip(new, refused):
                        if why is None:
                            running[job.request_id] = job
                        else:
                            self._done(job.request_id, "error", *error_payload(f"sampling refused: {why}", "user"))
                    if len(running) > 1:
                        log.info("%d sampling requests running (%d adapters)", len(running),
                                 len({j.adapter for j in running.values()}))
                finished = self._call("run", STEP_SECONDS) if running else []
            except Exception as e:
                log.error("sampling failed, %d requests with it:\n%s", len(running), traceback.format_exc())
                for request_id in running:
                    self._done(request_id, "error", *error_payload(f"sampling failed: {e}", "server"))
                running.clear()
                try:
                    self._call("abort")
                except Exception:
                    log.error("the sampling engine did not stop its requests:\n%s", traceback.format_exc())
                continue
            for request_id, result in finished:
                running.pop(request_id, None)
                self._done(request_id, "done", "application/x-protobuf", encode_sample_response(result))

    def _call(self, method: str, *args):
        return self.engine.result(self.engine.submit(method, *args))

    def _done(self, request_id: str, state: str, content_type: str, payload: bytes) -> None:
        self.finish(request_id, state, content_type, payload)
        with self._cond:
            event = self._events.pop(request_id, None)
        if event is not None:
            event.set()
