"""torchrun worker for adapter export: train a step, save_adapter / save_merged, reload on other meshes.

Usage: torchrun ... export_roundtrip.py MODELS_DIR REFS_DIR WORK_DIR PHASE
PHASE "mesh4" (4 ranks): at TP2xPP2 load the PEFT adapter `policy`, add a q/v-only adapter `qv`,
train both one AdamW step, save both and the merged model, record logits; then reload the saved
files at TP2xPP2 and at (TP1, PP2, DP2) and save them again.
PHASE "mesh1" (1 rank): reload at TP1, save again, record logits.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from common import masked_sum_loss

import mlora
from mlora.parallel import reset_parallel

MODELS = ("llama", "qwen2")


def save_logits(model, ids, mask, path: Path) -> None:
    with model.use_adapters("policy"):
        out = model.logits(ids, mask)
    if out is not None and model.mesh.tp_rank == 0 and model.mesh.dp_rank == 0:
        torch.save(out, path)


def reload_and_save(models_dir: Path, work: Path, tp: int, pp: int, tag: str) -> None:
    mesh = mlora.init_parallel(tp=tp, pp=pp)
    for name in MODELS:
        w = work / name
        model = mlora.from_pretrained(models_dir / name, mesh)
        for adapter in ("policy", "qv"):
            model.load_adapter(adapter, w / f"{adapter}_mesh4")
            model.save_adapter(adapter, w / f"{adapter}_{tag}")
        ids, mask = torch.load(w / "batch.pt")
        save_logits(model, ids, mask, w / f"logits_{tag}.pt")
    reset_parallel()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models_dir", type=Path)
    ap.add_argument("refs_dir", type=Path)
    ap.add_argument("work", type=Path)
    ap.add_argument("phase", choices=["mesh4", "mesh1"])
    args = ap.parse_args()
    if args.phase == "mesh4":
        mesh = mlora.init_parallel(tp=2, pp=2)
        for name in MODELS:
            w = args.work / name
            if mesh.rank == 0:
                w.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            refs = torch.load(args.refs_dir / name / "refs.pt")
            ids, mask = refs["ids"], refs["mask"]
            if mesh.rank == 0:
                torch.save((ids, mask), w / "batch.pt")
            model = mlora.from_pretrained(args.models_dir / name, mesh)
            model.load_adapter("policy", args.refs_dir / name / "policy", trainable=True)
            model.add_adapter("qv", mlora.LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"], seed=3))
            opt = torch.optim.AdamW(model.trainable_parameters(), lr=1e-2)
            with model.use_adapters("policy", "qv"):
                model.forward_backward([{"input_ids": ids, "attention_mask": mask}],
                                       masked_sum_loss(model, mask, scale=1e-3))
            model.reduce_tp_replicated_grads()
            opt.step()
            save_logits(model, ids, mask, w / "logits_mesh4.pt")
            model.save_adapter("policy", w / "policy_mesh4")
            model.save_adapter("qv", w / "qv_mesh4")
            model.save_merged(w / "merged_policy", adapters=["policy"])
            del model, opt
        reset_parallel()
        reload_and_save(args.models_dir, args.work, 2, 2, "mesh4again")
        reload_and_save(args.models_dir, args.work, 1, 2, "mesh2dp2")
    else:
        reload_and_save(args.models_dir, args.work, 1, 1, "mesh1")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
