"""Fused attention (SDPA, the default) against the old unfused, masked path: peak memory and time
of one LoRA forward+backward at growing sequence lengths.

    .venv/bin/python bench/attention.py [--seqs 1024 2048 4096] [--reps 2] [--work runs/bench_attention]

Model: the tiny random Llama of the tests (hidden 128, 4 layers, 4 heads / 2 KV groups, head_dim 32),
float32, batch 1, a ``policy`` LoRA (r 8, all linears) so that there is a backward (base frozen).
Each (variant, sequence) runs in a fresh process: after imports and loading it records its RSS,
resets its peak (``/proc/self/clear_refs``), runs one forward+backward through ``forward_backward``
and reports the peak above that starting point (``VmHWM``; the first step, so that buffers a path
allocates once and keeps, such as megatron's ``[b·heads, s, s]`` score buffer, count), then the
best wall-clock and process CPU time of ``--reps`` more steps (CPU time is the steadier figure on a
busy machine). Variants: ``fused`` (``attention="sdpa"``: no mask, no s×s scores)
and ``unfused`` (``attention="unfused"``: megatron's DotProductAttention with the full
``[b, 1, s, s]`` mask, scores and probabilities kept for backward). Prints both side by side, the
ratios, and how each peak grows per doubling of the sequence (linear: 2×, quadratic: 4×).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {"fused": "sdpa", "unfused": "unfused"}


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def build_model(path: Path, max_seq: int) -> None:
    """The tests' tiny Llama with room for ``max_seq`` positions (built once per work directory)."""
    from mlora.testing import build_tiny_model

    config = path / "config.json"
    if config.exists() and json.loads(config.read_text())["max_position_embeddings"] >= max_seq:
        return
    build_tiny_model("llama", path, max_position_embeddings=max_seq)


def run_variant(variant: str, seq: int, reps: int, model_dir: Path) -> dict:
    """One process, one (variant, sequence): peak above the loaded model, and the best step time."""
    import gc

    import torch

    import mlora
    from mlora.testing.proc_status import reset_peak, rss

    mesh = mlora.init_parallel(tp=1, pp=1)
    model = mlora.from_pretrained(model_dir, mesh, attention=VARIANTS[variant])
    model.add_adapter("policy", mlora.LoraConfig(rank=8, alpha=16))
    model.train()
    ids = torch.randint(0, model.spec.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    lo, hi = model.vocab_shard_range()

    def loss_fn(logits, mb):  # mean log-sum-exp over positions: a loss touching every logit
        return logits[..., : hi - lo].float().logsumexp(-1).mean(), {}

    def step() -> None:
        with model.use_adapters("policy"):
            model.forward_backward([{"input_ids": ids}], loss_fn)
        for p in model.adapter_parameters("policy"):
            p.grad = None

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    start = rss("VmRSS")
    reset_peak()  # the peak-RSS counter := the current RSS
    step()
    peak = rss("VmHWM") - start
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    core = type(model.gpt.decoder.layers[0].self_attention.core_attention).__name__
    return {"variant": variant, "seq": seq, "peak": peak, "time": min(wall), "cpu": min(cpu), "core_attention": core}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=2, help="timed steps after the measured one (best is printed)")
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each measuring process")
    ap.add_argument("--work", type=Path, default=Path("runs/bench_attention"))
    ap.add_argument("--variant", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    model_dir = args.work / "llama-tiny"
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.seqs[0], args.reps, model_dir)))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    build_model(model_dir, max(args.seqs))
    results: dict[tuple[str, int], dict] = {}
    for seq in args.seqs:
        for variant in VARIANTS:
            proc = subprocess.run([sys.executable, __file__, "--work", str(args.work), "--variant", variant,
                                   "--seqs", str(seq), "--reps", str(args.reps)],
                                  capture_output=True, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            if proc.returncode != 0:
                sys.exit(f"{variant} at {seq} failed:\n{proc.stderr[-4000:]}")
            results[variant, seq] = json.loads(proc.stdout.strip().splitlines()[-1])
    mib = 2**20
    print(f"CPU: {cpu_model()}; ISA {torch.backends.cpu.get_cpu_capability()}; torch {torch.__version__}; "
          f"{args.threads} threads")
    print("tiny Llama (hidden 128, 4 layers, 4 heads / 2 KV groups, head_dim 32), float32, batch 1, "
          "LoRA r 8 on all linears, one forward+backward;")
    print(f"fused = {results['fused', args.seqs[0]]['core_attention']} (no mask), unfused = "
          f"{results['unfused', args.seqs[0]]['core_attention']} + [b, 1, s, s] mask; peak RSS above the loaded model")
    print(f"{'seq':>6} | {'fused: peak':>12} {'wall':>7} {'cpu':>7} | {'unfused: peak':>14} {'wall':>7} {'cpu':>7} | "
          "unfused/fused: peak   wall    cpu")
    for seq in args.seqs:
        f, u = results["fused", seq], results["unfused", seq]
        print(f"{seq:>6} | {f['peak'] / mib:>8.1f} MiB {f['time']:>6.2f}s {f['cpu']:>6.2f}s | "
              f"{u['peak'] / mib:>10.1f} MiB {u['time']:>6.2f}s {u['cpu']:>6.2f}s | "
              f"{u['peak'] / f['peak']:>18.2f}x {u['time'] / f['time']:>5.2f}x {u['cpu'] / f['cpu']:>5.2f}x")
    for variant in VARIANTS:
        steps = [results[variant, s]["peak"] for s in args.seqs]
        growth = ", ".join(f"{b / a:.2f}x" for a, b in zip(steps, steps[1:]))
        seqs = "→".join(str(s) for s in args.seqs)
        print(f"{variant} peak growth {seqs}: {growth}   (per doubling: linear 2x, quadratic 4x)")


if __name__ == "__main__":
    import records  # the run becomes a record of bench/records.jsonl

    records.main(main, group="LoRA compute")
