"""The planner's DeepSeek-V3 (671B) LoRA plans on nodes of 8 H100-80GB.

    .venv/bin/python bench/deepseek_v3_plan.py                   # the fit tables
    .venv/bin/python bench/deepseek_v3_plan.py --config-dir DIR  # also write config.json, for
                                                                 # mlora plan --memory --model DIR/deepseek-v3 ...

DeepSeek-V3's published shapes (transformers' ``DeepseekV3Config`` defaults: 61 layers, the first 3 dense, hidden
7,168, 128 heads of multi-latent attention with q rank 1,536 and a 512 + 64 latent, 256 routed experts of FFN 2,048
top-8 in 8 groups keeping 4, one shared expert, vocabulary 129,280; YaRN RoPE factor 40 as its config.json sets it).
Workload: GRPO (no critic), LoRA r 64 on all linears with the experts at ``expert_rank`` 8 (LoRA Without Regret's
per-expert rank: total rank / active experts), bf16 base with float32 adapter masters and AdamW state, packed
micro-batches of 8,192 tokens, SDPA, full recompute, balanced routing; the trainer alone (colocated engines asleep).
61 layers is a prime number, so pipeline parallelism cannot split them evenly (mlora runs even stages only): every
layout is TP x DP with the experts over EP ranks of the TP x DP plane, PP 1. Shapes only: the same on any machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from lora_overhead import machine  # noqa: E402  (the CPU line every bench prints)

from mlora.formats.hf_config import ModelSpec, load_hf_config, model_spec  # noqa: E402
from mlora.plan import Workload, fit_layouts  # noqa: E402
from mlora.plan.report import fit_table, memory_table  # noqa: E402

GIB = 1 << 30
H100 = 79 * GIB  # what the card shows as usable
RESERVE = 2 * GIB  # CUDA context, NCCL, fragmentation (mlora plan --fit's default)
ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
WORKLOAD = Workload.packed_budget(8192, rank=64, expert_rank=8, target_modules="all-linear", critic=False,
                                  dtype=torch.bfloat16, attention="sdpa", recompute="full")
NODES = (8, 16, 32)  # of 8 GPUs
EPS = (8, 16, 32, 64)


def write_config(out_dir: Path) -> Path:
    """``out_dir/deepseek-v3/config.json``, as transformers writes DeepSeek-V3's."""
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(rope_parameters=ROPE, topk_method="noaux_tc", scoring_func="sigmoid")
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    cfg.save_pretrained(str(out_dir / "deepseek-v3"))
    return out_dir / "deepseek-v3"


def spec() -> ModelSpec:
    with tempfile.TemporaryDirectory() as d:
        return model_spec(load_hf_config(write_config(Path(d))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-dir", type=Path, default=None, help="also write config.json here")
    args = ap.parse_args()
    print(machine())
    print("shapes only (no weights, no GPU): the same on any machine\n")
    if args.config_dir is not None:
        print(f"wrote {write_config(args.config_dir) / 'config.json'}")
    model = spec()
    best = []
    for nodes in NODES:
        gpus = 8 * nodes
        for ep in EPS:
            fits = fit_layouts(model, WORKLOAD, gpus, H100, RESERVE, ep=ep)
            print(f"== DeepSeek-V3 on {nodes} nodes ({gpus} H100-80GB), EP {ep}")
            print(fit_table(fits[:4], gpus, H100, RESERVE))
            if fits[0].fits:
                best.append((nodes, ep, fits[0]))
    print("\nsmallest fitting layout per node count (the first EP that fits):")
    shown = set()
    for nodes, ep, fit in best:
        if nodes in shown:
            continue
        shown.add(nodes)
        print(f"{nodes} nodes: {fit.plan.layout}, peak {fit.plan.peak / GIB:.1f} GiB of {H100 / GIB:.0f}")
    if best:
        print("\n" + memory_table(best[0][2].plan))


if __name__ == "__main__":
    import records  # the run becomes a record of bench/records.jsonl

    records.main(main, group="Memory plans")
