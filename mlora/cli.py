"""``mlora``: offline command lines (no GPU, no torchrun).

    mlora plan --model HF_DIR --tp 8 --pp 4 --rank 32 [--list]
    mlora merge --base HF_DIR --adapter PEFT_DIR --out DIR
    mlora export-adapter CHECKPOINT_DIR --out DIR [--adapter policy] [--base HF_DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

CHECKPOINT_ADAPTERS = "adapters"  # <checkpoint>/adapters/<name>/ holds PEFT-layout files (mesh-independent)


def _plan(args: argparse.Namespace) -> int:
    from mlora.export.plan import plan_adapter
    from mlora.lora.config import LoraConfig
    from mlora.models.hf_config import load_hf_config, model_spec

    model = Path(args.model)
    spec = model_spec(load_hf_config(model.parent if model.is_file() else model))
    lora = LoraConfig(rank=args.rank, alpha=args.alpha or 2 * args.rank, target_modules=args.target_modules,
                      exclude_modules=args.exclude_modules)
    plan = plan_adapter(spec, args.tp, args.pp, lora, getattr(torch, args.dtype))
    if args.list:
        for name, shape in plan.tensors.items():
            print(f"{name}\t{list(shape)}")
    print(plan.summary())
    return 0


def _merge(args: argparse.Namespace) -> int:
    from mlora.export.merge import merge_adapter

    out = merge_adapter(args.base, args.adapter, args.out, progress=not args.quiet)
    print(f"merged {args.adapter} into {args.base} -> {out}")
    return 0


def _export_adapter(args: argparse.Namespace) -> int:
    from mlora.export.peft_files import (
        ADAPTER_CONFIG,
        ADAPTER_WEIGHTS,
        check_peft_shapes,
        peft_modules,
        read_peft_config,
        write_peft_adapter,
    )
    from mlora.models.checkpoint_reader import CheckpointReader

    src = Path(args.checkpoint) / CHECKPOINT_ADAPTERS / args.adapter
    if not src.is_dir():
        found = sorted(p.name for p in (Path(args.checkpoint) / CHECKPOINT_ADAPTERS).glob("*") if p.is_dir())
        raise FileNotFoundError(f"{src} does not exist; adapters in this checkpoint: {found or 'none'}")
    cfg = read_peft_config(src)
    config = json.loads((src / ADAPTER_CONFIG).read_text())
    with CheckpointReader(src) as reader:
        tensors = {name: reader.read(name) for name in sorted(reader.entries)}
        if args.base:
            from mlora.lora.sites import model_sites
            from mlora.models.hf_config import load_hf_config, model_spec

            spec = model_spec(load_hf_config(args.base))
            modules = peft_modules(reader.entries, spec.num_layers, src)
            check_peft_shapes(reader, modules, model_sites(spec, 1), cfg.rank, src)
            config["base_model_name_or_path"] = str(args.base)
    if args.dtype:
        tensors = {k: v.to(getattr(torch, args.dtype)) for k, v in tensors.items()}
    write_peft_adapter(args.out, tensors, config)
    print(f"exported {len(tensors)} tensors of adapter {args.adapter!r} -> {args.out} ({ADAPTER_WEIGHTS})")
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(prog="mlora", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="exported adapter tensors and sizes for a model config and mesh (no weights)")
    p.add_argument("--model", required=True, help="HF model directory or its config.json")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--alpha", type=float, default=None, help="default: 2 x rank")
    p.add_argument("--target-modules", nargs="+", default="all-linear")
    p.add_argument("--exclude-modules", nargs="*", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--list", action="store_true", help="print every tensor name and shape")
    p.set_defaults(func=_plan)

    p = sub.add_parser("merge", help="merge a PEFT LoRA adapter into an HF checkpoint, streaming")
    p.add_argument("--base", required=True)
    p.add_argument("--adapter", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_merge)

    p = sub.add_parser("export-adapter", help="PEFT files of an adapter from a training checkpoint")
    p.add_argument("checkpoint")
    p.add_argument("--adapter", default="policy")
    p.add_argument("--out", required=True)
    p.add_argument("--base", default=None, help="check the adapter against this HF base and record it")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    p.set_defaults(func=_export_adapter)

    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"mlora {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
