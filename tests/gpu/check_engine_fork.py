"""GPU check of fault 3: the TP workers a local vLLM engine starts can initialise CUDA. Writes $OUT/engine_fork.json.

vLLM starts its workers with ``VLLM_WORKER_MULTIPROC_METHOD``, ``fork`` by default (vllm/envs.py), and switches
to ``spawn`` only when torch's CUDA is *initialised* in the engine process (``_maybe_force_spawn`` in
vllm/utils/system_utils.py). mlora's engine process called ``torch.cuda.is_available()`` before vLLM started: that
initialises the CUDA driver (``cudaGetDeviceCount``) but not torch's CUDA, so vLLM forked and the workers failed at
CUDA init. This reproduces it without vLLM (the lent GPU machine has none): process A starts with an environment,
calls ``torch.cuda.is_available()``, then starts a worker the way vLLM would under that environment; the worker
initialises CUDA and multiplies two matrices on the GPU.

Cases (one check each): ``fixed``, A started with what :func:`mlora.rollout.vllm_engine.engine_process_env` gives a
CUDA TP2 engine: PASS when the worker succeeds; ``before``, without those variables (expected: the forked worker
fails at CUDA init), and each variable alone (``nvml_check_only``, ``spawn_only``): figures, no verdict. Without
CUDA it records a skip ("no CUDA") and exits 0.

    OUT=$OUT python tests/gpu/check_engine_fork.py     # needs mlora importable (run_all.sh installs it)
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # report.py
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # mlora, when not installed

from report import Report  # noqa: E402

METHOD, NVML_CHECK = "VLLM_WORKER_MULTIPROC_METHOD", "PYTORCH_NVML_BASED_CUDA_CHECK"
CASE_TIMEOUT_S = 240


def worker(queue) -> None:
    """A vLLM TP worker's first steps on its GPU: initialise CUDA, compute."""
    try:
        import torch

        torch.cuda.init()
        x = torch.randn(256, 256, device="cuda")
        value = float((x @ x).abs().sum().item())
        queue.put({"worker_ok": True, "value": value})
    except BaseException as exc:  # reported to process A, which reports it
        queue.put({"worker_ok": False, "error": f"{type(exc).__name__}: {exc}"})


def engine_process() -> None:
    """Process A: what mlora's engine process did before vLLM started, then vLLM's choice of start method
    (vllm/utils/system_utils.py get_mp_context), then one worker. Prints its result as JSON on its last line."""
    import torch

    available = torch.cuda.is_available()  # mlora's _cpu_thread_binding did this before LLM(...)
    method = os.environ.get(METHOD, "fork")  # vllm/envs.py: the default is fork
    if torch.cuda.is_initialized():  # _maybe_force_spawn: vLLM spawns when torch's CUDA is initialised
        method = "spawn"
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    proc = ctx.Process(target=worker, args=(queue,))
    proc.start()
    try:
        result = queue.get(timeout=CASE_TIMEOUT_S / 2)
    except Exception:
        result = {"worker_ok": False, "error": f"no reply from the worker (exit code {proc.exitcode})"}
    proc.join(30)
    result.update(method=method, available=available)
    print(json.dumps(result), flush=True)


def run_case(updates: dict[str, str]) -> dict:
    """Process A started with this environment, less the two variables, plus ``updates``; its result."""
    env = {k: v for k, v in os.environ.items() if k not in (METHOD, NVML_CHECK)}
    env.update(updates)
    done = subprocess.run([sys.executable, __file__, "--engine-process"], env=env, capture_output=True, text=True,
                          timeout=CASE_TIMEOUT_S)
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise RuntimeError(f"process A exited with {done.returncode}: {done.stderr[-2000:]}") from None


def main() -> int:
    report = Report("engine_fork")
    import torch

    # this process starts the cases with subprocess (exec), so asking here poisons nothing they do
    if not torch.cuda.is_available():
        for check in ("fixed", "before"):
            report.skip(check, "no CUDA")
        return 0
    try:
        from mlora.rollout.vllm_engine import engine_process_env

        fixed = engine_process_env(True, 2, {})
    except Exception as exc:
        report.error("fixed", exc)
        return 1
    cases = {"fixed": fixed, "before": {}, "nvml_check_only": {NVML_CHECK: "1"}, "spawn_only": {METHOD: "spawn"}}
    for name, updates in cases.items():
        try:
            result = run_case(updates)
        except Exception as exc:
            report.error(name, exc)
            continue
        figure = {"worker_ok": int(result["worker_ok"]), "start_method": result["method"],
                  "env": " ".join(f"{k}={v}" for k, v in updates.items()) or "-"}
        note = result.get("error", "")
        if name == "fixed":
            report.record(name, figure, bool(result["worker_ok"]), note)
        else:
            expected = " (expected: the forked worker fails at CUDA init)" if name == "before" else ""
            report.record(name, figure, None, (note + expected).strip())
    return 1 if report.failed else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--engine-process"]:
        engine_process()
    else:
        sys.exit(main())
