"""The Llama-3-70B memory table of docs/memory-planning.md: the planner's peak per GPU of one PPO step (actor + critic
LoRA r 32 on all linears, value head, micro-batch 1, sequence 4096) on 8 GPUs, for each layout, base precision and
recompute, and with a colocated vLLM TP8 engine (262,144 KV tokens, bf16 weights) that sleeps while the trainer
works (mlora's colocated runs on CUDA) or stays awake. Predictions from config.json alone, not GPU measurements.

    .venv/bin/python bench/plan_70b.py          # prints the markdown rows
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from mlora.formats.hf_config import load_hf_config, model_spec
from mlora.plan import Engine, Layout, Workload, plan_memory

GIB = 1 << 30
RESERVE = 2 * GIB  # CUDA context, NCCL, fragmentation
GPUS = {"8×H100-80GB": 79 * GIB, "8×H200-141GB": 139 * GIB}  # what the cards show as usable
LLAMA3_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
              "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_theta": 500000.0, "torch_dtype": "bfloat16"}


def _fits(need: int, usable: int) -> str:
    if need > usable:
        return f"no (+{(need - usable) / GIB:.1f})"
    return "fits (tight)" if usable - need < 5 * GIB else "fits"


def rows() -> list[str]:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(LLAMA3_70B))
        spec = model_spec(load_hf_config(d))
    out = []
    layouts = [Layout(tp=8), Layout(tp=4, pp=2), Layout(tp=2, pp=4)]
    cases = [(layout, fp8, rc, None) for layout in layouts for fp8 in (None, "torch") for rc in ("none", "full")]
    cases += [(Layout(tp=8), fp8, rc, sleeps) for fp8 in (None, "torch") for rc in ("none", "full")
              for sleeps in (True, False)]
    for layout, fp8, rc, sleeps in cases:
        workload = Workload(micro_batch=1, seq=4096, rank=32, critic=True, dtype=torch.bfloat16, fp8=fp8, recompute=rc)
        engine = None if sleeps is None else Engine(tp=8, kv_tokens=262144, dtype=torch.bfloat16, sleeps=sleeps)
        plan = plan_memory(spec, layout, workload, engine)
        r = max(plan.ranks, key=lambda r: r.peak)
        persistent = r.base + r.adapters + r.optimizer + r.heads + r.grads
        name = str(layout).removesuffix("xDP1").replace("xPP1", "").replace("x", "×")
        colocated = "–" if engine is None else ("engine TP8, sleeps" if sleeps else "engine TP8, awake")
        cells = [name, "FP8" if fp8 else "bf16", "full" if rc == "full" else "off", colocated, f"{r.peak / GIB:.1f}",
                 r.phase if layout.pp == 1 else f"stage {r.stage} {r.phase}", f"{persistent / GIB:.1f}",
                 f"{r.activations / GIB:.1f}" if r.activations else "–", f"{r.logits / GIB:.2f}" if r.logits else "–",
                 f"{r.engine / GIB:.1f}" if r.engine else "–"]
        cells += [_fits(r.peak + RESERVE, cap) for cap in GPUS.values()]
        out.append("| " + " | ".join(cells) + " |")
    return out


def main() -> None:
    print(f"CPU-independent (shapes only); torch {torch.__version__}")
    print("| layout | base | recompute | colocated engine | peak / GPU (GiB) | peak at | weights+LoRA+AdamW+grads | "
          "activations | logits | engine | " + " | ".join(GPUS) + " |")
    print("| " + " | ".join(["---"] * 12) + " |")
    print("\n".join(rows()))


if __name__ == "__main__":
    import records  # the run becomes a record of bench/records.jsonl

    records.main(main, group="Memory")
