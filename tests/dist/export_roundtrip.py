"""torchrun worker for adapter export: train a step, save_adapter / save_merged, reload on other meshes.

Usage: torchrun ... export_roundtrip.py MODELS_DIR REFS_DIR WORK_DIR PHASE
PHASE "mesh4" (4 ranks): at TP2xPP2 load the PEFT adapter `policy`, add a q/v-only adapter `qv`,
train both one AdamW step, save both and the merged model, record logits; then reload the saved
files at TP2xPP2 and at (TP1, PP2, DP2) and save them again.
PHASE "mesh1" (1 rank): reload at TP1, save again, record logits.
Every save in "mesh4" runs with torch.distributed's object (pickling) collectives made to raise.
"mesh4" also runs the no-gather case (:func:`no_gather_case`): at TP2xPP2 a large random r 1024
adapter is loaded, saved with save_adapter, relayed to rank 0 (a target only rank 0 sees) and saved
through save_checkpoint, while each rank measures its peak extra memory (VmHWM) and the bytes of every
collective; each rank writes nogather_rank<r>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import masked_sum_loss

import mlora
from mlora.parallel import reset_parallel

MODELS = ("llama", "qwen2")
OBJECT_COLLECTIVES = ("gather_object", "all_gather_object", "broadcast_object_list", "scatter_object_list")
BIG_RANK = 1024  # r of the no-gather case: ~12 MiB per rank, far above the measurement's noise


@contextlib.contextmanager
def no_object_collectives():
    """Inside the block, any pickling collective raises (on torch.distributed and on distributed_c10d)."""
    import torch.distributed.distributed_c10d as c10d

    saved = []
    for module in (dist, c10d):
        for name in OBJECT_COLLECTIVES:
            def refuse(*args, _name=name, **kwargs):
                raise AssertionError(f"torch.distributed.{_name} was called: adapter and checkpoint saving "
                                     "must not pickle through object collectives")
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, refuse)
    try:
        yield
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)


def _measured(fn):
    """``fn()`` under no_object_collectives and collective accounting: (peak extra RSS bytes, collective
    bytes, ops, seconds, os.fsync calls). RSS is trimmed and the high-water mark reset first (see mlora.testing.memory_probe)."""
    from mlora.parallel.accounting import count_collectives, summarize
    from mlora.testing.memory_probe import trim
    from mlora.testing.proc_status import reset_peak, rss

    trim()
    dist.barrier()  # after the trim: a slow trim on one rank would count as save time on the others
    reset_peak()
    before = rss()
    fsyncs, real_fsync = [], os.fsync

    def counted_fsync(fd):
        fsyncs.append(fd)
        return real_fsync(fd)

    t0 = time.perf_counter()
    os.fsync = counted_fsync
    try:
        with no_object_collectives(), count_collectives() as calls:
            fn()
    finally:
        os.fsync = real_fsync
    seconds = time.perf_counter() - t0
    peak = rss("VmHWM") - before
    return (peak, sum(c.nbytes for c in calls), {k: list(v) for k, v in summarize(calls).items()}, seconds,
            len(fsyncs))


def no_gather_case(models_dir: Path, work: Path, mesh) -> None:
    """save_adapter and save_checkpoint of a large adapter at TP2xPP2: no object collective, no tensor
    collective carrying adapter bytes, peak extra memory per rank measured against the rank's share."""
    from mlora.checkpoint.dirs import save_checkpoint
    from mlora.export.peft_files import peft_adapter_config, write_peft_adapter, write_peft_adapter_sharded
    from mlora.export.plan import plan_adapter
    from mlora.formats.durable import fsync_file
    from mlora.testing.memory_probe import fix_mmap_threshold

    fix_mmap_threshold()  # freed tensors go back to the OS, so RSS follows tensor bytes
    w = work / "nogather"
    model = mlora.from_pretrained(models_dir / "llama", mesh)
    cfg = mlora.LoraConfig(rank=BIG_RANK, alpha=16)
    if mesh.rank == 0:  # a random adapter written by the single-process writer: the reference bytes
        plan = plan_adapter(model.spec, 1, 1, cfg, dtype=torch.float32)
        g = torch.Generator().manual_seed(11)
        tensors = {n: torch.randn(shape, generator=g) for n, shape in plan.tensors.items()}
        modules = {(int(n.split(".")[4]), n.split(".")[-3]) for n in tensors}
        write_peft_adapter(w / "source", tensors, peft_adapter_config(cfg, modules, model.spec.num_layers,
                                                                     str(model.hf_dir), model.spec.architecture))
        del tensors
    dist.barrier()
    model.load_adapter("big", w / "source")
    share = sum(p.numel() * p.element_size() for p in model.adapter_parameters("big"))
    model.save_adapter("big", w / "warmup")  # first use of the code path (imports, gloo buffers): not measured
    record = {"rank": mesh.rank, "share": share}
    # only rank 0's out_dir counts (the loop passes per-process /dev/shm paths on the other ranks)
    out = w / "saved" if mesh.rank == 0 else w / f"elsewhere{mesh.rank}"
    record["adapter"] = _measured(lambda: model.save_adapter("big", out))
    config = None
    if mesh.rank == 0:
        info = model.adapters["big"]
        config = peft_adapter_config(info.config, set(info.modules), model.spec.num_layers, str(model.hf_dir),
                                     model.spec.architecture)
    # a target only rank 0 can see: every other rank relays its shards to rank 0, one at a time
    record["relay"] = _measured(lambda: write_peft_adapter_sharded(
        w / "relayed", model.adapter_layout("big"), model.adapter_shards("big"), config, direct=False))

    def write(tmp: Path) -> list[Path]:
        model.save_adapter("big", tmp / "adapters" / "big")
        own = tmp / "ranks" / f"rank{mesh.rank}.bin"
        own.parent.mkdir(parents=True, exist_ok=True)
        own.write_bytes(bytes(mesh.rank + 1))
        fsync_file(own)
        files = [own]
        if mesh.rank == 0:
            files += sorted((tmp / "adapters" / "big").iterdir())
        return files

    record["checkpoint"] = _measured(lambda: save_checkpoint(w / "ckpt", 1, mesh, write, {"base_model": {}}))
    try:  # rank 0 cannot create the directory (a file is in the way): every rank must raise, none hang
        model.save_adapter("big", w / "source" / "adapter_config.json" / "sub")
        record["failure"] = None
    except Exception as exc:  # noqa: BLE001 - recorded for the test to check
        record["failure"] = f"{type(exc).__name__}: {exc}"
    (w / f"nogather_rank{mesh.rank}.json").write_text(json.dumps(record))
    dist.barrier()


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
            with no_object_collectives():
                model.save_adapter("policy", w / "policy_mesh4")
                model.save_adapter("qv", w / "qv_mesh4")
                model.save_merged(w / "merged_policy", adapters=["policy"])
            del model, opt
        if mesh.rank == 0:
            (args.work / "nogather").mkdir()
        no_gather_case(args.models_dir, args.work, mesh)
        reset_parallel()
        reload_and_save(args.models_dir, args.work, 2, 2, "mesh4again")
        reload_and_save(args.models_dir, args.work, 1, 2, "mesh2dp2")
    else:
        reload_and_save(args.models_dir, args.work, 1, 1, "mesh1")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
