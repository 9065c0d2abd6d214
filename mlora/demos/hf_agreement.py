"""Demo: load a tiny HF model at TP2×PP2 on 4 CPU ranks and show its agreement with transformers.

    torchrun --nproc_per_node 4 -m mlora.demos.hf_agreement [--out runs/demo]

Rank 0 builds a tiny random Llama checkpoint (with a locally trained tokenizer) unless one is
there; every rank loads only its shard; the last pipeline stage compares logits with
transformers on a right-padded batch of real prompts; the model is saved back to HF format
and compared tensor by tensor.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import mlora


def _say(mesh: mlora.Mesh, *msg: object) -> None:
    print(f"[rank {mesh.rank} tp{mesh.tp_rank} pp{mesh.pp_rank} dp{mesh.dp_rank}]", *msg, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/demo"))
    ap.add_argument("--arch", default="llama", choices=["llama", "qwen2", "mistral"])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    mesh = mlora.init_parallel(tp=args.tp, pp=args.pp)
    model_dir = args.out / f"tiny-{args.arch}"
    if mesh.rank == 0 and not (model_dir / "config.json").exists():
        from mlora.testing import build_tiny_model

        build_tiny_model(args.arch, model_dir)
        _say(mesh, f"built a tiny random {args.arch} checkpoint in {model_dir}")
    dist.barrier()

    t0 = time.perf_counter()
    model = mlora.from_pretrained(model_dir, mesh, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    _say(mesh, f"loaded {n_params:,} parameters ({model.bytes_read / 2**20:.2f} MiB read) "
               f"in {time.perf_counter() - t0:.2f}s")

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = ["Ann has 12 apples and gets 30 more. How many apples does Ann have?",
               "Bob has 7 pens.", "Eve has 41 coins and gets 9 more. #### 50"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    logits = model.logits(enc["input_ids"], attention_mask=enc["attention_mask"])
    if logits is not None and mesh.tp_rank == 0 and mesh.dp_rank == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        with torch.no_grad():
            ref = hf(**enc).logits
        valid = enc["attention_mask"].bool()
        diff = (logits - ref)[valid].abs().max().item()
        same_argmax = (logits.argmax(-1) == ref.argmax(-1))[valid].float().mean().item()
        _say(mesh, f"logits {tuple(logits.shape)} vs transformers: max |diff| = {diff:.2e} on "
                   f"{int(valid.sum())} tokens, argmax agreement {same_argmax:.0%} -> "
                   f"{'AGREE' if diff < 1e-4 else 'DISAGREE'} (tolerance 1e-4)")

    merged = args.out / "roundtrip"
    model.save_merged(merged)
    if mesh.rank == 0:
        from mlora.testing import load_checkpoint_tensors

        src, dst = load_checkpoint_tensors(model_dir), load_checkpoint_tensors(merged)
        same = sorted(src) == sorted(dst) and all(torch.equal(src[k], dst[k]) for k in src)
        _say(mesh, f"save_merged -> {merged}: {len(dst)} tensors, "
                   f"{'bit-identical to' if same else 'DIFFERENT from'} the input checkpoint")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
