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
FLOAT32, INT64 = 1, 2  # tinker_public_pb2.DType


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
    prompt_logprobs_last_n: int | None = None
    target_prompt_logprobs: PromptTargets | None = None
    prompt_alt_tokens_k: int = 0
    arrived: float = field(default_factory=time.time)

    def engine_request(self) -> dict:
        targets = self.target_prompt_logprobs
        return {"id": self.request_id, "prompt": self.prompt, "n": self.num_samples, "params": self.params,
                "adapter": self.adapter, "prompt_logprobs": self.prompt_logprobs, "topk_prompt": self.topk_prompt_logprobs,
                "topk_sample": self.topk_sample_logprobs, "prompt_last_n": self.prompt_logprobs_last_n,
                "target_cells": None if targets is None else targets.cells(), "alt_k": self.prompt_alt_tokens_k}


@dataclass(frozen=True)
class PromptTargets:
    """A request's ``target_prompt_logprobs``, token ids ``[len(prompt) - 1, K]`` (-1: no id) in the layout it came
    in: ``values`` flattened row-major (dense; ``crow``/``col`` None), or the listed cells of a sparse CSR tensor."""

    shape: tuple[int, int]
    values: np.ndarray  # int64
    rows: np.ndarray  # the row of each value
    crow: np.ndarray | None = None
    col: np.ndarray | None = None

    def cells(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows and token ids of the cells that name an id (row ``i`` is prompt position ``i + 1``)."""
        named = self.values >= 0
        return self.rows[named], self.values[named]

    def most_distinct_in_a_row(self) -> int:
        """The most distinct token ids one row names."""
        rows, ids = self.cells()
        pairs = np.unique(np.stack([rows, ids], axis=1), axis=0)
        return int(np.bincount(pairs[:, 0]).max())

    def fill(self, msg, logprobs: np.ndarray) -> None:
        """Write the response tensor (``SampleResponse.target_prompt_logprobs``) into the protobuf ``Tensor``
        ``msg``: float32 in this tensor's shape and layout, ``logprobs`` (those of :meth:`cells`) in the cells that
        name an id, 0.0 in the others."""
        out = np.zeros(len(self.values), dtype=np.float32)
        out[self.values >= 0] = logprobs
        msg.dtype = FLOAT32
        msg.shape.extend(self.shape)
        if self.crow is None:
            msg.dense = out.tobytes()
        else:
            msg.sparse_csr.values = out.tobytes()
            msg.sparse_csr.crow_indices = self.crow.tobytes()
            msg.sparse_csr.col_indices = self.col.tobytes()


def prompt_targets(tensor, prompt_len: int, vocab_size: int) -> PromptTargets:
    """The ``target_prompt_logprobs`` of a request (a ``TensorData`` as JSON) for a prompt of ``prompt_len`` tokens,
    or ValueError naming what is wrong: an int64 tensor ``[prompt_len - 1, K]``, dense or sparse CSR (column
    indices increasing within each row), of token ids or -1, naming at least one id."""
    name = "target_prompt_logprobs"
    if not isinstance(tensor, dict) or not isinstance(tensor.get("data"), list):
        raise ValueError(f"{name} must be a TensorData (data, dtype, shape), got {type(tensor).__name__}")
    if tensor.get("dtype") != "int64":
        raise ValueError(f"{name} must be an int64 tensor of token ids, got dtype {tensor.get('dtype')!r}")
    shape = tensor.get("shape")
    rows = prompt_len - 1
    if not (isinstance(shape, list) and len(shape) == 2 and shape[0] == rows and isinstance(shape[1], int)
            and shape[1] >= 1):
        raise ValueError(f"{name} has shape {shape}: give [len(prompt) - 1, K] = [{rows}, K] with K >= 1 (row i "
                         "scores prompt position i + 1)")
    values = np.asarray(tensor["data"])
    if values.size and values.dtype.kind != "i":
        raise ValueError(f"{name} must hold integer token ids (or -1), got {values.dtype} values")
    values = values.astype(np.int64)
    crow, col = tensor.get("sparse_crow_indices"), tensor.get("sparse_col_indices")
    if crow is None and col is None:
        if len(values) != rows * shape[1]:
            raise ValueError(f"{name} has {len(values)} values for shape {shape}")
        targets = PromptTargets((rows, shape[1]), values, np.repeat(np.arange(rows), shape[1]))
    else:
        targets = _sparse_targets(shape, values, crow, col)
    bad = np.unique(values[(values < -1) | (values >= vocab_size)])
    if bad.size:
        raise ValueError(f"{name} token ids {bad[:5].tolist()} are outside the vocabulary [0, {vocab_size}) (-1 "
                         "names none)")
    if not (values >= 0).any():
        raise ValueError(f"{name} names no token id (every cell is -1): name at least one, or leave it out")
    return targets


def _sparse_targets(shape: list[int], values: np.ndarray, crow, col) -> PromptTargets:
    """A sparse CSR ``target_prompt_logprobs`` (see :func:`prompt_targets`)."""
    if crow is None or col is None:
        raise ValueError("target_prompt_logprobs: a sparse CSR tensor needs both sparse_crow_indices and "
                         "sparse_col_indices")
    crow, col = np.asarray(crow, dtype=np.int64), np.asarray(col, dtype=np.int64)
    rows, width = shape
    if len(crow) != rows + 1 or crow[0] != 0 or crow[-1] != len(values) or (np.diff(crow) < 0).any():
        raise ValueError(f"target_prompt_logprobs: sparse_crow_indices must be {rows + 1} non-decreasing offsets "
                         f"from 0 to the {len(values)} values, got {crow.tolist()[:8]}")
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    increasing = np.diff(col) > 0
    if len(col) != len(values) or ((col < 0) | (col >= width)).any() or not (
            increasing | (row_of[1:] != row_of[:-1])).all():
        raise ValueError(f"target_prompt_logprobs: sparse_col_indices must be {len(values)} column indices in "
                         f"[0, {width}), increasing within each row")
    return PromptTargets((rows, width), values, row_of, crow, col)


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


def encode_sample_response(result: dict, targets: PromptTargets | None = None) -> bytes:
    """The SDK's protobuf ``SampleResponse`` of one request's result (:func:`mlora.rollout.vllm_engine.request_result`);
    ``targets``: the request's ``target_prompt_logprobs``, the layout its answer takes."""
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
    if targets is not None:
        targets.fill(out.target_prompt_logprobs, result["target"])
    if result["alt_tokens"] is not None:
        tokens, logprobs = result["alt_tokens"]
        _fill_dense(out.prompt_alt_tokens.tokens, np.asarray(tokens, dtype=np.int64), INT64)
        _fill_dense(out.prompt_alt_tokens.logprobs, np.asarray(logprobs, dtype=np.float32), FLOAT32)
    return out.SerializeToString()


def _fill_dense(msg, array: np.ndarray, dtype: int) -> None:
    msg.dtype = dtype
    msg.shape.extend(array.shape)
    msg.dense = array.tobytes()


def _fill_topk(msg, ids: list[list[int]], logprobs: list[list[float]]) -> None:
    msg.length = len(ids)
    msg.k = len(ids[0]) if ids else 0
    msg.token_ids = np.asarray(ids, dtype=np.int32).tobytes()
    msg.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()


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
        ``gpu_memory_utilization``: the engine's memory (:func:`mlora.service.sizing.engine_sizing`; None: vLLM's rule)."""
        self.finish = finish
        self.max_lora_rank, self.max_model_len = max_lora_rank, max_model_len
        # max_logprobs=-1: a request may read the whole vocabulary's prompt log-probs (target_prompt_logprobs,
        # prompt_alt_tokens_k; the service bounds the top-k widths itself). vLLM only checks requests against it:
        # the engine's memory is the same (measured on SmolLM2: 1611 MB, 1609 MB with vLLM's default of 20)
        extra = {"max_logprobs": -1}
        if kv_cache_memory_bytes is not None:
            extra["kv_cache_memory_bytes"] = kv_cache_memory_bytes
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
        future.add_done_callback(lambda f, job=job: self._answer(job, f))

    def wait(self, request_id: str, timeout: float) -> bool:
        with self._lock:
            event = self._events.get(request_id)
        return True if event is None else event.wait(timeout)

    def stop(self) -> None:
        self.engine.close()

    def _answer(self, job: SampleJob, future) -> None:
        request_id, exc = job.request_id, future.exception()
        if exc is None:
            self._done(request_id, "done", "application/x-protobuf",
                       encode_sample_response(future.result(), job.target_prompt_logprobs))
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
