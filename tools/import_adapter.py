#!/usr/bin/env python
"""Megatron-Bridge / NeMo LoRA checkpoint -> PEFT adapter (loads unchanged in PEFT, vLLM and mlora).

    python tools/import_adapter.py --in RUN_OR_ITER_DIR --base HF_DIR --out PEFT_DIR [--alpha A] [--rank R]

--in takes a megatron-core dist checkpoint directory (Bridge's iter_NNNNNNN/, or the run directory
whose latest_checkpointed_iteration.txt names it; NeMo 2's weights/), or a .safetensors / .pt state
dict of the adapter parameters named as a TP1 Megatron model names them. Both performant LoRA
(linear_qkv / linear_fc1 with one shared A and a fused B) and canonical LoRA (adapter_q/k/v,
adapter_gate/up) are converted exactly. r, alpha and dropout come from the run's run_config.yaml;
--alpha / --rank / --dropout fill in what it lacks (a contradicting value is an error).
Exit status: 0 done, 2 bad input (the message says what and what would be valid).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, when mlora is not installed


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser; runs nothing."""
    ap = argparse.ArgumentParser(prog="import_adapter.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--in", dest="src", required=True, metavar="BRIDGE_CKPT",
                    help="dist checkpoint dir, Bridge run dir, or .safetensors/.pt adapter state dict")
    ap.add_argument("--base", required=True, metavar="HF_DIR", help="the HF base model the adapter was trained on")
    ap.add_argument("--out", required=True, metavar="PEFT_DIR", help="output directory (PEFT files)")
    ap.add_argument("--alpha", type=float, default=None, help="lora_alpha, if run_config.yaml does not give it")
    ap.add_argument("--rank", type=int, default=None, help="r, if run_config.yaml does not give it "
                                                           "(default: read off the tensors)")
    ap.add_argument("--dropout", type=float, default=None, help="lora_dropout to record (default: the run's, or 0)")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="cast the factors (default: as stored)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and convert; returns the exit status."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)

    from mlora.export.bridge_adapter import import_bridge_adapter

    try:
        out = import_bridge_adapter(args.src, args.base, args.out, alpha=args.alpha, rank=args.rank,
                                    dropout=args.dropout, dtype=getattr(torch, args.dtype) if args.dtype else None,
                                    progress=not args.quiet)
    except (ValueError, FileNotFoundError) as exc:
        print(f"import_adapter.py: error: {exc}", file=sys.stderr)
        return 2
    print(f"imported {args.src} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
