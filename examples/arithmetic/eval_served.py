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
import sys
import time
from pathlib import Path

from mlora.rollout.data import load_prompts
from mlora.rollout.envs import response_reward
from mlora.rollout.openai_server import OpenAIServer, free_port
from mlora.rollout.serve import largest_adapter_rank, serve_command
from mlora.train.metrics_log import read_metrics

ADAPTER = "policy"


def served_accuracy(server: OpenAIServer, rows: list[dict], env_class: str, max_tokens: int
                    ) -> tuple[float, list[dict]]:
    """Share of ``rows`` answered right by adapter ``policy`` through the chat API, greedy."""
    right, answers = 0, []
    for row in rows:
        messages = row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
        text = server.chat(ADAPTER, messages, max_tokens)
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
    port = free_port()
    argv_ = serve_command(args.model, {ADAPTER: adapter}, max_lora_rank=largest_adapter_rank([adapter]),
                          dtype=args.dtype, host="127.0.0.1", port=port,
                          kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_model_len=args.max_model_len)
    log = args.run_dir / "vllm_server.log"
    print("starting:", " ".join(argv_), flush=True)
    with OpenAIServer(argv_, port, log) as server:
        t0 = time.perf_counter()
        acc, answers = served_accuracy(server, rows, rows[0].get("env_class") or "gsm8k", args.max_tokens)
        seconds = time.perf_counter() - t0
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
