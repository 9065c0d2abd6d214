"""``mlora``: offline command lines (no GPU, no torchrun).

    mlora plan --model HF_DIR --tp 8 --pp 4 --rank 32 [--list]
    mlora plan --memory --model HF_DIR_OR_CONFIG --tp 8 --pp 1 --seq 4096 [--recompute full] [--json]
    mlora plan --memory --model HF_DIR_OR_CONFIG --fit 80 --gpus 8
    mlora plan --memory --model MOE_CONFIG --tp 4 --pp 2 --dp 4 --ep 8 --sp   (experts split over 8 ranks)
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


def _plan(args: argparse.Namespace) -> int:
    from mlora.export.plan import plan_adapter
    from mlora.formats.hf_config import load_hf_config, model_spec
    from mlora.lora.config import LoraConfig

    model = Path(args.model)
    spec = model_spec(load_hf_config(model.parent if model.is_file() else model))
    if args.memory:
        return _plan_memory(args, spec)
    lora = LoraConfig(rank=args.rank, alpha=args.alpha or 2 * args.rank, target_modules=args.target_modules,
                      exclude_modules=args.exclude_modules, expert_rank=args.expert_rank)
    plan = plan_adapter(spec, args.tp, args.pp, lora, getattr(torch, args.dtype))
    if args.list:
        for name, shape in plan.tensors.items():
            print(f"{name}\t{list(shape)}")
    print(plan.summary())
    return 0


def _plan_memory(args: argparse.Namespace, spec) -> int:
    """``plan --memory``: per-rank bytes of a PPO step, or with ``--fit`` the layouts that fit."""
    from mlora.plan import Engine, Layout, Workload, fit_layouts, plan_memory, require_fit
    from mlora.plan.fit import GIB
    from mlora.plan.report import engine_line, fit_json, fit_table, memory_json, memory_table

    targets = args.target_modules if isinstance(args.target_modules, str) else tuple(args.target_modules)
    if args.max_tokens_per_microbatch is not None:  # packed: one row of that many tokens per micro-batch
        if args.micro_batch != 1 or args.forward_micro_batch not in (None, 1):
            raise ValueError("--max-tokens-per-microbatch plans packed micro-batches (one row of that many tokens); "
                             "drop --micro-batch / --forward-micro-batch")
        args.seq, args.forward_micro_batch = args.max_tokens_per_microbatch, 1
    workload = Workload(
        micro_batch=args.micro_batch, seq=args.seq, micro_batches=args.micro_batches,
        packed=args.max_tokens_per_microbatch is not None,
        forward_micro_batch=args.forward_micro_batch, rank=args.rank, expert_rank=args.expert_rank,
        target_modules=targets,
        exclude_modules=tuple(args.exclude_modules) if args.exclude_modules else None, critic=args.critic,
        dtype=getattr(torch, args.dtype), fp8=args.fp8, attention=args.attention, recompute=args.recompute,
        lora_compute_dtype=getattr(torch, args.lora_compute_dtype) if args.lora_compute_dtype else None,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        recompute_modules=tuple(args.recompute_modules), experiments=args.experiments, expert_load=args.expert_load)
    engine = None
    if args.engine_tp is not None or args.kv_tokens:
        engine = Engine(tp=args.engine_tp or 1, kv_tokens=args.kv_tokens or 0, dtype=getattr(torch, args.dtype),
                        sleeps=not args.engine_awake)
        engine.check(spec)
    elif args.engine_separate or args.engine_awake:
        raise ValueError("--engine-separate / --engine-awake describe an engine: give --engine-tp and --kv-tokens")
    if args.engine_separate and args.engine_awake:
        raise ValueError("--engine-awake is for a colocated engine; --engine-separate puts it on GPUs of its own")
    # an engine on GPUs of its own is not in the trainer's plan, only in its line
    colocated = None if args.engine_separate else engine
    if args.fit is not None:
        if args.gpus is None:
            raise ValueError("--fit GPU_GIB needs --gpus N (the GPUs to lay the model out on)")
        gpu, reserve = int(args.fit * GIB), int(args.reserve_gib * GIB)
        fits = fit_layouts(spec, workload, args.gpus, gpu, reserve, colocated, sp=args.sp, ep=args.ep)
        good = require_fit(fits, args.gpus, gpu, reserve)
        print(fit_json(good, args.gpus, gpu, reserve) if args.json else fit_table(fits, args.gpus, gpu, reserve))
    else:
        plan = plan_memory(spec, Layout(tp=args.tp, pp=args.pp, dp=args.dp, sp=args.sp, ep=args.ep), workload,
                           colocated)
        print(memory_json(plan) if args.json else memory_table(plan))
    if engine is not None and not args.json:
        print(engine_line(spec, engine, workload, separate=args.engine_separate))
    return 0


def _merge(args: argparse.Namespace) -> int:
    from mlora.export.merge import merge_adapter

    out = merge_adapter(args.base, args.adapter, args.out, progress=not args.quiet)
    print(f"merged {args.adapter} into {args.base} -> {out}")
    return 0


def _export_adapter(args: argparse.Namespace) -> int:
    from mlora.checkpoint.run_state import ADAPTERS  # <checkpoint>/adapters/<name>/: PEFT layout, any mesh
    from mlora.export.peft_files import (
        ADAPTER_CONFIG,
        ADAPTER_WEIGHTS,
        check_peft_shapes,
        peft_modules,
        read_peft_config,
        write_peft_adapter,
    )
    from mlora.formats.checkpoint_reader import CheckpointReader
    from mlora.lora.targets import attention_projections

    src = Path(args.checkpoint) / ADAPTERS / args.adapter
    if not src.is_dir():
        found = sorted(p.name for p in (Path(args.checkpoint) / ADAPTERS).glob("*") if p.is_dir())
        raise FileNotFoundError(f"{src} does not exist; adapters in this checkpoint: {found or 'none'}")
    cfg = read_peft_config(src)
    config = json.loads((src / ADAPTER_CONFIG).read_text())
    with CheckpointReader(src) as reader:
        tensors = {name: reader.read(name) for name in sorted(reader.entries)}
        if args.base:
            from mlora.formats.hf_config import load_hf_config, model_spec
            from mlora.lora.sites import model_sites

            spec = model_spec(load_hf_config(args.base))
            modules = peft_modules(reader.entries, spec.num_layers, src, spec.moe, attention_projections(spec))
            check_peft_shapes(reader, modules, model_sites(spec, 1), cfg, src)
            config["base_model_name_or_path"] = str(args.base)
    if args.dtype:
        tensors = {k: v.to(getattr(torch, args.dtype)) for k, v in tensors.items()}
    write_peft_adapter(args.out, tensors, config)
    print(f"exported {len(tensors)} tensors of adapter {args.adapter!r} -> {args.out} ({ADAPTER_WEIGHTS})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``mlora`` parser with its subcommands (``plan``, ``merge``, ``export-adapter``); runs nothing."""
    from mlora.models.attention import ATTENTION_IMPLS
    from mlora.models.recompute import RECOMPUTE, RECOMPUTE_METHODS, RECOMPUTE_MODULES

    ap = argparse.ArgumentParser(prog="mlora", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="exported adapter tensors and sizes (or, with --memory, the memory of each "
                                    "rank) for a model config and mesh; no weights are read")
    p.add_argument("--model", required=True, help="HF model directory or its config.json")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank r")
    p.add_argument("--expert-rank", type=int, default=None, help="r of the MoE experts' projections (default: --rank)")
    p.add_argument("--alpha", type=float, default=None, help="default: 2 x rank")
    p.add_argument("--target-modules", nargs="+", default="all-linear",
                   help="modules to adapt: all-linear, or HF / megatron names (as trainer.policy.model.lora)")
    p.add_argument("--exclude-modules", nargs="*", default=None, help="names taken out of --target-modules")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the exported tensors; with --memory, of the frozen base")
    p.add_argument("--list", action="store_true", help="print every tensor name and shape")
    m = p.add_argument_group("memory (--memory): bytes per rank of one PPO step, from shapes alone")
    m.add_argument("--memory", action="store_true", help="plan memory instead of the adapter export")
    m.add_argument("--dp", type=int, default=1, help="data-parallel size")
    m.add_argument("--sp", action="store_true", help="megatron sequence parallelism over TP")
    m.add_argument("--ep", type=int, default=1,
                   help="expert parallelism (mixtures of experts): each stage's experts split over EP of its TP x DP "
                        "ranks, whole experts per rank (expert TP 1); must divide the experts and TP x DP")
    m.add_argument("--expert-load", type=float, default=1.0, metavar="X",
                   help="token copies an EP rank's experts receive, relative to balanced routing (default 1; the "
                        "table's last line gives the worst case's peak)")
    m.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (train)")
    m.add_argument("--forward-micro-batch", type=int, default=None, help="for the log-prob passes (default: --micro-batch)")
    m.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches per update and DP rank (default: --pp, a full 1F1B pipeline)")
    m.add_argument("--seq", type=int, default=4096, help="tokens per sequence (prompt + response)")
    m.add_argument("--max-tokens-per-microbatch", type=int, default=None, metavar="TOKENS",
                   help="packed micro-batches (trainer.use_sample_packing) of this token budget, instead of "
                        "--micro-batch x --seq")
    m.add_argument("--fp8", default=None, choices=["torch"], help="FP8 (e4m3) frozen linears")
    m.add_argument("--lora-compute-dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="dtype the LoRA branches compute in (default float32: the adapters' master dtype; "
                        "adapters, heads and AdamW moments are float32 under a 16-bit --dtype either way)")
    m.add_argument("--attention", default="sdpa", choices=ATTENTION_IMPLS,
                   help="core attention: sdpa (fused, trainer.flash_attn=true) or unfused (megatron's masked path)")
    m.add_argument("--recompute", default="none", choices=RECOMPUTE, help="activation recompute (trainer.recompute)")
    m.add_argument("--recompute-method", default="uniform", choices=RECOMPUTE_METHODS,
                   help="with --recompute full (trainer.recompute_method)")
    m.add_argument("--recompute-num-layers", type=int, default=1,
                   help="with --recompute full (trainer.recompute_num_layers)")
    m.add_argument("--recompute-modules", nargs="+", default=["core_attn"], choices=RECOMPUTE_MODULES,
                   help="with --recompute selective (trainer.recompute_modules)")
    m.add_argument("--experiments", type=int, default=1, metavar="K",
                   help="K experiments side by side on the base (config key experiments): K adapter sets")
    m.add_argument("--critic", action=argparse.BooleanOptionalAction, default=True,
                   help="a critic adapter + value head (PPO); --no-critic for GRPO/RLOO")
    m.add_argument("--engine-tp", type=int, default=None,
                   help="a vLLM engine of this TP (colocated on every GPU unless --engine-separate)")
    m.add_argument("--kv-tokens", type=int, default=None, help="KV-cache tokens of each engine")
    m.add_argument("--engine-separate", action="store_true",
                   help="the engine runs on GPUs of its own (trainer.placement.colocate_all=false): printed as its own "
                        "line, not in the trainer's table")
    m.add_argument("--engine-awake", action="store_true",
                   help="the colocated engine keeps its memory during the update (default: it sleeps, vLLM's sleep "
                        "mode, as mlora runs colocated engines on CUDA)")
    m.add_argument("--fit", type=float, default=None, metavar="GPU_GIB",
                   help="list the layouts of --gpus GPUs of this size that fit, best first")
    m.add_argument("--gpus", type=int, default=None, help="GPUs --fit lays the model out on")
    m.add_argument("--reserve-gib", type=float, default=2.0,
                   help="kept free on every GPU by --fit for the CUDA context, NCCL and fragmentation (default 2)")
    m.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_plan)

    p = sub.add_parser("merge", help="merge a PEFT LoRA adapter into an HF checkpoint, streaming")
    p.add_argument("--base", required=True, help="the base: an HF checkpoint directory")
    p.add_argument("--adapter", required=True, help="a PEFT LoRA adapter directory trained on that base")
    p.add_argument("--out", required=True, help="new directory for the merged HF checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_merge)

    p = sub.add_parser("export-adapter", help="PEFT files of an adapter from a training checkpoint")
    p.add_argument("checkpoint", help="a training checkpoint directory (<ckpt_path>/global_step_<k>)")
    p.add_argument("--adapter", default="policy", help="the adapter's name in it (policy, critic, reward, ...)")
    p.add_argument("--out", required=True, help="output directory (PEFT files)")
    p.add_argument("--base", default=None, help="check the adapter against this HF base and record it")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="cast the factors (default: as stored)")
    p.set_defaults(func=_export_adapter)
    return ap


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"mlora {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
