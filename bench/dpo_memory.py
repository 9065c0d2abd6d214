"""Memory of DPO with the reference = the shared base with the adapter off, against an explicit frozen
copy of the base as reference (TRL's default without PEFT).

    .venv/bin/python bench/dpo_memory.py [--work runs/bench_memory]

The 100M-parameter Llama of ``bench/shared_base_memory.py`` (float32); each variant runs in a fresh
process and reports, above the imported interpreter, its resident memory after its work (weights,
adapter, optimizer state; freed activations handed back) and its peak:

- ``base``: the base model alone, one forward pass;
- ``shared``: mlora's DPO engine: one base, ``policy`` LoRA (r 16, all linears), reference = adapter off;
  two DPO steps on 8 pairs x 64 tokens (chosen and rejected in one forward of 16 rows);
- ``explicit``: the same engine, its reference log-probs from a second, frozen copy of the base.

Prints the ratios to the base alone and the second step's DPO loss of both (equal: the reference is
the same function of the same weights).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from shared_base_memory import build_model  # noqa: E402

VARIANTS = ("base", "shared", "explicit")


def _pairs(vocab: int):
    import torch

    from mlora.train.preference_data import SequenceBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (16, 64), generator=g)
    ids[8:, :32] = ids[:8, :32]  # chosen and rejected share their prompt
    resp = torch.zeros_like(ids)
    resp[:, 32:] = 1
    return SequenceBatch(ids, torch.ones_like(ids), resp, pairs=True)


def run_variant(variant: str, model_dir: Path) -> dict:
    import torch

    import mlora
    from mlora.testing.proc_status import reset_peak, rss
    from mlora.train.preference_engine import PreferenceConfig, PreferenceEngine

    mesh = mlora.init_parallel(tp=1, pp=1)
    batch = _pairs(32000)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    start = rss("VmRSS")
    reset_peak()  # the peak-RSS counter := the current RSS
    out: dict = {"variant": variant}
    if variant == "base":
        model = mlora.from_pretrained(model_dir, mesh)
        model.logits(batch.input_ids[:8])
    else:
        model = mlora.from_pretrained(model_dir, mesh)
        cfg = PreferenceConfig(stage="dpo", beta=0.1, micro_batch_size=4, lr=1e-3)
        engine = PreferenceEngine(model, cfg, lora=mlora.LoraConfig(rank=16, alpha=32))
        if variant == "explicit":
            reference_model = mlora.from_pretrained(model_dir, mesh)  # a frozen copy, no adapters

            def reference_logps(b, engine=engine):  # the engine's own pass, on the copy
                own, engine.model = engine.model, reference_model
                try:
                    return PreferenceEngine.reference_logps(engine, b)
                finally:
                    engine.model = own

            engine.reference_logps = reference_logps
        losses = [engine.step(batch)["loss"] for _ in range(2)]
        out["losses"] = losses
    del batch
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed activations back, so "resident" is memory in use
    out.update(resident=rss("VmRSS") - start, peak=rss("VmHWM") - start,
               parameters=sum(p.numel() for p in model.parameters()))
    torch.set_num_threads(torch.get_num_threads())  # keep `torch` referenced until the end
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/bench_memory"))
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    model_dir = args.work / "llama-110m"
    if args.variant:
        print(json.dumps(run_variant(args.variant, model_dir)))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    build_model(model_dir)
    results = {}
    for variant in VARIANTS:
        proc = subprocess.run([sys.executable, __file__, "--work", str(args.work), "--variant", variant],
                              capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        if proc.returncode != 0:
            sys.exit(f"{variant} failed:\n{proc.stderr[-4000:]}")
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    base = results["base"]
    print(f"model: {base['parameters']:,} parameters (float32); memory above the imported interpreter:")
    for v in VARIANTS:
        r = results[v]
        print(f"  {v:9s} resident {r['resident'] / 2**20:7.1f} MiB (x{r['resident'] / base['resident']:.3f})   "
              f"peak {r['peak'] / 2**20:7.1f} MiB (x{r['peak'] / base['peak']:.3f})")
    shared, explicit = results["shared"], results["explicit"]
    print(f"DPO, reference = adapter off on the shared base / base alone: resident "
          f"{shared['resident'] / base['resident']:.3f}x (goal <= 1.12), peak {shared['peak'] / base['peak']:.3f}x")
    print(f"DPO, explicit frozen reference copy / base alone:             resident "
          f"{explicit['resident'] / base['resident']:.3f}x (expected >= 1.9), peak "
          f"{explicit['peak'] / base['peak']:.3f}x")
    print(f"DPO loss, steps 1 and 2: shared {shared['losses']}, explicit copy {explicit['losses']}, "
          f"|difference| {max(abs(a - b) for a, b in zip(shared['losses'], explicit['losses'])):.2e}")


if __name__ == "__main__":
    import records  # the run becomes a record of bench/records.jsonl

    records.main(main, group="Memory")
