"""A peer side by side on the real model: SFT and DPO steps of mlora against TRL + PEFT.

    .venv/bin/python bench/vs_trl.py [--quick] [--steps N] [--reps N] [--threads N] [--clock wall|cpu]
                                     [--stages sft,dpo] [--dtypes float32,bfloat16[,bfloat16-lora16]]
                                     [--checkpointing] [--no-memory] [--json OUT]

Model: SmolLM2-135M-Instruct (:mod:`mlora.models.smollm2`, HF float32; loaded in bf16 for the bf16 rows).
Workloads (the same token ids for both libraries, no padding, so both see exactly these shapes):

- SFT: batch 4 x 256 tokens (prompt 128 + response 128; loss on the response tokens);
- DPO: 4 pairs, prompt 64 + chosen 128 / rejected 128 (8 rows x 192 tokens in one forward), beta 0.1.

Same LoRA on both sides: rank 16, alpha 32, all linear layers (q k v o gate up down), dropout 0; AdamW,
lr 1e-4, max_grad_norm 1.0; one micro-batch per step (no gradient accumulation); no activation
checkpointing (mlora's default; TRL defaults to ``gradient_checkpointing=True``, switched off here so that
both keep every activation; ``--checkpointing`` runs both with it: mlora ``recompute="full"``, TRL
``gradient_checkpointing=True``).

- ``mlora``: one process, TP1 (a single-process gloo mesh), the way ``mlora-train --config-name sft | dpo``
  does it (:mod:`mlora.train.preference_stage`): ``mlora.from_pretrained(dtype=...)`` ->
  :class:`~mlora.train.preference_engine.PreferenceEngine` (stage ``sft`` / ``dpo``; DPO's reference = the
  base with the adapter off) -> ``engine.step(collate(examples))``. bf16 = bf16 base + float32 LoRA masters
  that also compute in float32 (``trainer.lora_compute_dtype`` unset, the default). The extra dtype
  ``bfloat16-lora16`` sets ``lora_compute_dtype=bfloat16`` (masters still float32, cast down per forward).
- ``trl``: TRL's own ``SFTTrainer`` / ``DPOTrainer`` driven by ``Trainer.train()`` (not a re-implemented
  loop), ``peft_config=LoraConfig(...)`` (TRL wraps the model with ``get_peft_model``: PEFT's default
  ``autocast_adapter_dtype=True``, i.e. float32 adapters on a bf16 base), ``use_cpu=True``, ``bf16=True``
  for the bf16 rows (accelerate's CPU autocast: the LoRA GEMMs then run in bf16), TRL's default optimizer
  (``adamw_torch_fused``), DPO's reference = the PEFT model with its adapter disabled (TRL's default with
  ``peft_config``). The data goes in pre-tokenized (SFT: ``input_ids`` + ``completion_mask`` with
  ``completion_only_loss``; DPO: ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids`` set as the trainer's
  dataset after construction), in order (``train_sampling_strategy="sequential"``), so both libraries
  train on the same batches.

Time: per (stage, dtype) one process holds both trainers and alternates their steps (TRL's step k, then
mlora's step k from TRL's ``on_step_end`` callback), so both see the same load on a shared machine; the
first step of each is an unmeasured warm-up; glibc's default allocator. mlora's step is ``collate`` +
``engine.step``; TRL's runs from the callback's return to the next ``on_step_end`` (next batch, forward,
backward, clip, AdamW, scheduler, zero_grad). Reported: best and median over ``--reps`` x ``--steps``
of wall-clock seconds (``--clock wall``, default) or of the process's CPU seconds (``--clock cpu``: on a
machine shared with other work, with ``--threads 1``, the figure other tenants do not inflate; with more
threads, threads spinning at a barrier for a descheduled sibling count as CPU time too), and the wall
seconds per step of each phase (mlora ``ref`` DPO reference pass, ``fwd`` policy forward + loss,
``bwd`` backward + gradient finalize, ``opt`` clip + AdamW, ``data`` collate; TRL ``fwd``
``compute_loss`` (policy forward and, for DPO, the reference forward with the adapter disabled), ``bwd``
backward + clip, ``opt`` AdamW, ``data`` the rest).

Peak memory: a fresh process per (library, stage, dtype) with glibc's mmap threshold fixed at 8 KiB as
:mod:`mlora.testing.memory_probe` does (every tensor of 8 KiB or more gets its own mapping and goes back
to the OS when freed, so RSS follows the bytes tensors occupy, as a GPU allocator's "allocated" would).
Torch, transformers, peft, trl, datasets, megatron and mlora are imported before the baseline is read
(in both). One warm-up step (optimizer state, first-call paths); then the peak counter
(``/proc/self/clear_refs``) is reset and read at each phase boundary of one more step. Reported: the
step's peak above the imported interpreter (weights, adapters, optimizer state, activations), the resident
memory before it, and the peak per phase.

Sanity: the warm-up step of both runs on the same batch with the same weights (LoRA B = 0), so the SFT
loss and DPO's ``logps/chosen`` agree (printed: equal in float32 and for the bf16 SFT loss; DPO's bf16
``logps/chosen`` differ by ~4e-4 relative, as TRL's fused LM head multiplies the bf16 hidden states in
float32 on CPU while mlora's logits are bf16), as do the trainable parameter counts.

Run time: the default run took 9.5 min on the 2-core build machine while it was nearly idle, ~35 min with
``--threads 1`` under a load average of ~10 from other work. On a busy machine wall-clock figures swing by
2-3x from step to step; ``--threads 1 --clock cpu`` gives figures the load does not skew.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

LIBS = ("mlora", "trl")
STAGES = ("sft", "dpo")
DTYPES = ("float32", "bfloat16", "bfloat16-lora16")
RANK, ALPHA, LR, SEED = 16, 32, 1e-4, 0
SFT_BATCH, SFT_PROMPT, SFT_RESPONSE = 4, 128, 128
DPO_PAIRS, DPO_PROMPT, DPO_RESPONSE = 4, 64, 128
DPO_BETA = 0.1


# ---------------------------------------------------------------------- the data (same ids for both)
def _token_rows(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random ids away from the special tokens (SmolLM2's first ids are specials)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n, length), generator=g).tolist()


def sft_examples(n: int, vocab: int) -> list[tuple[list[int], list[int]]]:
    rows = _token_rows(n, SFT_PROMPT + SFT_RESPONSE, vocab, 1)
    return [(r[:SFT_PROMPT], r[SFT_PROMPT:]) for r in rows]


def dpo_examples(n: int, vocab: int) -> list[tuple[list[int], list[int], list[int]]]:
    prompts = _token_rows(n, DPO_PROMPT, vocab, 2)
    chosen = _token_rows(n, DPO_RESPONSE, vocab, 3)
    rejected = _token_rows(n, DPO_RESPONSE, vocab, 4)
    return list(zip(prompts, chosen, rejected))


def batch_size(stage: str) -> int:
    return SFT_BATCH if stage == "sft" else DPO_PAIRS


# ---------------------------------------------------------------------- phases: seconds or peak RSS
class Phases:
    """Seconds per phase (``timing``) or peak RSS per phase (``memory``: VmHWM read and reset at each
    boundary, which allocates nothing)."""

    def __init__(self) -> None:
        self.mode: str | None = None
        self.peaks: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.last = 0.0
        self.resident = 0

    def timing(self) -> None:
        self.mode, self.last = "time", time.perf_counter()

    def restart_clock(self) -> None:
        self.last = time.perf_counter()

    def memory(self) -> None:
        from mlora.testing.memory_probe import trim
        from mlora.testing.proc_status import reset_peak, rss

        trim()
        self.resident = rss()
        reset_peak()
        self.mode = "mem"

    def stop(self) -> None:
        self.mode = None

    def close(self, name: str) -> None:
        if self.mode == "time":
            now = time.perf_counter()
            self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
            self.last = now
        elif self.mode == "mem":
            from mlora.testing.proc_status import reset_peak, rss

            self.peaks[name] = max(self.peaks.get(name, 0), rss("VmHWM"))
            reset_peak()


# ---------------------------------------------------------------------- mlora
def build_mlora(stage: str, dtype: str, model_dir: Path, nsteps: int, checkpointing: bool, phases: Phases):
    """mlora's engine on the model; returns ``step(i) -> metrics`` (batch i)."""
    import torch

    import mlora
    from mlora.train.preference_data import Example, collate
    from mlora.train.preference_engine import PreferenceConfig, PreferenceEngine

    mesh = mlora.init_parallel(tp=1, pp=1)
    base_dtype = "bfloat16" if dtype.startswith("bfloat16") else dtype
    model = mlora.from_pretrained(model_dir, mesh, dtype=getattr(torch, base_dtype),
                                  recompute="full" if checkpointing else "none",
                                  lora_compute_dtype=torch.bfloat16 if dtype == "bfloat16-lora16" else None)
    vocab, n = model.spec.vocab_size, batch_size(stage)
    if stage == "sft":
        examples = [Example(p, (r,)) for p, r in sft_examples(n * nsteps, vocab)]
    else:
        examples = [Example(p, (c, r)) for p, c, r in dpo_examples(n * nsteps, vocab)]
    cfg = PreferenceConfig(stage=stage, beta=DPO_BETA, micro_batch_size=n, lr=LR, max_grad_norm=1.0,
                           total_steps=nsteps)
    engine = PreferenceEngine(model, cfg, lora=mlora.LoraConfig(rank=RANK, alpha=ALPHA, dropout=0.0,
                                                                target_modules="all-linear", seed=SEED))
    # phase boundaries
    ref_fn, loss_fn_factory, fwd_bwd, opt_step = (engine.reference_logps, engine._loss_fn, engine.forward_backward,
                                                  engine.opt.step)

    def reference_logps(batch):
        out = ref_fn(batch)
        phases.close("ref")
        return out

    def _loss_fn(batch):
        fn = loss_fn_factory(batch)

        def wrapped(output, mb):
            out = fn(output, mb)
            phases.close("fwd")
            return out
        return wrapped

    def forward_backward(batch):
        out = fwd_bwd(batch)
        phases.close("bwd")
        return out

    def opt_step_(*a, **k):
        out = opt_step(*a, **k)
        phases.close("opt")
        return out

    engine.reference_logps, engine._loss_fn, engine.forward_backward = reference_logps, _loss_fn, forward_backward
    engine.opt.step = opt_step_

    def step(i: int) -> dict:
        batch = collate(examples[i * n:(i + 1) * n], 0, pairs=stage == "dpo")  # no padding in these batches
        phases.close("data")  # with the previous step's scheduler step and zero_grad
        return engine.step(batch)

    step.trainable = sum(p.numel() for p in engine.params)
    return step


# ---------------------------------------------------------------------- TRL
def build_trl(stage: str, dtype: str, model_dir: Path, nsteps: int, checkpointing: bool, phases: Phases,
              work: Path, on_step_end):
    """TRL's trainer for ``nsteps`` steps; ``on_step_end(k)`` is called after its k-th step (1-based).
    Returns the trainer and a list that receives the first step's loss (and DPO ``logps/chosen``)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    base_dtype = "bfloat16" if dtype.startswith("bfloat16") else dtype
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, base_dtype))
    vocab, n = model.config.vocab_size, batch_size(stage)
    peft_config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules="all-linear",
                             task_type="CAUSAL_LM")
    common = dict(output_dir=str(work / f"trl_{stage}_{dtype}"), per_device_train_batch_size=n,
                  gradient_accumulation_steps=1, learning_rate=LR, max_grad_norm=1.0, max_steps=nsteps,
                  use_cpu=True, bf16=base_dtype == "bfloat16", fp16=False, gradient_checkpointing=checkpointing,
                  report_to="none", save_strategy="no", logging_steps=10 ** 6, disable_tqdm=True, seed=SEED,
                  train_sampling_strategy="sequential", dataloader_num_workers=0)
    if stage == "sft":
        from trl import SFTConfig, SFTTrainer

        rows = [{"input_ids": p + r, "completion_mask": [0] * len(p) + [1] * len(r)}
                for p, r in sft_examples(n * nsteps, vocab)]
        args = SFTConfig(**common, completion_only_loss=True, max_length=SFT_PROMPT + SFT_RESPONSE)
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                             peft_config=peft_config)
    else:
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(**common, beta=DPO_BETA, max_length=DPO_PROMPT + DPO_RESPONSE)
        dummy = Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}])
        trainer = DPOTrainer(model=model, args=args, train_dataset=dummy, processing_class=tok,
                             peft_config=peft_config)
        # the exact token ids, as the trainer's own tokenisation leaves them
        trainer.train_dataset = Dataset.from_list([{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r}
                                                   for p, c, r in dpo_examples(n * nsteps, vocab)])
    compute_loss, first = trainer.compute_loss, []

    def wrapped_compute_loss(*a, **k):
        out = compute_loss(*a, **k)
        phases.close("fwd")
        if not first:  # the warm-up step's
            first.append(float(out.detach()))
            if stage == "dpo":
                first.append(trainer._metrics["train"]["logps/chosen"][-1])
        return out

    trainer.compute_loss = wrapped_compute_loss
    count = [0]

    class Hooks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            phases.close("data")

        def on_pre_optimizer_step(self, args, state, control, **kw):
            phases.close("bwd")

        def on_optimizer_step(self, args, state, control, **kw):
            phases.close("opt")

        def on_step_end(self, args, state, control, **kw):
            count[0] += 1
            on_step_end(count[0])

    trainer.add_callback(Hooks())
    trainer.trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return trainer, first


# ---------------------------------------------------------------------- workers
def _imports() -> None:
    """What either library loads, imported before the memory baseline in both workers."""
    import datasets  # noqa: F401
    import megatron.core  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import trl  # noqa: F401

    import mlora  # noqa: F401
    import mlora.train.preference_engine  # noqa: F401


def memory_worker(lib: str, stage: str, dtype: str, model_dir: Path, checkpointing: bool, work: Path) -> dict:
    """A warm-up step, then one step with the peak read per phase; bytes above the imported interpreter."""
    from mlora.testing.memory_probe import fix_mmap_threshold, trim
    from mlora.testing.proc_status import rss

    fix_mmap_threshold()
    _imports()
    import torch

    torch.manual_seed(SEED)
    trim()
    start = rss()
    phases = Phases()
    if lib == "mlora":
        step = build_mlora(stage, dtype, model_dir, 2, checkpointing, phases)
        metrics = step(0)
        first = {k: metrics[k] for k in ("loss", "logps/chosen") if k in metrics}
        phases.memory()
        step(1)
        phases.close("data")
        trainable = step.trainable
    else:
        trainer, losses = build_trl(stage, dtype, model_dir, 2, checkpointing, phases, work,
                                    lambda k: phases.memory() if k == 1 else None)
        trainer.train()
        phases.close("data")
        first = {"loss": losses[0], **({"logps/chosen": losses[1]} if stage == "dpo" else {})}
        trainable = trainer.trainable
    peaks = {k: v - start for k, v in phases.peaks.items()}
    return {"lib": lib, "stage": stage, "dtype": dtype, "peak": max(peaks.values()), "phases": peaks,
            "resident": phases.resident - start, "first": first, "trainable": trainable}


def timing_worker(stage: str, dtype: str, model_dir: Path, steps: int, checkpointing: bool, work: Path,
                  threads: int) -> dict:
    """Both trainers in this process, their steps alternating: TRL k, mlora k, TRL k+1, ..."""
    _imports()
    import torch

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    mph, tph = Phases(), Phases()
    mstep = build_mlora(stage, dtype, model_dir, steps + 1, checkpointing, mph)
    out = {lib: {"times": [], "cpu": []} for lib in LIBS}
    clock = {"wall": 0.0, "cpu": 0.0}

    def after_trl_step(k: int) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        tph.stop()
        if k >= 2:  # TRL's step 1 was its warm-up
            out["trl"]["times"].append(now - clock["wall"])
            out["trl"]["cpu"].append(cpu - clock["cpu"])
        i = k - 1  # mlora's step i (0: warm-up)
        if i >= 1:
            mph.timing()  # (re)starts its clock: TRL ran since mlora's last step
        t0, c0 = time.perf_counter(), time.process_time()
        mstep(i)
        if i >= 1:
            out["mlora"]["times"].append(time.perf_counter() - t0)
            out["mlora"]["cpu"].append(time.process_time() - c0)
        mph.stop()
        clock["wall"], clock["cpu"] = time.perf_counter(), time.process_time()
        tph.timing()

    trainer, _ = build_trl(stage, dtype, model_dir, steps + 1, checkpointing, tph, work, after_trl_step)
    trainer.train()
    out["mlora"]["seconds"], out["trl"]["seconds"] = mph.seconds, tph.seconds
    return {"stage": stage, "dtype": dtype, "threads": torch.get_num_threads(), **out}


# ---------------------------------------------------------------------- driver
def _run(what: list[str], args, model_dir: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", ",".join(what), "--model", str(model_dir), "--steps",
           str(args.steps), "--work", str(args.work), "--threads", str(args.threads)] + (
               ["--checkpointing"] if args.checkpointing else [])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONWARNINGS": "ignore"}
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.worker_timeout)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(what)} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    took = f"[{time.time() - args.began:5.0f} s, process {time.time() - t0:4.0f} s]"
    if what[0] == "time":
        key = "times" if args.clock == "wall" else "cpu"
        print(f"  {took} time   {result['stage']} {result['dtype']:15s}: {args.clock} s/step mlora "
              f"{', '.join(f'{t:.2f}' for t in result['mlora'][key])} | TRL "
              f"{', '.join(f'{t:.2f}' for t in result['trl'][key])}", flush=True)
    else:
        print(f"  {took} memory {result['stage']} {result['dtype']:15s} {result['lib']:5s}: peak "
              f"{result['peak'] / 2**20:.0f} MB (resident before the step {result['resident'] / 2**20:.0f} MB)",
              flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 timed steps each (default 4)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps of each library per timing process (default 4)")
    ap.add_argument("--reps", type=int, default=1, help="timing processes per (stage, dtype) (default 1)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads when timing (default: torch's choice)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the process's CPU seconds per step (use with --threads 1 on a shared machine)")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help=f"of {', '.join(DTYPES)} (default float32,bfloat16)")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory processes")
    ap.add_argument("--checkpointing", action="store_true",
                    help="both with activation checkpointing (mlora recompute=full, TRL gradient_checkpointing)")
    ap.add_argument("--model", type=Path, help="HF directory (default: SmolLM2-135M-Instruct, float32)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/mlora_vs_trl"))
    ap.add_argument("--json", type=Path, help="write every record here")
    ap.add_argument("--worker-timeout", type=int, default=1800, help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker:
        what = args.worker.split(",")
        if what[0] == "time":
            result = timing_worker(what[1], what[2], args.model, args.steps, args.checkpointing, args.work,
                                   args.threads)
        else:
            result = memory_worker(what[1], what[2], what[3], args.model, args.checkpointing, args.work)
        print(json.dumps(result))
        return
    if args.quick:
        args.steps = 2
    import peft
    import torch
    import transformers
    import trl
    from lora_overhead import machine

    if args.model is None:
        from mlora.models.smollm2 import smollm2_dir

        args.model = smollm2_dir("float32", progress=False)
    stages, dtypes = args.stages.split(","), args.dtypes.split(",")
    for d in dtypes:
        if d not in DTYPES:
            sys.exit(f"unknown dtype {d!r}; valid: {', '.join(DTYPES)}")
    args.began = time.time()
    print(machine())
    print(f"torch {torch.__version__} ({args.threads or torch.get_num_threads()} threads), transformers {transformers.__version__}, "
          f"trl {trl.__version__}, peft {peft.__version__}; model {args.model.name}; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"SFT: batch {SFT_BATCH} x {SFT_PROMPT + SFT_RESPONSE} tokens; DPO: {DPO_PAIRS} pairs x ({DPO_PROMPT} + "
          f"{DPO_RESPONSE}) tokens; LoRA r {RANK} alpha {ALPHA} all-linear dropout 0; activation checkpointing "
          f"{'on (both)' if args.checkpointing else 'off (both)'}; time: {args.reps} process(es) x {args.steps} "
          "steps per library (+1 warm-up), alternating in one process; memory: one fresh process per cell")
    timing: dict[tuple, list[dict]] = {}
    memory: dict[tuple, dict] = {}
    for rep in range(args.reps):
        for stage in stages:
            for dtype in dtypes:
                timing.setdefault((stage, dtype), []).append(_run(["time", stage, dtype], args, args.model))
    if not args.no_memory:
        for stage in stages:
            for dtype in dtypes:
                for lib in LIBS:
                    memory[(stage, dtype, lib)] = _run(["memory", lib, stage, dtype], args, args.model)
    if args.json:
        args.json.write_text(json.dumps({"timing": [{"key": list(k), "runs": v} for k, v in timing.items()],
                                         "memory": [{"key": list(k), **v} for k, v in memory.items()]}, indent=1))

    clock = {"wall": "wall-clock seconds", "cpu": "process CPU seconds"}[args.clock]
    other = "cpu" if args.clock == "wall" else "times"
    print(f"\n{clock} per optimizer step (best / median of {args.reps} x {args.steps}); step peak RSS "
          "above the imported interpreter (MB; weights, adapters, optimizer state, activations)")
    head = (f"{'stage':5s} {'dtype':15s} | {'mlora s/step':>13s} {'TRL s/step':>13s} {'ratio':>11s} | "
            f"{'mlora MB':>8s} {'TRL MB':>7s} {'ratio':>5s}")
    print(head + "\n" + "-" * len(head))
    notes = []
    for stage in stages:
        for dtype in dtypes:
            runs = timing[(stage, dtype)]
            t = {lib: [x for r in runs for x in r[lib]["times" if args.clock == "wall" else "cpu"]] for lib in LIBS}
            c = {lib: min(x for r in runs for x in r[lib][other]) for lib in LIBS}
            best = {lib: min(t[lib]) for lib in LIBS}
            med = {lib: statistics.median(t[lib]) for lib in LIBS}
            mem = {lib: memory.get((stage, dtype, lib)) for lib in LIBS}
            mb = {lib: mem[lib]["peak"] / 2**20 if mem[lib] else float("nan") for lib in LIBS}
            print(f"{stage:5s} {dtype:15s} | {best['mlora']:6.2f}/{med['mlora']:6.2f} {best['trl']:6.2f}/"
                  f"{med['trl']:6.2f} {best['mlora'] / best['trl']:5.2f}/{med['mlora'] / med['trl']:5.2f} | "
                  f"{mb['mlora']:8.0f} {mb['trl']:7.0f} {mb['mlora'] / mb['trl']:5.2f}")
            nsteps = {lib: sum(len(r[lib]["times"]) for r in runs) for lib in LIBS}
            sec = {lib: {k: sum(r[lib]["seconds"].get(k, 0.0) for r in runs) / nsteps[lib]
                         for k in runs[0][lib]["seconds"]} for lib in LIBS}
            notes.append(f"{stage} {dtype}: {'process CPU' if other == 'cpu' else 'wall-clock'} s/step (best) mlora "
                         f"{c['mlora']:.2f}, TRL {c['trl']:.2f} (ratio {c['mlora'] / c['trl']:.2f})")
            notes.append("  mean wall s/step by phase: mlora " + " ".join(f"{k} {v:.2f}" for k, v in sec["mlora"].items())
                         + " | TRL " + " ".join(f"{k} {v:.2f}" for k, v in sec["trl"].items()))
            if mem["mlora"] and mem["trl"]:
                ph = {lib: " ".join(f"{k} {v / 2**20:.0f}" for k, v in mem[lib]["phases"].items()) for lib in LIBS}
                notes.append(f"  MB resident before the step: mlora {mem['mlora']['resident'] / 2**20:.0f}, TRL "
                             f"{mem['trl']['resident'] / 2**20:.0f}; peak by phase: mlora {ph['mlora']} | TRL "
                             f"{ph['trl']}")
                key = "loss" if stage == "sft" else "logps/chosen"
                notes.append(f"  first step {key}: mlora {mem['mlora']['first'][key]:.5f}, TRL "
                             f"{mem['trl']['first'][key]:.5f}; trainable parameters: mlora "
                             f"{mem['mlora']['trainable']:,}, TRL+PEFT {mem['trl']['trainable']:,}")
    print("ratio = mlora / TRL (best/median); goal: <= 1.00 for time and memory\n")
    print("\n".join(notes))
    print(f"total {time.time() - args.began:.0f} s")


if __name__ == "__main__":
    import records  # the run becomes a record of bench/records.jsonl

    records.main(main, group="Against TRL + PEFT")
