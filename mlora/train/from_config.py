"""The typed run configuration turned into the library's objects (PPOConfig, LoraConfig, SamplingConfig)."""

from __future__ import annotations

import torch

import mlora
from mlora.config.dtypes import trainer_dtype
from mlora.config.schema import LoraSection, SamplingSection, TrainConfig, TrainerSection
from mlora.config.validate import LOSS_REDUCTIONS, loss_settings
from mlora.rl.rollout_correction import OffPolicyCorrection
from mlora.rollout.generator import SamplingConfig
from mlora.train.config import PPOConfig
from mlora.train.micro_batches import Packing


def ppo_config(cfg: TrainConfig, total_steps: int) -> PPOConfig:
    """PPO/GRPO hyper-parameters for a run of ``total_steps`` RL steps; batch sizes in prompts become
    sequences (x n_samples_per_prompt), schedule lengths count optimizer steps (one per mini-batch)."""
    t, a, s = cfg.trainer, cfg.trainer.algorithm, cfg.generator.sampling_params
    n = cfg.generator.n_samples_per_prompt
    pol, cri = t.policy.optimizer_config, t.critic.optimizer_config
    critic_mini = t.critic_mini_batch_size or t.policy_mini_batch_size
    actor_steps = total_steps * t.update_epochs_per_batch * (t.train_batch_size // t.policy_mini_batch_size)
    critic_steps = total_steps * t.update_epochs_per_batch * (t.train_batch_size // critic_mini)
    return PPOConfig(
        advantage_estimator=a.advantage_estimator, gamma=a.gamma, lam=a.lambd,
        norm_adv_by_std_in_grpo=a.grpo_norm_by_std, advantage_batch_normalize=a.advantage_batch_normalize,
        gae_skip_observations=a.gae_skip_observations, n_samples_per_prompt=n, ppo_epochs=t.update_epochs_per_batch,
        mini_batch_size=t.policy_mini_batch_size * n,
        critic_mini_batch_size=critic_mini * n,
        micro_train_batch_size=t.micro_train_batch_size_per_gpu,
        micro_forward_batch_size=t.micro_forward_batch_size_per_gpu, packing=packing(t),
        eps_clip_low=a.eps_clip_low, eps_clip_high=a.eps_clip_high,
        value_clip=a.value_clip, policy_loss_type=a.policy_loss_type, loss_settings=loss_settings(a),
        off_policy=OffPolicyCorrection(**vars(a.off_policy_correction)),
        loss_agg_mode=LOSS_REDUCTIONS[a.loss_reduction], max_seq_len=a.max_seq_len,
        use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef, kl_estimator=a.kl_estimator_type,
        use_kl_in_reward=a.use_kl_in_reward, kl_ctrl=a.kl_ctrl.type,
        kl_coef=a.kl_loss_coef if a.kl_coef is None else a.kl_coef, kl_target=a.kl_ctrl.kl_target,
        kl_horizon=a.kl_ctrl.horizon, entropy_coeff=a.entropy_loss_coef if a.use_entropy_loss else 0.0,
        temperature=s.temperature if a.temperature is None else a.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        actor_lr=pol.lr, weight_decay=pol.weight_decay, betas=tuple(pol.adam_betas),
        warmup_steps=pol.num_warmup_steps, lr_schedule=pol.scheduler, max_grad_norm=pol.max_grad_norm,
        critic_lr=cri.lr, critic_weight_decay=cri.weight_decay, critic_betas=tuple(cri.adam_betas),
        critic_warmup_steps=cri.num_warmup_steps, critic_lr_schedule=cri.scheduler,
        critic_max_grad_norm=cri.max_grad_norm, total_steps=actor_steps, critic_total_steps=critic_steps)


def packing(t: TrainerSection) -> Packing:
    """``trainer.use_sample_packing`` and ``trainer.max_tokens_per_microbatch`` (after validation merged the alias)."""
    return Packing(enabled=bool(t.use_sample_packing), max_tokens=max(t.max_tokens_per_microbatch, 0))


def recompute_kwargs(t: TrainerSection) -> dict:
    """:func:`mlora.from_pretrained`'s activation-recompute arguments from the trainer keys (after
    :func:`mlora.config.validate.finalize`, which resolved ``trainer.gradient_checkpointing`` into
    ``trainer.recompute``)."""
    return dict(recompute=t.recompute, recompute_method=t.recompute_method,
                recompute_num_layers=t.recompute_num_layers,
                recompute_modules=None if t.recompute_modules is None else list(t.recompute_modules))


def model_kwargs(t: TrainerSection) -> dict:
    """:func:`mlora.from_pretrained`'s arguments after the path and mesh, from the trainer keys: dtype, FP8,
    the LoRA branch's dtype, the core attention (``trainer.flash_attn``: true is torch's fused
    scaled_dot_product_attention, false megatron's unfused ``DotProductAttention``) and recompute."""
    dtype = trainer_dtype(t.dtype, torch.cuda.is_available())
    return dict(dtype=getattr(torch, dtype), fp8=t.fp8, fp8_recipe=t.fp8_recipe,
                lora_compute_dtype=lora_compute_dtype(t), attention=attention_impl(t), **recompute_kwargs(t))


def attention_impl(t: TrainerSection) -> str:
    """``trainer.flash_attn`` as :func:`mlora.from_pretrained`'s ``attention``."""
    return "sdpa" if t.flash_attn else "unfused"


def lora_compute_dtype(t: TrainerSection) -> torch.dtype | None:
    """``trainer.lora_compute_dtype`` as a torch dtype (None: the adapters' float32 masters decide)."""
    return None if t.lora_compute_dtype is None else getattr(torch, t.lora_compute_dtype)


def lora_config(section: LoraSection, seed: int) -> mlora.LoraConfig:
    targets = section.target_modules
    exclude = section.exclude_modules
    return mlora.LoraConfig(rank=section.rank, alpha=section.alpha, dropout=section.dropout,
                            target_modules=targets if isinstance(targets, str) else list(targets),
                            exclude_modules=[exclude] if isinstance(exclude, str) else
                            (list(exclude) if exclude else None),
                            seed=seed, init_method=section.init_method, expert_rank=section.expert_rank)


def sampling_config(s: SamplingSection, n_samples: int, seed: int | None) -> SamplingConfig:
    return SamplingConfig(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                          max_generate_length=s.max_generate_length, n_samples_per_prompt=n_samples, seed=seed,
                          stop=tuple(s.stop or ()))
