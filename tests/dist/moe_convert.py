"""torchrun worker (2 ranks): tools/convert_checkpoint.py hf-to-mcore for the mixtures of experts and Qwen3 at
layouts that split what one process does not (experts over EP ranks, the full-width q/k norm over TP ranks,
dense and sparse layers over stages), then megatron-core's dist_checkpointing.load of each into a model built
by mlora at another layout, against mlora's own HF loader at that layout.

Usage: torchrun --nproc_per_node=2 moe_convert.py MODELS_DIR OUT_DIR
Writes (name, tp, pp, ep): qwen3_moe (1, 1, 2), mixtral (1, 2, 1), olmoe (2, 1, 2), qwen3 (2, 1, 1), gpt_oss
(2, 1, 2) (its sinks split over TP with the heads), all with
--make-vocab-size-divisible-by 1 (mlora's own vocabulary padding, so mlora's model takes the checkpoint
as it is); the dist checkpoints go to OUT_DIR/<name>. Loads: qwen3_moe and mixtral at (tp, pp, ep) = (1, 1, 2),
olmoe, qwen3 and gpt_oss at (2, 1, 1) with SP. Rank 0 writes OUT_DIR/records.json: each conversion's exit status and,
per load and rank, the parameters that differ from mlora's loader's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

WRITES = (("qwen3_moe", 1, 1, 2), ("mixtral", 1, 2, 1), ("olmoe", 2, 1, 2), ("qwen3", 2, 1, 1), ("gpt_oss", 2, 1, 2))
LOADS = (((1, 1, 2, False), ("qwen3_moe", "mixtral")), ((2, 1, 1, True), ("olmoe", "qwen3", "gpt_oss")))


def load_and_compare(models: Path, ckpts: Path, name: str, mesh) -> dict:
    """mlora's model filled by megatron's dist_checkpointing.load vs mlora's HF loader, parameter by parameter."""
    import torch
    from megatron.core import dist_checkpointing

    from mlora.models.loader import load_shard
    from mlora.models.mcore_checkpoint import RELEASE_DIR, model_sharded_state_dict
    from mlora.models.megatron_build import build_gpt_model

    ref = load_shard(models / name, mesh, torch.float32)
    model = build_gpt_model(ref.spec, mesh, torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # everything must come from the checkpoint
    state = dist_checkpointing.load({"model": model_sharded_state_dict(model, ref.spec)},
                                    str(ckpts / name / RELEASE_DIR))
    model.load_state_dict(state["model"], strict=True)
    ours, theirs = dict(model.named_parameters()), dict(ref.gpt.named_parameters())
    differ = sorted(n for n in theirs if n not in ours or not torch.equal(ours[n], theirs[n]))
    experts = sum(".local_experts." in n for n in ours)
    return {"load": name, "tp": mesh.tp, "pp": mesh.pp, "ep": mesh.ep, "rank": mesh.rank,
            "params": len(theirs), "expert_params": experts, "same_names": sorted(ours) == sorted(theirs),
            "differ": differ}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models_dir", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    # imported here, not at the top: megatron's save spawns a helper process that re-imports this file
    from common import convert_tool, write_records_and_exit

    import mlora
    from mlora.parallel import reset_parallel

    tool = convert_tool()
    records = []
    for name, tp, pp, ep in WRITES:
        code = tool.main(["hf-to-mcore", "--hf", str(args.models_dir / name), "--out", str(args.out / name),
                          "--tp", str(tp), "--pp", str(pp), "--ep", str(ep), "--make-vocab-size-divisible-by", "1",
                          "--quiet"])
        records.append({"model": name, "tp": tp, "pp": pp, "ep": ep, "exit": code})
        reset_parallel()  # the next layout builds its own groups
    for (tp, pp, ep, sp), names in LOADS:
        mesh = mlora.init_parallel(tp=tp, pp=pp, ep=ep, sp=sp)
        records += [load_and_compare(args.models_dir, args.out, name, mesh) for name in names]
        reset_parallel()
    write_records_and_exit(records, args.out / "records.json")


if __name__ == "__main__":
    main()
