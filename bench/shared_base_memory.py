"""Memory of one shared frozen base for actor + critic + reference, against the alternatives.

    .venv/bin/python bench/shared_base_memory.py [--work runs/bench_memory]

On a 100M-parameter Llama (float32), each variant runs in a fresh process. After imports and the
mesh, the process records its RSS and resets its peak (``/proc/self/clear_refs``); then it does
its work on the same batch (8 sequences x 64 tokens) and reports, above that starting point, its
resident memory at the end (weights, adapters, heads, optimizer state) and its peak (plus
activations and logits of the largest pass):

- ``base``: the base model alone, one forward pass;
- ``shared``: mlora's engine: one base, ``policy`` and ``critic`` LoRA (r 16) + value head,
  reference = adapters off; one full PPO step (old/ref log-probs, values, actor and critic updates);
- ``separate``: three models (actor, critic, reference), as systems without a shared base hold them;
  one forward pass each.

Prints peak RSS and the ratios to the base alone (whole process, and above the interpreter).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

VARIANTS = ("base", "shared", "separate")


def build_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mlora.testing import train_tokenizer

    if (path / "config.json").exists():
        return
    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=True)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    train_tokenizer(path)


def run_variant(variant: str, model_dir: Path) -> dict:
    import gc

    import torch

    import mlora
    from mlora.testing.proc_status import reset_peak, rss

    mesh = mlora.init_parallel(tp=1, pp=1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (8, 64), generator=g)
    import transformers.models.llama.configuration_llama  # noqa: F401

    import mlora.train.engine  # noqa: F401  (every variant pays the same imports)

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    start = rss("VmRSS")
    reset_peak()  # the peak-RSS counter := the current RSS
    n_params = 0
    if variant == "base":
        model = mlora.from_pretrained(model_dir, mesh)
        model.logits(ids)
        n_params = sum(p.numel() for p in model.parameters())
    elif variant == "shared":
        from mlora.train.batch import RolloutBatch
        from mlora.train.config import PPOConfig
        from mlora.train.engine import ActorCriticEngine

        model = mlora.from_pretrained(model_dir, mesh)
        lora = mlora.LoraConfig(rank=16, alpha=32)
        engine = ActorCriticEngine(model, PPOConfig(mini_batch_size=8, micro_train_batch_size=4,
                                                    micro_forward_batch_size=4),
                                   policy_lora=lora, critic_lora=mlora.LoraConfig(rank=16, alpha=32, seed=1))
        resp = torch.zeros_like(ids)
        resp[:, 32:] = 1
        engine.step(RolloutBatch(ids, torch.ones_like(ids), resp, torch.rand(8, generator=g)))
        n_params = sum(p.numel() for p in model.parameters())
    elif variant == "separate":
        models = []
        for role in ("actor", "critic", "reference"):
            m = mlora.from_pretrained(model_dir, mesh)
            if role == "actor":
                m.add_adapter("policy", mlora.LoraConfig(rank=16, alpha=32))
            if role == "critic":
                m.add_adapter("critic", mlora.LoraConfig(rank=16, alpha=32, seed=1))
                m.add_value_head("critic")
            m.logits(ids)
            models.append(m)
        n_params = sum(p.numel() for m in models for p in m.parameters())
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed activations back, so "resident" is memory in use
    return {"variant": variant, "resident": rss("VmRSS") - start, "peak": rss("VmHWM") - start,
            "parameters": n_params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/bench_memory"))
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    model_dir = args.work / "llama-110m"
    if args.variant:
        print(json.dumps(run_variant(args.variant, model_dir)))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    build_model(model_dir)
    results = {}
    for variant in VARIANTS:
        proc = subprocess.run([sys.executable, __file__, "--work", str(args.work), "--variant", variant],
                              capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        if proc.returncode != 0:
            sys.exit(f"{variant} failed:\n{proc.stderr[-4000:]}")
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    base = results["base"]
    print(f"model: {base['parameters']:,} parameters (float32); memory above the imported interpreter:")
    for v in VARIANTS:
        r = results[v]
        print(f"  {v:9s} resident {r['resident'] / 2**20:7.1f} MiB (x{r['resident'] / base['resident']:.3f})   "
              f"peak {r['peak'] / 2**20:7.1f} MiB (x{r['peak'] / base['peak']:.3f})")
    for v, label in (("shared", "shared-base engine (actor + critic + reference)"), ("separate", "three separate models")):
        print(f"{label} / base alone: resident {results[v]['resident'] / base['resident']:.3f}x, "
              f"peak {results[v]['peak'] / base['peak']:.3f}x" + ("   (goal <= 1.15)" if v == "shared" else ""))


if __name__ == "__main__":
    import records  # the run becomes a record of bench/records.jsonl

    records.main(main, group="Memory")
