"""PPO / GRPO hyper-parameters (the keys of verl's and SkyRL's ``algorithm`` sections)."""

from __future__ import annotations

from dataclasses import dataclass

from mlora.rl.kl import KL_ESTIMATORS
from mlora.rl.losses import LOSS_AGG_MODES

ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo")


@dataclass
class PPOConfig:
    advantage_estimator: str = "gae"  # gae | grpo | rloo (no critic for the latter two)
    gamma: float = 1.0
    lam: float = 0.95
    norm_adv_by_std_in_grpo: bool = True
    n_samples_per_prompt: int = 1
    ppo_epochs: int = 1
    mini_batch_size: int = 8  # sequences per optimizer step (global, over DP)
    micro_train_batch_size: int = 2  # sequences per micro-batch on one DP rank
    micro_forward_batch_size: int = 4  # for the forward-only passes
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    dual_clip: float | None = None
    value_clip: float = 0.2
    loss_agg_mode: str = "token-mean"
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_estimator: str = "k3"
    use_kl_in_reward: bool = False
    kl_ctrl: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    kl_target: float = 0.1
    kl_horizon: int = 10000
    entropy_coeff: float = 0.0
    actor_lr: float = 1e-5
    critic_lr: float = 5e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 0
    total_steps: int = 1000
    min_lr_ratio: float = 0.0
    lr_schedule: str = "cosine"  # cosine | constant

    def __post_init__(self) -> None:
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"unknown advantage estimator {self.advantage_estimator!r}; "
                             f"valid: {', '.join(ADVANTAGE_ESTIMATORS)}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss aggregation mode {self.loss_agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown KL estimator {self.kl_estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
        if self.kl_ctrl not in ("fixed", "adaptive"):
            raise ValueError(f"unknown kl_ctrl {self.kl_ctrl!r}; valid: fixed, adaptive")
        if self.lr_schedule not in ("cosine", "constant"):
            raise ValueError(f"unknown lr_schedule {self.lr_schedule!r}; valid: cosine, constant")
        for name in ("mini_batch_size", "micro_train_batch_size", "micro_forward_batch_size", "ppo_epochs",
                     "n_samples_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    @property
    def uses_critic(self) -> bool:
        return self.advantage_estimator == "gae"
