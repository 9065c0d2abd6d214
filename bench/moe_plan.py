"""The planner's mixture-of-experts plans: Qwen3-235B-A22B on SkyRL's layout and Qwen3-30B-A3B on one 8-GPU node.

    .venv/bin/python bench/moe_plan.py                    # the plan tables and the summary rows
    .venv/bin/python bench/moe_plan.py --config-dir DIR   # also write the two config.json files, for
                                                          # mlora plan --memory --model DIR/qwen3-235b-a22b ...

Workload of SkyRL's DAPO LoRA scripts (``examples/train/megatron/run_megatron_dapo_qwen3_235b_a22b_lora.sh``):
GRPO (no critic, no value head), LoRA r 128 on all linears (the experts' gate/up/down included, one adapter
per expert), bf16 base with float32 adapter masters and AdamW state, packed micro-batches of 10,240 tokens
(``trainer.use_sample_packing``, prompt 2,048 + response 8,192; the 30B script's 4 x 10,240-token micro-batches
for its TP4 x EP8 row), flash attention, full recompute (SkyRL's ``gradient_checkpointing`` default), balanced
routing (each table's last line gives the worst routing's peak). The trainer alone: SkyRL's colocated vLLM engines sleep
while it trains, and its CPU optimizer offload (``optimizer_cpu_offload``) is not mlora's, so the AdamW
moments here are on the GPU.

SkyRL splits the 235B model's 94 layers 26/26/26/16 over PP 4 (``num_layers_in_last_pipeline_stage=16``);
mlora runs even stages only, so the planner refuses PP 4 (its error is printed). The uneven layout's per-stage
figures are still the planner's: every layer of Qwen3-235B-A22B is sparse and alike, so stage ``s`` holding
``n`` layers is stage ``s`` of the same model cut into ``4 · n`` layers at PP 4 (same embedding or output layer,
same micro-batches in flight). The layout mlora runs on the same 32 GPUs is TP4 × PP2 × EP8.

Configs are built with transformers' ``Qwen3MoeConfig`` (the published models' values; no download). Shapes
only: the output does not depend on the machine, whose CPU is printed as every bench does.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from lora_overhead import machine  # noqa: E402  (the CPU line every bench prints)

from mlora.formats.hf_config import ModelSpec, load_hf_config, model_spec  # noqa: E402
from mlora.plan import Layout, RankMemory, Workload, fit_layouts, plan_memory  # noqa: E402
from mlora.plan.report import fit_table, memory_table  # noqa: E402

GIB = 1 << 30
RESERVE = 2 * GIB  # CUDA context, NCCL, fragmentation (mlora plan --fit's default)
GPUS = {"H100-80GB": 79 * GIB, "H200-141GB": 139 * GIB}  # what the cards show as usable
QWEN3_MOE = dict(vocab_size=151936, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
                 rms_norm_eps=1e-6, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
MODELS = {
    "qwen3-235b-a22b": dict(QWEN3_MOE, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                            num_hidden_layers=94, num_attention_heads=64),
    "qwen3-30b-a3b": dict(QWEN3_MOE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32),
}
SKYRL_STAGES = (26, 26, 26, 16)  # SkyRL's 235B split over PP 4
STAGE_FIELDS = ("base", "adapters", "grads", "optimizer", "activations", "logits", "peak")
WORKLOAD = Workload.packed_budget(10240, rank=128, target_modules="all-linear", critic=False, dtype=torch.bfloat16,
                                  attention="sdpa", recompute="full")


def write_config(name: str, out_dir: Path) -> Path:
    """``out_dir/name/config.json`` of one of :data:`MODELS`, as transformers writes it."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**MODELS[name])
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.save_pretrained(str(out_dir / name))
    return out_dir / name


def spec_of(name: str) -> ModelSpec:
    with tempfile.TemporaryDirectory() as d:
        return model_spec(load_hf_config(write_config(name, Path(d))))


def uneven_stages(spec: ModelSpec, layout: Layout, workload: Workload, stages: tuple[int, ...]) -> list[RankMemory]:
    """The per-rank plan of an uneven pipeline split (``stages[s]`` layers on stage ``s``), for a model whose
    layers are all alike: stage ``s`` of the same model cut into ``len(stages) · stages[s]`` layers, evenly."""
    assert spec.moe is not None and len(spec.moe.sparse_layers) == spec.num_layers, "every layer alike"
    assert sum(stages) == spec.num_layers and len(stages) == layout.pp
    ranks = []
    for stage, n in enumerate(stages):
        layers = n * layout.pp
        even = replace(spec, num_layers=layers, moe=replace(spec.moe, sparse_layers=tuple(range(layers))))
        ranks += [r for r in plan_memory(even, layout, workload).ranks if r.stage == stage]
    return ranks


def _fits(need: int) -> list[str]:
    return [("fits" if cap - need >= 5 * GIB else "fits (tight)") if need <= cap else f"no (+{(need - cap) / GIB:.1f})"
            for cap in GPUS.values()]


def row(name: str, layout: str, ranks: list[RankMemory]) -> str:
    """A markdown row: the worst rank's peak and its parts, and whether it fits with the reserve."""
    r = max(ranks, key=lambda r: r.peak)
    cells = [name, layout, f"{r.peak / GIB:.1f}", f"stage {r.stage} {r.phase}", f"{r.base / GIB:.1f}",
             f"{r.adapters / GIB:.1f}", f"{r.optimizer / GIB:.1f}", f"{r.grads / GIB:.1f}",
             f"{r.activations / GIB:.1f}", f"{r.logits / GIB:.1f}", *_fits(r.peak + RESERVE)]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-dir", type=Path, default=None, help="also write the two config.json files here")
    args = ap.parse_args()
    print(machine())
    print("shapes only (no weights, no GPU): the same on any machine\n")
    if args.config_dir is not None:
        for name in MODELS:
            print(f"wrote {write_config(name, args.config_dir) / 'config.json'}")
    rows = []

    big = spec_of("qwen3-235b-a22b")
    skyrl = Layout(tp=4, pp=4, dp=2, ep=8, sp=True)
    print(f"== Qwen3-235B-A22B, SkyRL's layout {skyrl} (32 GPUs)")
    try:
        plan_memory(big, skyrl, WORKLOAD)
    except ValueError as exc:
        print(f"mlora refuses it: {exc} (SkyRL splits the layers {'/'.join(map(str, SKYRL_STAGES))})")
    ranks = uneven_stages(big, skyrl, WORKLOAD, SKYRL_STAGES)
    print("SkyRL's uneven split, planned stage by stage (GiB per GPU, every TP and EP rank of a stage alike):")
    print(f"{'stage':>5s} {'layers':>6s} " + " ".join(f"{h:>11s}" for h in STAGE_FIELDS) + "  at")
    for r in ranks:
        if r.tp_rank == 0:
            print(f"{r.stage:>5d} {SKYRL_STAGES[r.stage]:>6d} "
                  + " ".join(f"{getattr(r, f) / GIB:>11.2f}" for f in STAGE_FIELDS) + f"  {r.phase}")
    rows.append(row("Qwen3-235B-A22B", f"{skyrl} split 26/26/26/16 (SkyRL's; mlora: even stages only)", ranks))
    for layout in (Layout(tp=4, pp=2, dp=4, ep=8, sp=True), Layout(tp=4, pp=2, dp=4, ep=4, sp=True)):
        plan = plan_memory(big, layout, WORKLOAD)
        print(f"\n== Qwen3-235B-A22B, {layout} (32 GPUs)")
        print(memory_table(plan))
        rows.append(row("Qwen3-235B-A22B", str(layout), plan.ranks))
    none = plan_memory(big, Layout(tp=4, pp=2, dp=4, ep=8, sp=True), replace(WORKLOAD, recompute="none"))
    rows.append(row("Qwen3-235B-A22B", str(none.layout) + ", no recompute", none.ranks))

    small = spec_of("qwen3-30b-a3b")
    print("\n== Qwen3-30B-A3B on one node of 8 H100-80GB: the layouts that fit, best first (EP 8)")
    print(fit_table(fit_layouts(small, WORKLOAD, 8, GPUS["H100-80GB"], RESERVE, ep=8), 8, GPUS["H100-80GB"], RESERVE))
    skyrl_30b = replace(WORKLOAD, micro_batch=4, seq=10240, forward_micro_batch=4, packed=False)
    for layout, workload, note in ((Layout(tp=1, pp=1, dp=8, ep=8), WORKLOAD, ""),
                                   (Layout(tp=2, pp=1, dp=4, ep=4, sp=True), WORKLOAD, ""),
                                   (Layout(tp=4, pp=1, dp=2, ep=8, sp=True), skyrl_30b,
                                    "4 x 10,240-token micro-batches (SkyRL's 30B script)")):
        plan = plan_memory(small, layout, workload)
        print(f"\n== Qwen3-30B-A3B, {layout}" + (f", {note}" if note else ""))
        print(memory_table(plan))
        rows.append(row("Qwen3-30B-A3B", str(layout) + (f", {note}" if note else ""), plan.ranks))

    print("\n| model | layout | peak / GPU (GiB) | peak at | base | LoRA | AdamW | grads | activations | logits | "
          + " | ".join(GPUS) + " |")
    print("| " + " | ".join(["---"] * (10 + len(GPUS))) + " |")
    print("\n".join(rows))
    print(f"(fits: peak + {RESERVE / GIB:g} GiB reserve within the card's usable memory; 'tight': under 5 GiB left)")


if __name__ == "__main__":
    import records  # the run becomes a record of bench/records.jsonl

    records.main(main, group="Memory")
