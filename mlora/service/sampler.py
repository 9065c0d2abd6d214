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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mlora.rollout.continuous import STEP_SECONDS, ContinuousEngine, Refused
from mlora.rollout.vllm_engine import LocalVLLMEngine
from mlora.service.scheduler import error_payload

STOP, LENGTH = 0, 1  # tinker_public_pb2.StopReason


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


def encode_sample_response(result: dict) -> bytes:
    """The SDK's protobuf ``SampleResponse`` of one request's result (:func:`mlora.rollout.vllm_engine.request_result`)."""
    from mlora.service.wire import _pb

    pb = _pb()
    out = pb.SampleResponse()
    for s in result["sequences"]:
        seq = out.sequences.add()
        seq.stop_reason = LENGTH if s["finish_reason"] == "length" else STOP
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


def engine_sizing(model_dir: str | Path, dtype: str, mesh, max_lora_rank: int, max_loras: int,
                  max_model_len: int | None, kv_cache_bytes: int | None):
    """The sampling engine's memory (:func:`mlora.plan.engines.size_service_engine`), measured on this rank's device
    before the trainer loads: on the CPU build the host holds every rank's base shard (all of a DP replica's, each
    replica's copy), on CUDA rank 0's GPU holds its shard beside the engine."""
    import torch

    from mlora.formats.hf_config import load_hf_config, model_spec
    from mlora.plan.engines import device_memory, size_service_engine, vllm_torch_dtype
    from mlora.plan.weights import base_bytes
    from mlora.rollout.model_len import read_context_limit
    from mlora.rollout.vllm_engine import _sees_cuda

    cuda = _sees_cuda() and torch.cuda.is_available()
    spec = model_spec(load_hf_config(Path(model_dir)))
    torch_dtype = vllm_torch_dtype(dtype)
    if cuda:
        trainer = base_bytes(spec, mesh.tp, mesh.pp, 0, 0, torch_dtype)
    else:
        trainer = mesh.dp * sum(base_bytes(spec, mesh.tp, mesh.pp, stage, rank, torch_dtype)
                                for stage in range(mesh.pp) for rank in range(mesh.tp))
    context = max_model_len or read_context_limit(model_dir)
    if context is None:
        raise ValueError(f"{model_dir} has no config.json context length: give the engine's --max-model-len")
    return size_service_engine(spec, device_memory(cuda), dtype=torch_dtype, trainer_base=trainer,
                               lora_rank=max_lora_rank, max_loras=max_loras, max_model_len=int(context),
                               kv_cache_memory_bytes=kv_cache_bytes)


class Sampler:
    """One vLLM engine, continuously batched through :class:`mlora.rollout.continuous.ContinuousEngine` (the trainer's
    asynchronous generation takes the same path): ``asample`` requests join the engine's running batch as they arrive
    (whatever adapters they name), and each is answered as soon as it has finished."""

    def __init__(self, model_dir: str | Path, finish: Callable[[str, str, str, bytes], None] | None = None, *,
                 dtype: str,
                 max_lora_rank: int, max_loras: int, kv_cache_memory_bytes: int | None, max_model_len: int | None,
                 batch_window: float = 0.01, seed: int = 0, gpu_memory_utilization: float | None = None) -> None:
        """``finish(request_id, state, content_type, payload)`` records a request's outcome (the service sets it
        to its store's). The engine starts now, in the background; requests wait for it. ``kv_cache_memory_bytes``,
        ``gpu_memory_utilization``: the engine's memory (:func:`engine_sizing`; None: vLLM's rule)."""
        self.finish = finish
        self.max_lora_rank, self.max_model_len = max_lora_rank, max_model_len
        extra = {} if kv_cache_memory_bytes is None else {"kv_cache_memory_bytes": kv_cache_memory_bytes}
        if gpu_memory_utilization is not None:
            extra["gpu_memory_utilization"] = gpu_memory_utilization
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
        self.engine = ContinuousEngine(
            LocalVLLMEngine(model_dir, max_lora_rank=max_lora_rank, dtype=dtype, seed=seed, max_loras=max_loras,
                            max_model_len=max_model_len, wait=False, **extra),
            "the sampling engine", STEP_SECONDS, batch_window, starting=True, log_batches=True)
        self._ids: dict[str, int] = {}  # adapter directory (and version) -> its LoRARequest id
        self._next_id = itertools.count(1)
        self._lock = threading.Lock()
        self._events: dict[str, threading.Event] = {}

    @property
    def state(self) -> str:
        """"starting", "ready", or "failed" (the engine did not start, or died)."""
        return self.engine.state

    def adapter(self, directory: str | Path, version: str) -> tuple[str, int, str]:
        """The ``LoRARequest`` arguments of the adapter in ``directory`` at ``version`` (a new id when it changed)."""
        key = f"{directory}#{version}"
        with self._lock:
            if key not in self._ids:
                self._ids[key] = next(self._next_id)
            lora_id = self._ids[key]
        return f"a{lora_id}", lora_id, str(directory)

    def submit(self, job: SampleJob) -> None:
        with self._lock:
            self._events[job.request_id] = threading.Event()
        try:
            (future,) = self.engine.generate([job.engine_request()])
        except RuntimeError as e:  # the engine did not start, or is gone
            self._done(job.request_id, "error", *error_payload(f"the server's sampling engine is not running: {e}",
                                                                 "server"))
            return
        future.add_done_callback(lambda f, request_id=job.request_id: self._answer(request_id, f))

    def wait(self, request_id: str, timeout: float) -> bool:
        with self._lock:
            event = self._events.get(request_id)
        return True if event is None else event.wait(timeout)

    def stop(self) -> None:
        self.engine.close()

    def _answer(self, request_id: str, future) -> None:
        exc = future.exception()
        if exc is None:
            self._done(request_id, "done", "application/x-protobuf", encode_sample_response(future.result()))
        elif isinstance(exc, Refused):
            self._done(request_id, "error", *error_payload(f"sampling refused: {exc}", "user"))
        else:
            self._done(request_id, "error", *error_payload(f"sampling failed: {exc}", "server"))

    def _done(self, request_id: str, state: str, content_type: str, payload: bytes) -> None:
        self.finish(request_id, state, content_type, payload)
        with self._lock:
            event = self._events.pop(request_id, None)
        if event is not None:
            event.set()
