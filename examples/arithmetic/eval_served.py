"""Serve a run's final adapter with vLLM's OpenAI server and measure held-out accuracy through it.

Starts the server the run printed (:func:`mlora.rollout.serve.serve_command`, same dtype, KV cache cap
and context as the run's engines), asks each held-out question through ``/v1/chat/completions``
(greedy, the run's eval length), scores the answers with the run's environment, and compares the
accuracy with the trainer's last evaluation in ``metrics.jsonl``. The server is stopped by its pid.

    python examples/arithmetic/eval_served.py --run-dir runs/mlora/smollm2_arithmetic \
        --model DIR --val runs/arithmetic_assets/val.parquet
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from mlora.rollout.data import load_prompts
from mlora.rollout.envs import response_reward
from mlora.rollout.serve import largest_adapter_rank, serve_command
from mlora.train.metrics_log import read_metrics

ADAPTER = "policy"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, limit_s: float = 600) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {proc.returncode} before it was ready; its log: {log}\n"
                               + log.read_text()[-3000:])
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"the vLLM server was not ready after {limit_s:.0f} s; its log: {log}")


def served_accuracy(url: str, rows: list[dict], env_class: str, max_tokens: int) -> tuple[float, list[dict]]:
    """Share of ``rows`` answered right by adapter ``policy`` through the chat API, greedy."""
    right, answers = 0, []
    for row in rows:
        messages = row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
        out = _post(f"{url}/v1/chat/completions", {"model": ADAPTER, "messages": messages, "temperature": 0.0,
                                                    "max_tokens": max_tokens})
        text = out["choices"][0]["message"]["content"]
        score = response_reward(row.get("env_class") or env_class, row, text, [])
        right += score
        answers.append({"question": messages[-1]["content"], "response": text, "reward": score})
    return right / len(rows), answers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True, type=Path, help="the run's trainer.run_dir")
    p.add_argument("--model", required=True, help="the base model directory the run trained on")
    p.add_argument("--val", required=True, type=Path, help="the held-out parquet the run evaluated on")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    p.add_argument("--max-model-len", type=int, default=160)
    args = p.parse_args(argv)

    adapter = args.run_dir / "final_adapter"
    if not (adapter / "adapter_model.safetensors").is_file():
        raise SystemExit(f"{adapter} holds no adapter: did the run finish?")
    rows = load_prompts(args.val)
    port = _free_port()
    argv_ = serve_command(args.model, {ADAPTER: adapter}, max_lora_rank=largest_adapter_rank([adapter]),
                          dtype=args.dtype, host="127.0.0.1", port=port,
                          kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_model_len=args.max_model_len)
    log = args.run_dir / "vllm_server.log"
    print("starting:", " ".join(argv_), flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(argv_, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc, log)
        t0 = time.perf_counter()
        acc, answers = served_accuracy(url, rows, rows[0].get("env_class") or "gsm8k", args.max_tokens)
        seconds = time.perf_counter() - t0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    (args.run_dir / "served_eval.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
    trainer = _last_eval(args.run_dir / "metrics.jsonl")
    print(f"served by vLLM's OpenAI server: held-out accuracy {acc:.3f} over {len(rows)} questions ({seconds:.0f} s)")
    if trainer is not None:
        step, value = trainer
        print(f"the run's own last evaluation (step {step}): {value:.3f}; difference {abs(acc - value) * 100:.1f} points")
    return 0


def _last_eval(metrics: Path) -> tuple[int, float] | None:
    if not metrics.is_file():
        return None
    rows = read_metrics(metrics)
    evals = [(r["step"], r["eval/all/pass_at_1"]) for r in rows if "eval/all/pass_at_1" in r]
    return evals[-1] if evals else None


if __name__ == "__main__":
    sys.exit(main())
