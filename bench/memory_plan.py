"""The memory planner against measurement: predicted vs measured peak of a PPO step, per rank.

    .venv/bin/python bench/memory_plan.py [--work runs/bench_memory_plan] [--models tiny 100m]

Grid: the 100M-parameter Llama of ``bench/shared_base_memory.py`` (micro-batch 1, sequences 256
and 1024; TP1, TP2, DP2, TP2×PP2) and the tiny random Llama (micro-batch 2, sequences 256 and 1024;
the same layouts and TP2 with sequence parallelism), recompute none and full, float32 on CPU, LoRA r 16 (100M) / 8 (tiny) on all linears for
actor and critic, two micro-batches per update. One torchrun per world size measures its layouts
in turn (:mod:`mlora.testing.memory_probe`: peak RSS of the second PPO step above the RSS before
the model was loaded, glibc's mmap threshold fixed so that RSS follows tensor bytes); the planner
predicts each (stage, TP rank) from the HF config alone. Prints one row per rank, the largest
relative error, and full recompute / no recompute of the 100M model at sequence 1024 (TP1).

``--glibc-default`` measures with glibc's dynamic mmap threshold left on (what a plain CPU run
sees: freed activations stay in glibc's heap), to show how much the CPU allocator adds.
Records accumulate in ``<work>/records.json`` (``records-glibc.json``), so a subset can be rerun
(``--models``, ``--layouts``); ``--print-only`` reprints the grid from them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {"TP1": (1, 1, False, 1), "TP2": (2, 1, False, 2), "DP2": (1, 1, False, 2), "TP2xPP2": (2, 2, False, 4),
           "TP2+SP": (2, 1, True, 2)}  # tp, pp, sp, world
MODELS = {"tiny": dict(micro_batch=2, rank=8, seqs=(256, 1024), layouts=tuple(LAYOUTS)),
          "100m": dict(micro_batch=1, rank=16, seqs=(256, 1024), layouts=("TP1", "TP2", "DP2", "TP2xPP2"))}
MIB = 1 << 20


def build_models(work: Path, names: list[str]) -> dict[str, Path]:
    """The HF checkpoints of the grid (built once, reused)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from shared_base_memory import build_model

    from mlora.testing import build_tiny_model

    paths = {}
    if "tiny" in names:
        paths["tiny"] = work / "tiny-llama"
        if not (paths["tiny"] / "config.json").exists():
            build_tiny_model("llama", paths["tiny"])
    if "100m" in names:
        paths["100m"] = work / "llama-110m"
        build_model(paths["100m"])
    return paths


def grid(paths: dict[str, Path], layouts: list[str]) -> dict[int, list[dict]]:
    """Probe configurations by world size."""
    by_world: dict[int, list[dict]] = {}
    for model, path in paths.items():
        m = MODELS[model]
        for layout in (name for name in layouts if name in m["layouts"]):
            tp, pp, sp, world = LAYOUTS[layout]
            for seq in m["seqs"]:
                for recompute in ("none", "full"):
                    by_world.setdefault(world, []).append(dict(
                        name=f"{model} {layout} s{seq} {recompute}", model=str(path), tp=tp, pp=pp, sp=sp, seq=seq,
                        micro_batch=m["micro_batch"], micro_batches=2, rank=m["rank"], recompute=recompute))
    return by_world


def records_file(work: Path, glibc_default: bool) -> Path:
    return work / ("records-glibc.json" if glibc_default else "records.json")


def load_records(work: Path, glibc_default: bool, names: set[str]) -> list[dict]:
    """Stored records of the configurations ``names`` (every run adds to one file per allocator setting)."""
    path = records_file(work, glibc_default)
    return [r for r in json.loads(path.read_text()) if r["config"] in names] if path.exists() else []


def measure(by_world: dict[int, list[dict]], work: Path, glibc_default: bool) -> list[dict]:
    records = []
    suffix = "-glibc" if glibc_default else ""
    for world, configs in sorted(by_world.items()):
        cfg_file, out = work / f"configs-w{world}{suffix}.json", work / f"records-w{world}{suffix}.json"
        cfg_file.write_text(json.dumps(configs, indent=1))
        print(f"measuring {len(configs)} configurations on {world} rank(s) ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--standalone",
               "-m", "mlora.testing.memory_probe", str(cfg_file), str(out)] + (["--glibc-default"] if glibc_default else [])
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, 2 // world)), "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode != 0:
            sys.exit(f"world {world} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        records += json.loads(out.read_text())
        names = {r["config"] for r in records}
        path = records_file(work, glibc_default)
        kept = [r for r in json.loads(path.read_text()) if r["config"] not in names] if path.exists() else []
        path.write_text(json.dumps(kept + records, indent=1))
    return records


def compare(records: list[dict], default: dict[tuple, dict] | None = None) -> list[dict]:
    """Records joined with the planner's prediction for their (stage, TP rank)."""
    from mlora.testing.memory_probe import ProbeConfig, planned

    fields = ProbeConfig.__dataclass_fields__
    plans: dict[str, dict] = {}
    rows = []
    for r in records:
        cfg = ProbeConfig(**{k: r[k] for k in fields})
        if cfg.name not in plans:
            plans[cfg.name] = planned(cfg, r["world"])
        p = plans[cfg.name][(r["stage"], r["tp_rank"])]
        row = {"name": cfg.name, "rank": r["rank_id"], "stage": r["stage"], "tp_rank": r["tp_rank"],
               "measured": r["peak"], "predicted": p["peak"], "phase": p["phase"],
               "exact": (p["base"], p["adapters"], p["heads"]) == (r["base"], r["adapters"], r["heads"])}
        if default is not None and (cfg.name, r["rank_id"]) in default:
            row["glibc"] = default[(cfg.name, r["rank_id"])]["peak"]
        rows.append(row)
    return rows


def report(rows: list[dict]) -> None:
    glibc = any("glibc" in r for r in rows)
    print(f"{'configuration':28s} {'rank':>4s} {'stage':>5s} {'tp':>3s} {'measured MiB':>13s} {'predicted MiB':>14s} "
          f"{'error':>7s}" + (f" {'glibc default MiB':>18s}" if glibc else "") + "  peak at (planner)")
    for r in rows:
        err = r["predicted"] / r["measured"] - 1
        line = (f"{r['name']:28s} {r['rank']:>4d} {r['stage']:>5d} {r['tp_rank']:>3d} {r['measured'] / MIB:13.1f} "
                f"{r['predicted'] / MIB:14.1f} {err:+7.1%}")
        if glibc:
            line += f" {r['glibc'] / MIB:18.1f}" if "glibc" in r else f" {'':18s}"
        print(line + f"  {r['phase']}" + ("" if r["exact"] else "  WEIGHTS NOT EXACT"))
    worst = max(rows, key=lambda r: abs(r["predicted"] / r["measured"] - 1))
    print(f"largest error: {worst['predicted'] / worst['measured'] - 1:+.1%} ({worst['name']}, rank {worst['rank']}); "
          f"base, adapter and head bytes equal parameter_bytes() on {sum(r['exact'] for r in rows)}/{len(rows)} ranks")
    for model in MODELS:
        full = [r for r in rows if r["name"] == f"{model} TP1 s1024 full"]
        none = [r for r in rows if r["name"] == f"{model} TP1 s1024 none"]
        if full and none:
            print(f"{model} TP1 s1024: full recompute peak / no recompute peak = measured "
                  f"{full[0]['measured'] / none[0]['measured']:.3f}, predicted {full[0]['predicted'] / none[0]['predicted']:.3f}"
                  + (f", glibc default {full[0]['glibc'] / none[0]['glibc']:.3f}" if "glibc" in full[0] else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/bench_memory_plan"))
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--glibc-default", action="store_true", help="also measure with glibc's dynamic mmap threshold")
    ap.add_argument("--print-only", action="store_true", help="reprint the records of an earlier run")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.work.mkdir(parents=True, exist_ok=True)
    paths = build_models(args.work, args.models)
    by_world = grid(paths, args.layouts)
    if args.print_only:
        names = {c["name"] for configs in by_world.values() for c in configs}
        records, glibc = load_records(args.work, False, names), load_records(args.work, True, names)
    else:
        records = measure(by_world, args.work, glibc_default=False)
        glibc = measure(by_world, args.work, glibc_default=True) if args.glibc_default else []
    default = {(r["config"], r["rank_id"]): r for r in glibc} if glibc else None
    report(compare(records, default))


if __name__ == "__main__":
    import records  # the run becomes a record of bench/records.jsonl

    records.main(main, group="Memory")
