"""The RL stage of the run loop (:mod:`mlora.train.loop`): rollouts from vLLM engines, rewards, a
shared-base PPO/GRPO/RLOO step, the adapter hand-off, evaluation by sampling.

Global rank 0 owns the inference engines (:class:`Rollouts`); the trainer ranks get
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

from mlora.config.schema import TrainConfig
from mlora.rollout.data import Prompt, load_prompt_set
from mlora.rollout.envs import make_env
from mlora.rollout.generator import Generation, SamplingConfig
from mlora.train import loop
from mlora.train.batch import RolloutBatch
from mlora.train.engine import ActorCriticEngine
from mlora.train.evaluate import evaluate
from mlora.train.from_config import lora_config, ppo_config, sampling_config
from mlora.train.learned_reward import build_learned_reward, env_kwargs
from mlora.train.loop import FROZEN
from mlora.train.metrics_log import log, step_line

POLICY, CRITIC = "policy", "critic"  # the trainer's adapter names; the engines serve POLICY under this name


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


class RLStage:
    """PPO / GRPO / RLOO (``trainer.algorithm``) as a stage of :func:`mlora.train.loop.run`: the prompts,
    the shared base with the policy (and critic) adapters on it, the PPO engine, the learned reward if an
    environment needs one; the engines and the hand-off once opened."""

    def __init__(self, cfg: TrainConfig, mesh) -> None:
        from transformers import AutoTokenizer

        self.cfg, self.mesh = cfg, mesh
        t = cfg.trainer
        tokenizer = AutoTokenizer.from_pretrained(str(t.policy.model.path))
        self.pad_id = tokenizer.pad_token_id or 0
        self.train, self.val = _load_data(cfg, tokenizer)
        self.n_examples, self.evaluates = len(self.train), bool(self.val)
        self.total_steps = loop.total_steps(cfg, self.n_examples)
        self.model, reference = loop.load_model(cfg, mesh)
        self.engine = ActorCriticEngine(self.model, ppo_config(cfg, self.total_steps), policy=POLICY, critic=CRITIC,
                                        reference_adapters=reference,
                                        policy_lora=lora_config(t.policy.model.lora, t.seed),
                                        critic_lora=lora_config(t.critic.model.lora, t.seed))
        # the reward adapter + head, frozen on this same base (env_class=reward_model; mlora.train.learned_reward)
        self.learned = build_learned_reward(cfg, self.model, self.engine, {p.env_class for p in self.train + self.val},
                                            run_frozen=FROZEN if reference else None)
        self.rollouts: Rollouts | None = None
        self.run_dir: Path | None = None

    def open(self, run_dir: Path) -> None:
        """The engines, serving the initial policy adapter."""
        self.run_dir = run_dir
        self.rollouts = Rollouts(self.cfg, self.mesh, run_dir, POLICY)
        self.rollouts.sync(self.model)

    def step(self, step: int, picked: list[int]) -> dict[str, float]:
        """Rollouts -> rewards -> shared-base update -> hand-off."""
        g, t = self.cfg.generator, self.cfg.trainer
        # rollouts of step s sample with seed + 1000·s (+ the prompt's index): no RNG to carry
        sampling = sampling_config(g.sampling_params, g.n_samples_per_prompt, t.seed + step * 1000)
        batch, metrics = self.rollouts.collect([self.train[i] for i in picked], sampling, self.pad_id)
        if self.learned is not None:  # the model-based part of the reward, on the trainer
            metrics.update(self.learned.apply(batch, self.rollouts.last_rows))
        t0 = time.perf_counter()
        metrics.update(self.engine.step(batch))
        metrics["timing/train_s"] = time.perf_counter() - t0
        metrics.update(self.rollouts.sync(self.model))
        return metrics

    def evaluate(self, step: int) -> dict[str, float]:
        return self.rollouts.evaluate(self.val, step, self.run_dir)

    def step_line(self, step: int, metrics: dict[str, float]) -> str:
        return step_line(step, metrics)

    def eval_line(self, metrics: dict[str, float]) -> str:
        return "  ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/"))

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"reward": f"{metrics['reward/mean']:.3f}"}

    def finish(self, run_dir: Path) -> Path:
        """The policy adapter in PEFT format, the plot, and how to serve it."""
        final = run_dir / "final_adapter"
        self.model.save_adapter(POLICY, final)
        if self.mesh.rank == 0:
            _report(self.cfg, run_dir, final, self.rollouts.engine_base)
        return final

    def close(self) -> None:
        if self.rollouts is not None:
            self.rollouts.close()


def run_rl(cfg: TrainConfig, notes: Sequence[str] = (), build_assets: Callable[[str], object] | None = None) -> dict:
    """Train PPO / GRPO / RLOO; returns the last step's metrics (on every rank). See :func:`mlora.train.loop.run`."""
    return loop.run(cfg, RLStage, notes, build_assets)


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

