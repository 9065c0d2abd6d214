"""The RL loop: rollouts from vLLM engines, rewards, a shared-base PPO/GRPO step, adapter hand-off,
evaluation, checkpoints.

Every rank runs :func:`run` with the same validated :class:`~mlora.config.schema.TrainConfig`.
Global rank 0 owns the inference engines and the logs (:class:`Rollouts`); the trainer ranks get
each step's rollouts by broadcast. After each update the policy adapter is handed to every engine
and hot-swapped in: as PEFT files in the sync directory (``generator.weight_sync=disk|memory``,
``save_adapter``) or as tensors that each rank copies from its own shards into one shared-memory
segment (``weight_sync=tensors``, :mod:`mlora.rollout.tensor_sync`).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

import mlora
from mlora.checkpoint.dirs import (
    CheckpointError,
    base_model_identity,
    check_base_model,
    check_complete,
    resolve_resume,
    save_checkpoint,
)
from mlora.checkpoint.rl_state import load_train_state, write_train_state
from mlora.config.schema import TrainConfig
from mlora.rollout.data import Prompt, epoch_batches, load_prompt_set
from mlora.rollout.envs import make_env
from mlora.rollout.generator import Generation, SamplingConfig
from mlora.train.batch import RolloutBatch
from mlora.train.engine import ActorCriticEngine
from mlora.train.evaluate import evaluate
from mlora.train.from_config import lora_config, model_kwargs, ppo_config, sampling_config
from mlora.train.learned_reward import build_learned_reward, env_kwargs
from mlora.train.metrics_log import MetricsLogger, log, setup_logging, step_line
from mlora.train.preemption import EX_TEMPFAIL, Preempted, PreemptionGuard, clear_marker, write_marker

POLICY, CRITIC = "policy", "critic"  # the trainer's adapter names; the engines serve POLICY under this name
FROZEN = "frozen"  # the name of trainer.policy.model.frozen_adapter_path's adapter


def build_batch(prompt_ids: list[list[int]], gens: list[Generation], rewards: list[float], pad_id: int
                ) -> RolloutBatch:
    """Right-padded prompt+response sequences, response mask and the engine's log-probs per action."""
    seqs = [prompt_ids[g.prompt_index] + g.token_ids for g in gens]
    width = max(len(s) for s in seqs)
    b = len(seqs)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros(b, width, dtype=torch.long)
    resp = torch.zeros(b, width, dtype=torch.long)
    rollout_lp = torch.zeros(b, width - 1)
    for i, (seq, g) in enumerate(zip(seqs, gens)):
        n_prompt = len(prompt_ids[g.prompt_index])
        ids[i, :len(seq)] = torch.tensor(seq)
        attn[i, :len(seq)] = 1
        resp[i, n_prompt:len(seq)] = 1
        rollout_lp[i, n_prompt - 1:len(seq) - 1] = torch.tensor(g.logprobs, dtype=torch.float32)
    return RolloutBatch(ids, attn, resp, torch.tensor(rewards, dtype=torch.float32), rollout_lp)


def _sync_dir(cfg: TrainConfig, adapter: str) -> Path:
    if cfg.generator.weight_sync == "memory":
        shm = Path("/dev/shm")
        if not shm.is_dir():
            raise RuntimeError("generator.weight_sync=memory needs /dev/shm (shared memory); use disk")
        return shm / f"mlora-{os.getpid()}-{cfg.trainer.run_name}" / adapter
    return Path(cfg.trainer.policy.model.lora.lora_sync_path) / adapter


class Rollouts:
    """The engines (on global rank 0), the environments that score their responses, and the hand-off
    of the policy adapter. ``collect`` is collective: every rank gets the same batch."""

    def __init__(self, cfg: TrainConfig, mesh, run_dir: Path, adapter: str) -> None:
        self.cfg, self.mesh, self.adapter = cfg, mesh, adapter
        self.sync_dir = _sync_dir(cfg, adapter)
        self.tensors = cfg.generator.weight_sync == "tensors"
        self.handoff = None  # weight_sync=tensors: the segment, made at the first sync (it needs the model)
        self.generator = None
        self.envs: dict = {}
        self.engine_base = cfg.trainer.policy.model.path
        if mesh.rank != 0:
            return
        from mlora.rollout.vllm_engine import build_engines

        frozen = cfg.trainer.policy.model.frozen_adapter_path
        if frozen:  # the engines load the base with the frozen adapter merged, once
            from mlora.export.merge import merge_adapter

            self.engine_base = merge_adapter(self.engine_base, frozen, run_dir / "engine_base", progress=False)
        options = engine_options(cfg, self.engine_base, torch.cuda.is_available())
        log.info("vLLM engines: max_model_len %d%s", options["max_model_len"],
                 "" if options.get("engine_cores") is None else
                 "; CPU cores per engine " + " ".join(str(c) for c in options["engine_cores"]))
        self.generator = build_engines(self.engine_base, **options)

    def score(self, prompt: Prompt, gen: Generation) -> float:
        if self.cfg.generator.zero_reward_on_non_stop and gen.finish_reason != "stop":
            return 0.0
        if prompt.env_class not in self.envs:
            self.envs[prompt.env_class] = make_env(prompt.env_class, **env_kwargs(self.cfg, prompt.env_class))
        return self.envs[prompt.env_class].reward(prompt.row, gen.text, gen.token_ids)

    def sync(self, model) -> dict[str, float]:
        """Hand the policy adapter to the engines (collective) and hot-swap it in: PEFT files in the sync
        directory, or (``weight_sync=tensors``) each rank's shards copied into the shared segment."""
        t0 = time.perf_counter()
        if self.tensors:
            if self.handoff is None:
                from mlora.rollout.tensor_sync import TensorHandoff

                self.handoff = TensorHandoff(model, self.adapter)
            path = self.handoff.write()
        else:
            model.save_adapter(self.adapter, self.sync_dir)
        out = {"timing/adapter_gather_s": time.perf_counter() - t0}
        if self.generator is not None:
            out["timing/adapter_swap_s"] = (self.generator.update_adapter_tensors(path, self.adapter) if self.tensors
                                            else self.generator.update_adapter(self.sync_dir, self.adapter))
        out["timing/adapter_sync_s"] = time.perf_counter() - t0
        return out

    def collect(self, prompts: list[Prompt], sampling: SamplingConfig, pad_id: int) -> tuple[RolloutBatch, dict]:
        """Generate and score on rank 0, broadcast to every rank."""
        box: list = [None]
        if self.generator is not None:
            t0 = time.perf_counter()
            gens = self.generator.generate([p.token_ids for p in prompts], sampling)
            rewards = [self.score(prompts[g.prompt_index], g) for g in gens]
            box = [(gens, rewards, time.perf_counter() - t0)]
        dist.broadcast_object_list(box, src=0)
        gens, rewards, seconds = box[0]
        # what the learned reward (env_class=reward_model) needs of each row, scored on the trainer later
        self.last_rows = [(prompts[g.prompt_index].env_class, g.finish_reason) for g in gens]
        return build_batch([p.token_ids for p in prompts], gens, rewards, pad_id), {"timing/generate_s": seconds}

    def evaluate(self, prompts: list[Prompt], step: int, run_dir: Path) -> dict[str, float]:
        """Evaluation metrics (rank 0; an empty dict on the other ranks)."""
        if self.generator is None or not prompts:
            return {}
        g, t = self.cfg.generator, self.cfg.trainer
        sampling = sampling_config(g.eval_sampling_params, g.eval_n_samples_per_prompt, t.seed)
        t0 = time.perf_counter()
        out = evaluate(self.generator, prompts, sampling, t.eval_batch_size, self.score, step,
                       run_dir / "dumped_evals" if t.dump_eval_results else None)
        return {**out, "timing/eval_s": time.perf_counter() - t0}

    def close(self) -> None:
        if self.generator is not None:
            self.generator.close()
        if self.handoff is not None:  # after the engines: they map the segment until they end
            self.handoff.close()
        if self.cfg.generator.weight_sync == "memory" and self.mesh.rank == 0:
            shutil.rmtree(self.sync_dir.parent, ignore_errors=True)


def engine_max_model_len(cfg: TrainConfig, model_dir: str | os.PathLike) -> int:
    """The engines' context length: ``generator.engine_init_kwargs.max_model_len`` when given, else the
    run's longest prompt + longest response (training or evaluation sampling), capped by the model's
    own limit (:mod:`mlora.rollout.model_len`)."""
    from mlora.rollout.model_len import read_context_limit, run_max_model_len

    explicit = cfg.generator.engine_init_kwargs.get("max_model_len")
    if explicit is not None:
        return int(explicit)
    g = cfg.generator
    return run_max_model_len(cfg.trainer.max_prompt_length, (g.sampling_params.max_generate_length,
                                                              g.eval_sampling_params.max_generate_length),
                             read_context_limit(model_dir))


def engine_options(cfg: TrainConfig, engine_base: str | os.PathLike, cuda: bool) -> dict:
    """The arguments of :func:`~mlora.rollout.vllm_engine.build_engines` for this run, after the model:
    the engine keys, ``generator.engine_init_kwargs`` (which win), the derived ``max_model_len``
    (:func:`engine_max_model_len`) and, for local engines on CPU, each engine's cores
    (:func:`mlora.rollout.cpu_threads.local_engine_cores`; None when the user's ``OMP_NUM_THREADS`` decides)."""
    from mlora.rollout.cpu_threads import local_engine_cores

    t, g, e = cfg.trainer, cfg.generator, cfg.generator.inference_engine
    extra = dict(g.engine_init_kwargs)
    if e.gpu_memory_utilization is not None:
        extra.setdefault("gpu_memory_utilization", e.gpu_memory_utilization)
    extra["max_model_len"] = engine_max_model_len(cfg, engine_base)
    local_cpu = e.run_engines_locally and not cuda
    return dict(num_engines=e.num_engines, tensor_parallel_size=e.tensor_parallel_size,
                run_locally=e.run_engines_locally, ship_adapter=g.weight_sync == "memory",
                tensor_lora=g.weight_sync == "tensors",
                engine_cores=local_engine_cores(e.num_engines) if local_cpu else None,
                max_lora_rank=t.policy.model.lora.rank, dtype=t.dtype, seed=t.seed,
                kv_cache_memory_bytes=g.kv_cache_memory_bytes, **extra)


def _load_data(cfg: TrainConfig, tokenizer) -> tuple[list[Prompt], list[Prompt]]:
    t, env = cfg.trainer, cfg.environment.env_class
    make_env(env)  # an unknown environment fails before any model is loaded
    train, dropped = load_prompt_set(list(cfg.data.train_data), tokenizer, t.max_prompt_length, env,
                                     "data.train_data")
    val, val_dropped = load_prompt_set(list(cfg.data.val_data), tokenizer, t.max_prompt_length, env, "data.val_data")
    for name in sorted({p.env_class for p in train + val}):
        make_env(name)
    if not train:
        raise ValueError("data.train_data is empty: give one or more prompt parquet files")
    if dropped or val_dropped:
        log.info("dropped %d training and %d validation prompts longer than trainer.max_prompt_length=%d tokens",
                 dropped, val_dropped, t.max_prompt_length)
    return train, val


def _build_engine(cfg: TrainConfig, model, total_steps: int) -> ActorCriticEngine:
    t = cfg.trainer
    frozen = t.policy.model.frozen_adapter_path
    if frozen:  # e.g. an SFT adapter: under policy, critic and reference alike
        model.load_adapter(FROZEN, frozen, trainable=False)
    return ActorCriticEngine(model, ppo_config(cfg, total_steps), policy=POLICY, critic=CRITIC,
                             reference_adapters=(FROZEN,) if frozen else (),
                             policy_lora=lora_config(t.policy.model.lora, t.seed),
                             critic_lora=lora_config(t.critic.model.lora, t.seed))


def run(cfg: TrainConfig, notes: Sequence[str] = (), build_assets: Callable[[str], object] | None = None) -> dict:
    """Train; returns the last step's metrics (on every rank).

    ``build_assets(demo.dir)``: what ``demo.prepare`` builds (the entry point passes the CPU demo's,
    :func:`mlora.demos.rl_assets.build_demo_assets`; see :func:`start_run`).

    SIGTERM / SIGUSR1 during the run: the ranks agree to stop after the current step, save a
    checkpoint, write ``<run_dir>/preempted.json`` (rank 0), release the engines and raise
    :class:`~mlora.train.preemption.Preempted` (a ``SystemExit`` with code 75).
    """
    with PreemptionGuard() as guard:
        try:
            return _train(cfg, notes, guard, build_assets)
        except Preempted as stop:
            if stop.step is None and int(os.environ.get("RANK", "0")) == 0:  # stopped during start-up
                write_marker(Path(cfg.trainer.run_dir), None, None, guard.received)
            raise


def start_run(cfg: TrainConfig, notes: Sequence[str], build_assets: Callable[[str], object] | None):
    """What every mlora-train stage does first: the demo's assets (``demo.prepare``, rank 0, with
    ``build_assets(demo.dir)``, which the entry point passes in: training imports no demo), the threads of this rank (``trainer.cpu_threads``, chosen for the
    machine on CPU when null: :mod:`mlora.rollout.cpu_threads`), the mesh, logging, the config notes,
    the run and checkpoint directories and the checkpoint to resume from (found before the model loads:
    a wrong checkpoint fails fast). Returns ``(mesh, run_dir, ckpt_root, resume)``."""
    from mlora.rollout.cpu_threads import apply_trainer_threads

    t = cfg.trainer
    if cfg.demo.prepare and build_assets is None:
        raise ValueError("demo.prepare=true: the demo's assets are built by the entry point (mlora-train); "
                         "pass build_assets (e.g. mlora.demos.rl_assets.build_demo_assets) or set demo.prepare=false")
    threads = apply_trainer_threads(t.cpu_threads, torch.cuda.is_available())
    if cfg.demo.prepare and int(os.environ.get("RANK", "0")) == 0:
        build_assets(cfg.demo.dir)
    mc = t.policy.megatron_config
    mesh = mlora.init_parallel(tp=mc.tensor_model_parallel_size, pp=mc.pipeline_model_parallel_size,
                               sp=mc.sequence_parallel, seed=t.seed)
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
    return mesh, run_dir, ckpt_root, _find_resume(cfg, mesh, ckpt_root)


def _train(cfg: TrainConfig, notes: Sequence[str], guard: PreemptionGuard,
           build_assets: Callable[[str], object] | None) -> dict:
    from transformers import AutoTokenizer

    t, g = cfg.trainer, cfg.generator
    # 1. the mesh (and the CPU demo's tiny model and prompts)
    mesh, run_dir, ckpt_root, resume = start_run(cfg, notes, build_assets)

    # 2. prompts, the shared base with its adapters, the PPO engine
    tokenizer = AutoTokenizer.from_pretrained(str(t.policy.model.path))
    train, val = _load_data(cfg, tokenizer)
    total_steps = t.total_steps or t.epochs * (len(train) // t.train_batch_size)
    model = mlora.from_pretrained(t.policy.model.path, mesh, **model_kwargs(t))
    engine = _build_engine(cfg, model, total_steps)
    # the reward adapter + head, frozen on this same base (env_class=reward_model; mlora.train.learned_reward)
    learned = build_learned_reward(cfg, model, engine, {p.env_class for p in train + val},
                                   run_frozen=FROZEN if t.policy.model.frozen_adapter_path else None)
    start_step = _resume_state(resume, model, engine, cfg, len(train), total_steps) if resume else 0
    # rollouts of step s sample with seed + 1000·s (+ the prompt's index): no RNG to carry
    saver = _Saver(cfg, mesh, model, engine, ckpt_root, len(train), total_steps)
    pad_id = tokenizer.pad_token_id or 0

    # 3. the engines, serving the initial policy adapter
    metrics_log = bar = rollouts = None
    last: dict = {}
    try:
        if mesh.rank == 0:
            from tqdm import tqdm

            run_dir.mkdir(parents=True, exist_ok=True)
            metrics_log = MetricsLogger(t.logger, run_dir, t.project_name, t.run_name,
                                        resume_step=start_step if resume else None)
        rollouts = Rollouts(cfg, mesh, run_dir, POLICY)
        rollouts.sync(model)
        evaluating = bool(val) and t.eval_interval > 0
        if evaluating and t.eval_before_train and resume is None:  # a resumed run evaluated step 0 before
            metrics = rollouts.evaluate(val, 0, run_dir)
            if metrics_log is not None:
                metrics_log.log(0, metrics)
                log.info("eval before training: %s", _eval_summary(metrics))
        if mesh.rank == 0:
            bar = tqdm(total=total_steps, initial=start_step, desc="mlora-train", unit="step")
        guard.defer()  # from here a signal finishes the step and checkpoints; before, it stops start-up at once

        # 4. the steps: rollouts -> shared-base update -> hand-off -> eval / checkpoint -> log
        for epoch, step, picked in epoch_batches(len(train), t.train_batch_size, t.seed, total_steps, start_step):
            sampling = sampling_config(g.sampling_params, g.n_samples_per_prompt, t.seed + step * 1000)
            batch, metrics = rollouts.collect([train[i] for i in picked], sampling, pad_id)
            if learned is not None:  # the model-based part of the reward, on the trainer
                metrics.update(learned.apply(batch, rollouts.last_rows))
            t0 = time.perf_counter()
            metrics.update(engine.step(batch))
            metrics["timing/train_s"] = time.perf_counter() - t0
            metrics.update(rollouts.sync(model))
            metrics["trainer/epoch"] = epoch
            if evaluating and (step % t.eval_interval == 0 or step == total_steps):
                metrics.update(rollouts.evaluate(val, step, run_dir))
            saved = None
            if t.ckpt_interval > 0 and (step % t.ckpt_interval == 0 or step == total_steps):
                saved = saver.save(step, epoch)
            # every rank, every step (a signal may reach only some ranks): all stop after the same step.
            # Before the step's line is logged, so a signal sent after line k-1 appeared stops at step k.
            stop = guard.agreed(mesh.device)
            if metrics_log is not None:
                metrics_log.log(step, metrics)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
                log.info(step_line(step, metrics))
            last = metrics
            if stop and step < total_steps:
                _preempt(guard, saver, mesh, run_dir, step, epoch, saved)
            if stop:
                log.info("%s arrived during the last step: finishing normally",
                         guard.received or "a stop signal (on another rank)")

        # 5. the final adapter, the plot, and how to serve it
        final = run_dir / "final_adapter"
        model.save_adapter(POLICY, final)
        if mesh.rank == 0:
            _report(cfg, run_dir, final, rollouts.engine_base)
            clear_marker(run_dir)
    finally:
        if bar is not None:
            bar.close()
        if metrics_log is not None:
            metrics_log.close()
        if rollouts is not None:
            rollouts.close()
    return last


def _eval_summary(metrics: dict) -> str:
    return "  ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/"))


def _report(cfg: TrainConfig, run_dir: Path, final: Path, engine_base) -> None:
    from mlora.rollout.serve import format_command, serve_command
    from mlora.train.plot import plot_metrics

    t = cfg.trainer
    png = plot_metrics(run_dir / "metrics.jsonl", run_dir / "metrics.png")
    frozen = t.policy.model.frozen_adapter_path
    argv = serve_command(engine_base, {POLICY: final.resolve()}, max_lora_rank=t.policy.model.lora.rank,
                         dtype=t.dtype, kv_cache_memory_bytes=cfg.generator.kv_cache_memory_bytes,
                         max_model_len=engine_max_model_len(cfg, engine_base))
    log.info("\nmetrics: %s\nplot: %s\nfinal adapter (PEFT): %s\n%sserve it with vLLM (OpenAI API):\n  %s",
             run_dir / "metrics.jsonl", png, final,
             f"(it applies on top of {frozen}, merged into the base in {engine_base})\n" if frozen else "",
             format_command(argv))


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


def _resume_state(path: Path, model, engine: ActorCriticEngine, cfg: TrainConfig, n_prompts: int,
                  total_steps: int) -> int:
    """Load checkpoint ``path`` into the model and engine; returns its step."""
    t0 = time.perf_counter()
    state = load_train_state(path, model, engine)
    step = state["step"]
    if (state.get("n_prompts"), state.get("train_batch_size")) != (n_prompts, cfg.trainer.train_batch_size):
        log.warning("resume: the checkpoint's run had %s prompts in batches of %s, this one %d in batches of %d: the "
                    "data order after step %d differs from the original run's", state.get("n_prompts"),
                    state.get("train_batch_size"), n_prompts, cfg.trainer.train_batch_size, step)
    log.info("resumed from %s (step %d, epoch %d) in %.2fs; %s", path, step, state.get("epoch", 0),
             time.perf_counter() - t0, f"continuing with step {step + 1} of {total_steps}" if step < total_steps
             else f"trainer.total_steps={total_steps} already reached: nothing left to train")
    return step


class _Saver:
    """Writes checkpoints of a run: the collective save; ``write_state(dir, model, engine, loop_state,
    config_text)`` writes what goes in (:func:`mlora.checkpoint.rl_state.write_train_state` for the RL loop,
    :func:`mlora.checkpoint.preference_state.write_preference_state` for SFT / RM / DPO)."""

    def __init__(self, cfg: TrainConfig, mesh, model, engine, root: Path, n_prompts: int, total_steps: int,
                 write_state: Callable = write_train_state) -> None:
        from omegaconf import OmegaConf

        self.cfg, self.mesh, self.model, self.engine, self.root = cfg, mesh, model, engine, root
        self.n_prompts, self.total_steps = n_prompts, total_steps
        self.write_state = write_state
        self.config_text = OmegaConf.to_yaml(OmegaConf.structured(cfg))
        self.meta = {"base_model": base_model_identity(cfg.trainer.policy.model.path)} if mesh.rank == 0 else {}

    def save(self, step: int, epoch: int) -> Path:
        t = self.cfg.trainer
        loop_state = {"step": step, "epoch": epoch, "total_steps": self.total_steps, "seed": t.seed,
                      "n_prompts": self.n_prompts, "train_batch_size": t.train_batch_size}
        meta = {**self.meta, "mesh": {"tp": self.mesh.tp, "pp": self.mesh.pp, "dp": self.mesh.dp}}
        return save_checkpoint(self.root, step, self.mesh,
                               lambda d: self.write_state(d, self.model, self.engine, loop_state, self.config_text),
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
