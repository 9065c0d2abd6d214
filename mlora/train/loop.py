"""The one run loop of every ``mlora-train`` stage: start, step, evaluate, save, preempt, resume.

A stage (:class:`Stage`) brings its data, its engine on the shared base and what one step does:
:class:`mlora.train.rl_stage.RLStage` (rollouts from vLLM engines, rewards, a PPO/GRPO/RLOO update,
the adapter hand-off) and :class:`mlora.train.preference_stage.PreferenceStage` (SFT, reward model,
DPO). Everything around the steps is here, once: the mesh and the run directories
(:func:`start_run`), the checkpoint to resume from, seeded epochs, evaluation and checkpoint
intervals, the metrics log and progress bar, the agreed stop on SIGTERM/SIGUSR1 with its
checkpoint and marker, and the final adapter.

Every rank runs :func:`run` with the same validated :class:`~mlora.config.schema.TrainConfig`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist

import mlora
from mlora.checkpoint.dirs import (
    CheckpointError,
    base_model_identity,
    check_base_model,
    check_complete,
    check_shared_root,
    resolve_resume,
    save_checkpoint,
)
from mlora.checkpoint.run_state import Checkpointable, load_run_state, write_run_state
from mlora.config.schema import TrainConfig
from mlora.config.validate import generates_while_training
from mlora.train.from_config import model_kwargs
from mlora.train.metrics_log import MetricsLogger, log, setup_logging
from mlora.train.preemption import EX_TEMPFAIL, Preempted, PreemptionGuard, clear_marker, write_marker

FROZEN = "frozen"  # the name of trainer.policy.model.frozen_adapter_path's adapter


class Stage(Protocol):
    """What a stage plugs into :func:`run`. It is built on every rank once the mesh exists
    (``make_stage(cfg, mesh)``: data first, so that bad data fails before the model loads, then the
    model and the engine). Methods marked collective are called on every rank."""

    model: mlora.MLoraModel
    engine: Checkpointable  # what checkpoints hold (mlora.checkpoint.run_state)
    n_examples: int  # training prompts or examples: the size of an epoch
    total_steps: int
    evaluates: bool  # it has held-out data

    def open(self, run_dir: Path) -> None:
        """Collective: what the steps need beyond the model (the RL stage's engines and first hand-off)."""

    def schedule(self, start_step: int) -> Iterator[tuple[int, int, object]]:
        """``(epoch, step, picked)`` of every step after ``start_step`` (the run's steps; ``picked`` is what
        :meth:`step` trains on), in order; sets :attr:`total_steps` for a resumed run. Called once, after the
        checkpoint (if any) was loaded."""

    def eval_due(self, step: int) -> bool:
        """Whether :meth:`evaluate` runs after step ``step``."""

    def step(self, step: int, picked) -> dict[str, float]:
        """Collective: one update on training examples ``picked`` (from :meth:`schedule`); returns the step's
        metrics."""

    def evaluate(self, step: int) -> dict[str, float]:
        """Collective: held-out metrics (``eval/...``), on rank 0 at least."""

    def step_line(self, step: int, metrics: dict[str, float]) -> str:
        """The console line of a step."""

    def eval_line(self, metrics: dict[str, float]) -> str:
        """The console line of an evaluation before training."""

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        """The progress bar's figures."""

    def loop_state(self) -> dict:
        """What a checkpoint keeps of the stage besides the model and the engine (JSON; {} for nothing)."""

    def restore(self, state: dict) -> None:
        """A resumed run: the checkpoint's loop state (:meth:`loop_state`'s keys among them), before :meth:`open`."""

    def finish(self, run_dir: Path) -> Path:
        """Collective: write the final adapter; on rank 0 also report it (plot, how to serve it). Returns it."""

    def close(self) -> None:
        """Release what :meth:`open` started, if anything (also after a failure or preemption)."""


def total_steps(cfg: TrainConfig, n_examples: int) -> int:
    """``trainer.total_steps``, or ``trainer.epochs`` whole epochs of ``train_batch_size``, at most
    ``trainer.max_training_steps`` (SkyRL's cap)."""
    t = cfg.trainer
    steps = t.total_steps or t.epochs * (n_examples // t.train_batch_size)
    return steps if t.max_training_steps is None else min(steps, t.max_training_steps)


def interval_due(step: int, interval: int, total: int) -> bool:
    """Every ``interval`` steps and after the last one; never when ``interval <= 0``."""
    return interval > 0 and (step % interval == 0 or step == total)


def hf_save_due(step: int, interval: int, total_steps: int, steps_per_epoch: int) -> bool:
    """SkyRL's ``trainer.hf_save_interval`` schedule: every ``interval`` steps, at each epoch's end and
    after the last step; never when ``interval <= 0``."""
    return interval_due(step, interval, total_steps) or (
        interval > 0 and steps_per_epoch > 0 and step % steps_per_epoch == 0)


def load_model(cfg: TrainConfig, mesh) -> tuple[mlora.MLoraModel, tuple[str, ...]]:
    """The shared base on this rank's mesh with ``trainer.policy.model.frozen_adapter_path`` (e.g. an SFT
    adapter) loaded frozen as :data:`FROZEN`; returns the model and the frozen adapters every trained
    adapter and the reference stack on."""
    t = cfg.trainer
    model = mlora.from_pretrained(t.policy.model.path, mesh, **model_kwargs(t))
    frozen = t.policy.model.frozen_adapter_path
    if frozen:
        model.load_adapter(FROZEN, frozen, trainable=False)
    return model, (FROZEN,) if frozen else ()


def run(cfg: TrainConfig, make_stage: Callable[[TrainConfig, object], Stage], notes: Sequence[str] = (),
        build_assets: Callable[[str], object] | None = None) -> dict:
    """Train the stage ``make_stage(cfg, mesh)`` builds; returns the last step's metrics (on every rank).

    ``build_assets(demo.dir)``: what ``demo.prepare`` builds (see :func:`start_run`).

    SIGTERM / SIGUSR1 during the run: the ranks agree to stop after the current step, save a
    checkpoint, write ``<run_dir>/preempted.json`` (rank 0), release the stage (the engines) and raise
    :class:`~mlora.train.preemption.Preempted` (a ``SystemExit`` with code 75).
    """
    with PreemptionGuard() as guard:
        try:
            return _train(cfg, make_stage, notes, guard, build_assets)
        except Preempted as stop:
            if stop.step is None and int(os.environ.get("RANK", "0")) == 0:  # stopped during start-up
                write_marker(Path(cfg.trainer.run_dir), None, None, guard.received)
            raise


def start_run(cfg: TrainConfig, notes: Sequence[str], build_assets: Callable[[str], object] | None):
    """What every mlora-train stage does first: the demo's assets (``demo.prepare``, rank 0, with
    ``build_assets(demo.dir)``, which the entry point passes in: training imports no demo), the threads
    of this rank (``trainer.cpu_threads``, chosen for the machine on CPU when null:
    :mod:`mlora.rollout.cpu_threads`), the mesh, logging, the config notes, the run and checkpoint
    directories (the checkpoint root must be shared by every rank) and the checkpoint to resume from (found
    before the model loads: a wrong checkpoint fails fast). Returns ``(mesh, run_dir, ckpt_root, resume)``."""
    from mlora.rollout.cpu_threads import apply_trainer_threads

    t = cfg.trainer
    if cfg.demo.prepare and build_assets is None:
        raise ValueError("demo.prepare=true: the demo's assets are built by the entry point (mlora-train); "
                         "pass build_assets (e.g. mlora.demos.rl_assets.build_demo_assets) or set demo.prepare=false")
    e = cfg.generator.inference_engine
    # asynchronous training: rank 0's node runs its local engines beside the update (torchrun's GROUP_RANK)
    overlapping = (e.num_engines if generates_while_training(cfg) and e.run_engines_locally
                   and os.environ.get("GROUP_RANK", "0") == "0" else 0)
    threads = apply_trainer_threads(t.cpu_threads, torch.cuda.is_available(), overlapping)
    if cfg.demo.prepare and int(os.environ.get("RANK", "0")) == 0:
        build_assets(cfg.demo.dir)
    mc = t.policy.megatron_config
    mesh = mlora.init_parallel(tp=mc.tensor_model_parallel_size, pp=mc.pipeline_model_parallel_size,
                               sp=mc.sequence_parallel, seed=t.seed, ep=mc.expert_model_parallel_size or 1)
    setup_logging(mesh.rank)
    if threads is not None:
        log.info("CPU threads: %d per trainer rank (%s cores, %s local ranks; trainer.cpu_threads=%s, "
                 "OMP_NUM_THREADS=%s)%s", threads, len(os.sched_getaffinity(0)),
                 os.environ.get("LOCAL_WORLD_SIZE", "1"), t.cpu_threads, os.environ.get("OMP_NUM_THREADS"),
                 "" if threads == 1 or "OMP_WAIT_POLICY" in os.environ else
                 "; the ranks' threads wait actively (libgomp's default): on a machine shared with other jobs "
                 "export OMP_WAIT_POLICY=PASSIVE before launching or set trainer.cpu_threads=1 (bench/threads.py)")
    for note in notes:
        log.info("note: %s", note)
    dist.barrier()
    run_dir = Path(t.run_dir)
    ckpt_root = Path(t.ckpt_path) if t.ckpt_path else run_dir / "checkpoints"
    # every rank writes into it (a preemption checkpoints whatever ckpt_interval says): shared or refused now
    check_shared_root(ckpt_root, "trainer.ckpt_path" if t.ckpt_path else "trainer.run_dir")
    return mesh, run_dir, ckpt_root, _find_resume(cfg, mesh, ckpt_root)


def _train(cfg: TrainConfig, make_stage: Callable[[TrainConfig, object], Stage], notes: Sequence[str],
           guard: PreemptionGuard, build_assets: Callable[[str], object] | None) -> dict:
    t = cfg.trainer
    # 1. the mesh (and the demo's assets), the checkpoint to resume from
    mesh, run_dir, ckpt_root, resume = start_run(cfg, notes, build_assets)
    # 2. the stage: its data, the shared base with its adapters, its engine; the resumed state
    stage = make_stage(cfg, mesh)
    start_step = _resume_state(resume, stage, cfg) if resume else 0
    schedule = stage.schedule(start_step)
    saver = _Saver(cfg, mesh, stage, ckpt_root)

    metrics_log = bar = None
    last: dict = {}
    try:
        if mesh.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            metrics_log = MetricsLogger(t.logger, run_dir, t.project_name, t.run_name,
                                        resume_step=start_step if resume else None)
        stage.open(run_dir)
        evaluating = stage.evaluates and t.eval_interval > 0
        if evaluating and t.eval_before_train and resume is None:  # a resumed run evaluated step 0 before
            metrics = stage.evaluate(0)
            if metrics_log is not None:
                metrics_log.log(0, metrics)
                log.info("eval before training: %s", stage.eval_line(metrics))
        if mesh.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=stage.total_steps, initial=start_step, desc="mlora-train", unit="step")
        guard.defer()  # from here a signal finishes the step and checkpoints; before, it stops start-up at once

        # 3. the steps: the stage's update -> eval / checkpoint -> agreed stop -> log
        for epoch, step, picked in schedule:
            t0 = time.perf_counter()
            metrics = stage.step(step, picked)
            metrics["timing/step_s"] = time.perf_counter() - t0
            metrics["trainer/epoch"] = epoch
            if stage.eval_due(step):
                metrics.update(stage.evaluate(step))
            saved = None
            if interval_due(step, t.ckpt_interval, stage.total_steps):
                saved = saver.save(step, epoch)
            # every rank, every step (a signal may reach only some ranks): all stop after the same step.
            # Before the step's line is logged, so a signal sent after line k-1 appeared stops at step k.
            stop = guard.agreed(mesh.device)
            if metrics_log is not None:
                metrics_log.log(step, metrics)
                bar.update(1)
                bar.set_postfix(stage.postfix(metrics))
                log.info(stage.step_line(step, metrics))
            last = metrics
            if stop and step < stage.total_steps:
                _preempt(guard, saver, mesh, run_dir, step, epoch, saved)
            if stop:
                log.info("%s arrived during the last step: finishing normally",
                         guard.received or "a stop signal (on another rank)")

        # 4. the final adapter and its report
        stage.finish(run_dir)
        if mesh.rank == 0:
            clear_marker(run_dir)
    finally:
        if bar is not None:
            bar.close()
        if metrics_log is not None:
            metrics_log.close()
        stage.close()
    return last


def _find_resume(cfg: TrainConfig, mesh, ckpt_root: Path) -> Path | None:
    """The checkpoint to resume from (``trainer.resume_mode``), decided on rank 0 and the same on every
    rank; a damaged one or one from another base model is an error on every rank."""
    t = cfg.trainer
    box: list = [None]
    if mesh.rank == 0:
        try:
            path = resolve_resume(t.resume_mode, ckpt_root, t.resume_path)
            if path is not None:
                check_base_model(check_complete(path), t.policy.model.path, path)
            box = [("ok", None if path is None else str(path))]
        except CheckpointError as exc:
            box = [("error", str(exc))]
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise CheckpointError(value)
    return None if value is None else Path(value)


def _resume_state(path: Path, stage: Stage, cfg: TrainConfig) -> int:
    """Load checkpoint ``path`` into the stage's model and engine; returns its step."""
    t0 = time.perf_counter()
    state = load_run_state(path, stage.model, stage.engine)
    stage.restore(state)
    step, total, batch = state["step"], stage.total_steps, cfg.trainer.train_batch_size
    if cfg.experiments is None and (state.get("n_examples"), state.get("train_batch_size")) != (stage.n_examples, batch):
        log.warning("resume: the checkpoint's run had %s examples in batches of %s, this one %d in batches of %d: "
                    "the data order after step %d differs from the original run's", state.get("n_examples"),
                    state.get("train_batch_size"), stage.n_examples, batch, step)
    log.info("resumed from %s (step %d, epoch %d) in %.2fs; %s", path, step, state.get("epoch", 0),
             time.perf_counter() - t0, f"continuing with step {step + 1} of {total}" if step < total
             else f"trainer.total_steps={total} already reached: nothing left to train")
    return step


class _Saver:
    """Writes the checkpoints of a run (:func:`mlora.checkpoint.run_state.write_run_state` inside
    :func:`mlora.checkpoint.dirs.save_checkpoint`'s atomic commit)."""

    def __init__(self, cfg: TrainConfig, mesh, stage: Stage, root: Path) -> None:
        from omegaconf import OmegaConf

        self.cfg, self.mesh, self.stage, self.root = cfg, mesh, stage, root
        self.config_text = OmegaConf.to_yaml(OmegaConf.structured(cfg))
        self.meta = {"base_model": base_model_identity(cfg.trainer.policy.model.path)} if mesh.rank == 0 else {}

    def save(self, step: int, epoch: int) -> Path:
        t, s = self.cfg.trainer, self.stage
        loop_state = {"step": step, "epoch": epoch, "total_steps": s.total_steps, "seed": t.seed,
                      "n_examples": s.n_examples, "train_batch_size": t.train_batch_size, **s.loop_state()}
        meta = {**self.meta, "mesh": {"tp": self.mesh.tp, "pp": self.mesh.pp, "dp": self.mesh.dp}}
        return save_checkpoint(self.root, step, self.mesh,
                               lambda d: write_run_state(d, s.model, s.engine, loop_state, self.config_text),
                               meta, keep=t.max_ckpts_to_keep)


def _preempt(guard: PreemptionGuard, saver: _Saver, mesh, run_dir: Path, step: int, epoch: int,
             saved: Path | None) -> None:
    """Checkpoint step ``step`` (unless it just was), leave the marker, and stop with exit code 75."""
    checkpoint = saved or saver.save(step, epoch)
    if mesh.rank == 0:
        marker = write_marker(run_dir, step, checkpoint, guard.received)
        log.info("preempted (%s) after step %d: checkpoint %s, %s; releasing the engines and exiting with %d",
                 guard.received or "a signal on another rank", step, checkpoint, marker, EX_TEMPFAIL)
    raise Preempted(step, checkpoint)
