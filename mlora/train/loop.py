"""The RL loop: rollouts from vLLM engines, rewards, a shared-base PPO/GRPO step, adapter hand-off.

Every rank runs :func:`run`; global rank 0 owns the inference engines and the logs, the trainer
ranks share the rollouts by broadcast. After each update the ``policy`` adapter is gathered over
TP and PP (``save_adapter``) into the sync directory (``lora_sync_path`` on disk, or shared memory)
and hot-swapped into every engine.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

import mlora
from mlora.rollout.data import load_prompts, prompt_text
from mlora.rollout.envs import make_env
from mlora.rollout.generator import Generation, SamplingConfig
from mlora.train.batch import RolloutBatch
from mlora.train.config import PPOConfig
from mlora.train.engine import ActorCriticEngine

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


def ppo_config(cfg) -> PPOConfig:
    t, a = cfg.trainer, cfg.trainer.algorithm
    n = cfg.generator.n_samples_per_prompt
    return PPOConfig(
        advantage_estimator=a.advantage_estimator, gamma=a.gamma, lam=a.lambd,
        norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo, n_samples_per_prompt=n,
        ppo_epochs=t.update_epochs_per_batch, mini_batch_size=t.policy_mini_batch_size * n,
        micro_train_batch_size=t.micro_train_batch_size_per_gpu,
        micro_forward_batch_size=t.micro_forward_batch_size_per_gpu, eps_clip_low=a.eps_clip_low,
        eps_clip_high=a.eps_clip_high, dual_clip=a.dual_clip, value_clip=a.value_clip, loss_agg_mode=a.loss_agg_mode,
        use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef, kl_estimator=a.kl_estimator,
        use_kl_in_reward=a.use_kl_in_reward, kl_ctrl=a.kl_ctrl, kl_coef=a.kl_coef, entropy_coeff=a.entropy_coeff,
        actor_lr=t.policy.optimizer_config.lr, critic_lr=t.critic.optimizer_config.lr,
        weight_decay=t.policy.optimizer_config.weight_decay, max_grad_norm=t.max_grad_norm,
        warmup_steps=t.policy.optimizer_config.num_warmup_steps, total_steps=t.total_steps,
        lr_schedule=t.policy.optimizer_config.scheduler)


def lora_config(section, seed: int) -> mlora.LoraConfig:
    targets = section.target_modules
    targets = list(targets) if not isinstance(targets, str) else targets
    exclude = section.get("exclude_modules")
    return mlora.LoraConfig(rank=section.rank, alpha=section.alpha, dropout=section.dropout, target_modules=targets,
                            exclude_modules=list(exclude) if exclude else None, seed=seed)


def _sync_dir(cfg) -> Path:
    if cfg.generator.weight_sync == "memory":
        shm = Path("/dev/shm")
        if not shm.is_dir():
            raise RuntimeError("generator.weight_sync=memory needs /dev/shm (shared memory); use disk")
        return shm / f"mlora-{os.getpid()}-{cfg.trainer.run_name}" / "policy"
    if cfg.generator.weight_sync == "disk":
        return Path(cfg.trainer.policy.model.lora.lora_sync_path) / "policy"
    raise ValueError(f"unknown generator.weight_sync {cfg.generator.weight_sync!r}; valid: disk, memory")


class _Logger:
    def __init__(self, cfg, run_dir: Path) -> None:
        self.file = open(run_dir / "metrics.jsonl", "w")  # a new run starts a new record
        self.kind = cfg.trainer.logger
        self.backend = None
        if self.kind == "wandb":
            import wandb

            self.backend = wandb.init(project=cfg.trainer.project_name, name=cfg.trainer.run_name)
        elif self.kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.backend = SummaryWriter(str(run_dir / "tensorboard"))
        elif self.kind != "console":
            raise ValueError(f"unknown trainer.logger {self.kind!r}; valid: console, wandb, tensorboard")

    def log(self, step: int, metrics: dict) -> None:
        flat = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        self.file.write(json.dumps({"step": step, **flat}) + "\n")
        self.file.flush()
        if self.kind == "wandb":
            self.backend.log(flat, step=step)
        elif self.kind == "tensorboard":
            for k, v in flat.items():
                self.backend.add_scalar(k, v, step)

    def close(self) -> None:
        self.file.close()
        if self.kind == "tensorboard":
            self.backend.close()


def run(cfg) -> dict:
    """Train; returns the last step's metrics (on every rank)."""
    from transformers import AutoTokenizer

    t = cfg.trainer
    if cfg.get("demo", {}).get("prepare") and int(os.environ.get("RANK", "0")) == 0:
        from mlora.demos.rl_assets import build_demo_assets

        build_demo_assets(cfg.demo.dir)
    mesh = mlora.init_parallel(tp=t.placement.tp, pp=t.placement.pp, sp=t.placement.sp, seed=t.seed)
    dist.barrier()
    env = make_env(cfg.environment.env_class)
    if cfg.generator.backend != "vllm":
        raise ValueError(f"unknown generator.backend {cfg.generator.backend!r}; valid: vllm")
    rows = [r for path in cfg.data.train_data for r in load_prompts(path)]
    if str(t.critic.model.path) != str(t.policy.model.path) and t.algorithm.advantage_estimator == "gae":
        raise ValueError("a critic on another base than the policy is not supported yet: set "
                         "trainer.critic.model.path to trainer.policy.model.path (one shared base)")
    model = mlora.from_pretrained(t.policy.model.path, mesh, dtype=getattr(torch, t.dtype))
    tokenizer = AutoTokenizer.from_pretrained(str(t.policy.model.path))
    frozen = t.policy.model.get("frozen_adapter_path")
    if frozen:  # e.g. an SFT adapter: under policy, critic and reference alike
        model.load_adapter(FROZEN, frozen, trainable=False)
    engine = ActorCriticEngine(model, ppo_config(cfg), reference_adapters=(FROZEN,) if frozen else (),
                               policy_lora=lora_config(t.policy.model.lora, t.seed),
                               critic_lora=lora_config(t.critic.model.lora, t.seed + 1))
    run_dir = Path(t.run_dir)
    sampling = SamplingConfig(temperature=cfg.generator.sampling_params.temperature,
                              top_p=cfg.generator.sampling_params.top_p,
                              max_generate_length=cfg.generator.sampling_params.max_generate_length,
                              n_samples_per_prompt=cfg.generator.n_samples_per_prompt, seed=t.seed)
    sync_dir = _sync_dir(cfg)
    generator = logger = bar = None
    last: dict = {}
    try:
        if mesh.rank == 0:
            from tqdm import tqdm

            from mlora.rollout.vllm_engine import build_engines

            run_dir.mkdir(parents=True, exist_ok=True)
            logger = _Logger(cfg, run_dir)
            g = cfg.generator
            engine_base = t.policy.model.path
            if frozen:  # the engines load the base with the frozen adapter merged, once
                from mlora.export.merge import merge_adapter

                engine_base = merge_adapter(engine_base, frozen, run_dir / "engine_base", progress=False)
            generator = build_engines(engine_base, g.num_inference_engines,
                                      g.inference_engine_tensor_parallel_size, g.run_engines_locally,
                                      ship_adapter=g.weight_sync == "memory",
                                      max_lora_rank=t.policy.model.lora.rank, dtype=t.dtype, seed=t.seed,
                                      kv_cache_memory_bytes=g.kv_cache_memory_bytes,
                                      **dict(g.get("engine_init_kwargs") or {}))
            bar = tqdm(total=t.total_steps, desc="mlora-train", unit="step")
        model.save_adapter("policy", sync_dir)
        if generator is not None:
            generator.update_adapter(sync_dir)
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(t.seed)).tolist()
        for step in range(1, t.total_steps + 1):
            start = (step - 1) * t.train_batch_size
            picked = [rows[order[(start + i) % len(rows)]] for i in range(t.train_batch_size)]
            box = [None]
            if mesh.rank == 0:
                t0 = time.perf_counter()
                prompts = [tokenizer(prompt_text(r, tokenizer), add_special_tokens=True)["input_ids"] for r in picked]
                gens = generator.generate(prompts, SamplingConfig(**{**sampling.__dict__, "seed": t.seed + step * 1000}))
                rewards = [env.reward(picked[g.prompt_index], g.text, g.token_ids) for g in gens]
                box = [(prompts, gens, rewards, time.perf_counter() - t0)]
            dist.broadcast_object_list(box, src=0)
            prompts, gens, rewards, gen_time = box[0]
            batch = build_batch(prompts, gens, rewards, tokenizer.pad_token_id or 0)
            t0 = time.perf_counter()
            metrics = engine.step(batch)
            metrics["timing/generate_s"] = gen_time
            metrics["timing/train_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.save_adapter("policy", sync_dir)
            metrics["timing/adapter_gather_s"] = time.perf_counter() - t0
            if generator is not None:
                metrics["timing/adapter_swap_s"] = generator.update_adapter(sync_dir)
            metrics["timing/adapter_sync_s"] = time.perf_counter() - t0
            if t.ckpt_interval and step % t.ckpt_interval == 0:
                save_checkpoint(model, engine, Path(t.ckpt_path or run_dir / "checkpoints") / f"global_step_{step}")
            if mesh.rank == 0:
                logger.log(step, metrics)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
                print(f"step {step:3d}  reward {metrics['reward/mean']:.3f}  kl {metrics['kl/mean']:.4f}  "
                      f"actor/pg_loss {metrics['actor/pg_loss']:+.4f}"
                      + (f"  critic/value_loss {metrics['critic/value_loss']:.4f}" if "critic/value_loss" in metrics
                         else "")
                      + f"  |logp vLLM - trainer| {metrics.get('rollout/logprob_abs_diff', float('nan')):.2e}"
                      + f"  sync {metrics['timing/adapter_sync_s']:.2f}s", flush=True)
            last = metrics
        final = run_dir / "final_adapter"
        model.save_adapter("policy", final)
        save_checkpoint(model, engine, Path(t.ckpt_path or run_dir / "checkpoints") / f"global_step_{t.total_steps}")
        if mesh.rank == 0:
            from mlora.train.plot import plot_metrics

            png = plot_metrics(run_dir / "metrics.jsonl", run_dir / "metrics.png")
            print(f"\nmetrics: {run_dir / 'metrics.jsonl'}\nplot: {png}\nfinal adapter (PEFT): {final}\n"
                  + (f"(it applies on top of {frozen}, merged into the base in {engine_base})\n" if frozen else "")
                  + f"serve it with vLLM:\n  vllm serve {engine_base} --enable-lora "
                  f"--max-lora-rank {t.policy.model.lora.rank} --lora-modules policy={final.resolve()}")
    finally:
        if bar is not None:
            bar.close()
        if logger is not None:
            logger.close()
        if generator is not None:
            generator.close()
        if cfg.generator.weight_sync == "memory" and mesh.rank == 0:
            shutil.rmtree(sync_dir.parent, ignore_errors=True)
    return last


def save_checkpoint(model, engine: ActorCriticEngine, directory: Path) -> None:
    """Adapters in PEFT layout (mesh-independent) under ``<dir>/adapters/<name>/``."""
    for name in (engine.policy, engine.critic):
        if name is not None:
            model.save_adapter(name, directory / "adapters" / name)
