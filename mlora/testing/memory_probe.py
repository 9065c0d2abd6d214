"""Measured peak memory of a PPO step, per rank, for checking the memory planner (CPU).

    torchrun --nproc_per_node W -m mlora.testing.memory_probe CONFIGS_JSON OUT_JSON [--glibc-default]

``CONFIGS_JSON`` is a list of configurations (see :class:`ProbeConfig`). They run in turn in the
same processes, grouped by layout: the mesh is built once per layout and an unmeasured warm-up
configuration runs first (the first PPO step of a process loads libraries and builds kernels, ~60 MB
here whatever the model, and the first collectives of new groups set up gloo's buffers). Per
configuration and rank:

1. ``gc`` + ``malloc_trim``; ``start`` = VmRSS (the imported interpreter with its process groups);
2. the model is loaded, the engine built (``policy`` and ``critic`` LoRA, value head, two AdamW);
3. a PPO step on a 16-token batch creates the optimizer states (the planner predicts the steady
   state, in which both optimizers hold their moments);
4. ``gc`` + ``malloc_trim``, the peak counter is reset (``echo 5 > /proc/self/clear_refs``), and
   one PPO step runs on the real batch; the counter is read and reset at each phase boundary
   (forward-only passes, actor update, critic update), which changes no allocation, so the step's
   peak is the largest phase peak;
5. ``peak`` = that largest VmHWM − ``start``; the model is dropped.

The allocator: glibc raises its mmap threshold to the size of each freed block (up to 32 MiB); after
that, freed activations stay in its heap and RSS overstates the memory in use (+43% peak on the
100M model), and blocks under the threshold fragment the heap (a few MB on the tiny model). Unless
``--glibc-default``, each process therefore fixes the threshold at 8 KiB with ``mallopt`` (which
also turns the raising off): every tensor of 8 KiB or more gets its own mapping, returned to the OS
when freed, so RSS follows the bytes tensors occupy, which is what the planner predicts and what a
GPU's caching allocator reports as allocated. Rank 0 writes every rank's records to ``OUT_JSON``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import inspect
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from mlora.testing.proc_status import reset_peak, rss


@dataclass(frozen=True)
class ProbeConfig:
    """One measured configuration (a row of the planner's validation grid)."""

    name: str
    model: str  # HF model directory
    tp: int = 1
    pp: int = 1
    sp: bool = False
    seq: int = 64
    micro_batch: int = 1
    micro_batches: int = 2  # per update and DP rank (>= pp fills the 1F1B pipeline)
    rank: int = 8
    recompute: str = "none"
    critic: bool = True
    extra: dict = field(default_factory=dict)  # further from_pretrained keywords (attention, fp8, dtype by name)


def trim() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so RSS is memory in use."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
PROBE_MMAP_THRESHOLD = 8 * 1024  # fixed (setting it turns off the dynamic raise), below most tensors


def fix_mmap_threshold(threshold: int = PROBE_MMAP_THRESHOLD) -> None:
    """Make glibc return every freed block of ``threshold`` bytes or more to the OS (see the module docstring)."""
    if ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def model_kwargs(cfg: ProbeConfig) -> dict:
    """``from_pretrained`` keywords for ``cfg`` that this version of mlora accepts; a keyword it
    lacks is an error unless it asks for the default (so a grid runs before recompute exists)."""
    import torch

    import mlora

    accepted = inspect.signature(mlora.from_pretrained).parameters
    wanted = {"recompute": cfg.recompute, "dtype": "float32", **cfg.extra}
    wanted["dtype"] = getattr(torch, wanted["dtype"])
    kwargs = {}
    for key, value in wanted.items():
        if key in accepted:
            kwargs[key] = value
        elif not (key == "recompute" and value == "none"):
            raise TypeError(f"from_pretrained does not accept {key}={value!r} yet")
    return kwargs


def synthetic_batch(cfg: ProbeConfig, vocab: int, dp: int, seq: int, seed: int = 0):
    """``micro_batch × micro_batches × dp`` unpadded sequences of ``seq`` tokens; the second half is
    the response."""
    import torch

    from mlora.train.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    n = cfg.micro_batch * cfg.micro_batches * dp
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    resp = torch.zeros_like(ids)
    resp[:, seq // 2:] = 1
    return RolloutBatch(ids, torch.ones_like(ids), resp, torch.rand(n, generator=g))


class PhasePeaks:
    """Wraps the step's passes (:mod:`mlora.train.joint_passes`) so that each phase's peak RSS is read and the
    counter reset at its end (no allocation changes; the step's peak is the largest phase peak). A context
    manager: the passes are restored on exit."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}

    def __enter__(self) -> "PhasePeaks":
        from mlora.train import joint_passes

        self._saved = fwd, upd = joint_passes.forward, joint_passes.update

        def forward(joint, parts, adapters, routed, fns, hidden, trailing):
            try:
                return fwd(joint, parts, adapters, routed, fns, hidden, trailing)
            finally:
                names = [*adapters, *routed.values()]
                self._close("values" if hidden else f"forward[{','.join(names) or 'base'}]")

        def update(*args, hidden, **kwargs):
            try:
                return upd(*args, hidden=hidden, **kwargs)
            finally:
                self._close("critic_update" if hidden else "actor_update")

        joint_passes.forward, joint_passes.update = forward, update
        return self

    def __exit__(self, *exc) -> None:
        from mlora.train import joint_passes

        joint_passes.forward, joint_passes.update = self._saved

    def _close(self, phase: str) -> None:
        self.peaks[phase] = max(self.peaks.get(phase, 0), rss("VmHWM"))
        reset_peak()


def measure(cfg: ProbeConfig) -> dict:
    """Build the trainer for ``cfg`` on the current mesh, run the warm-up and the measured step."""

    import mlora
    from mlora.train.config import PPOConfig
    from mlora.train.engine import ActorCriticEngine

    mesh = mlora.init_parallel(tp=cfg.tp, pp=cfg.pp, sp=cfg.sp)
    trim()
    start = rss()
    model = mlora.from_pretrained(cfg.model, mesh, **model_kwargs(cfg))
    lora = dict(rank=cfg.rank, alpha=2 * cfg.rank)
    per_update = cfg.micro_batch * cfg.micro_batches * mesh.dp
    ppo = PPOConfig(advantage_estimator="gae" if cfg.critic else "grpo", mini_batch_size=per_update,
                    micro_train_batch_size=cfg.micro_batch, micro_forward_batch_size=cfg.micro_batch,
                    n_samples_per_prompt=1 if cfg.critic else 2)
    engine = ActorCriticEngine(model, ppo, policy_lora=mlora.LoraConfig(**lora),
                               critic_lora=mlora.LoraConfig(**lora, seed=1))
    vocab = model.spec.vocab_size
    engine.step(synthetic_batch(cfg, vocab, mesh.dp, 16, seed=1))  # optimizer states, first-call paths
    batch = synthetic_batch(cfg, vocab, mesh.dp, cfg.seq)
    with PhasePeaks() as phases:
        trim()
        before = rss()
        reset_peak()
        engine.step(batch)
    peak = max(phases.peaks.values())
    record = {"config": cfg.name, **asdict(cfg), "rank_id": mesh.rank, "world": mesh.world_size, "stage": mesh.pp_rank, "tp_rank": mesh.tp_rank,
              "dp_rank": mesh.dp_rank, "start": start, "resident": before - start, "peak": peak - start,
              "phases": {k: v - start for k, v in phases.peaks.items()}, **model.parameter_bytes()}
    del engine, model, phases
    trim()
    return record


def planned(cfg: ProbeConfig, world: int) -> dict[tuple[int, int], dict]:
    """The memory planner's prediction for ``cfg`` on ``world`` ranks: (stage, TP rank) -> fields."""
    import torch

    from mlora.formats.hf_config import load_hf_config, model_spec
    from mlora.plan import Layout, Workload, plan_memory

    spec = model_spec(load_hf_config(cfg.model))
    layout = Layout(tp=cfg.tp, pp=cfg.pp, dp=world // (cfg.tp * cfg.pp), sp=cfg.sp)
    workload = Workload(micro_batch=cfg.micro_batch, seq=cfg.seq, micro_batches=cfg.micro_batches, rank=cfg.rank,
                        critic=cfg.critic, dtype=getattr(torch, cfg.extra.get("dtype", "float32")),
                        fp8=cfg.extra.get("fp8"), attention=cfg.extra.get("attention", "sdpa"), recompute=cfg.recompute)
    return {(r.stage, r.tp_rank): r.as_dict() for r in plan_memory(spec, layout, workload).ranks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--glibc-default", action="store_true", help="leave glibc's dynamic mmap threshold on")
    ap.add_argument("--mmap-threshold", type=int, default=PROBE_MMAP_THRESHOLD, help="bytes (default 8 KiB)")
    args = ap.parse_args()
    if not args.glibc_default:
        fix_mmap_threshold(args.mmap_threshold)
    import torch.distributed as dist

    import mlora
    import mlora.train.engine  # noqa: F401  (imported before any start is read)
    from mlora.parallel import reset_parallel

    configs = [ProbeConfig(**c) for c in json.loads(args.configs.read_text())]
    records = []
    layouts: dict[tuple, list[ProbeConfig]] = {}
    for cfg in configs:
        layouts.setdefault((cfg.tp, cfg.pp, cfg.sp), []).append(cfg)
    began = time.time()
    for group in layouts.values():
        mlora.init_parallel(tp=group[0].tp, pp=group[0].pp, sp=group[0].sp)
        # unmeasured: the process's first step loads libraries; the mesh's groups set up their buffers
        measure(replace(group[0], name="warm-up", seq=16, micro_batch=1))
        for cfg in group:
            records.append(measure(cfg))
            if dist.get_rank() == 0:
                print(f"[{time.time() - began:6.0f} s] {cfg.name}: peak {records[-1]['peak'] / 2**20:.1f} MiB (rank 0)",
                      file=sys.stderr, flush=True)
        reset_parallel()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps([r for rs in gathered for r in rs], indent=1))
    dist.barrier()
    dist.destroy_process_group()



if __name__ == "__main__":
    main()
