"""PPO / GRPO hyper-parameters (the keys of verl's and SkyRL's ``algorithm`` sections)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mlora.rl.advantages import ADVANTAGE_ESTIMATORS, CRITIC_ESTIMATORS
from mlora.rl.kl import KL_CONTROLLERS, KL_ESTIMATORS
from mlora.rl.losses import LOSS_AGG_MODES
from mlora.rl.lr_schedule import LR_SCHEDULES
from mlora.rl.policy_losses import POLICY_LOSSES, PolicyLossParams, ratio_to_rollout
from mlora.rl.rollout_correction import OffPolicyCorrection
from mlora.rollout.generator import check_truncation
from mlora.train.micro_batches import Packing


@dataclass
class PPOConfig:
    advantage_estimator: str = "gae"  # gae | grpo | rloo | reinforce++ | maxrl (only gae has a critic)
    gamma: float = 1.0
    lam: float = 0.95
    norm_adv_by_std_in_grpo: bool = True
    # SkyRL's advantage_batch_normalize: advantages z-scored over the batch's response tokens before the reduction
    advantage_batch_normalize: bool = False
    # mlora's multi-turn GAE (opt-in): the recursion skips the environment's tokens between turns; SkyRL's
    # (default) runs through them with the critic's values there
    gae_skip_observations: bool = False
    n_samples_per_prompt: int = 1
    ppo_epochs: int = 1
    mini_batch_size: int = 8  # sequences per optimizer step (global, over DP)
    critic_mini_batch_size: int | None = None  # sequences per critic optimizer step; None: mini_batch_size
    micro_train_batch_size: int = 2  # sequences per micro-batch on one DP rank
    micro_forward_batch_size: int = 4  # for the forward-only passes
    packing: Packing = field(default_factory=Packing)  # sequence packing (trainer.use_sample_packing)
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    # SkyRL's policy losses (mlora.rl.policy_losses): regular, dual_clip, gspo, sapo, cispo, rollout_is, dppo,
    # clip_cov, kl_cov, cross_entropy, importance_sampling; their other settings in loss_settings
    policy_loss_type: str = "regular"
    loss_settings: PolicyLossParams = field(default_factory=PolicyLossParams)
    off_policy: OffPolicyCorrection = field(default_factory=OffPolicyCorrection)  # TIS and masks (off by default)
    value_clip: float | None = 0.2  # None: unclipped
    loss_agg_mode: str = "token-mean"
    max_seq_len: int | None = None  # the constant divisor of "seq-mean-token-sum-norm" (Dr. GRPO); required there
    # The distribution the rollouts were sampled from (generator.sampling_params): every trainer
    # log-prob and entropy (old, new, reference) is of softmax(logits / temperature). top_k, top_p and
    # min_p enter only the log-prob compared with the engine's (rollout/logprob_abs_diff), not the loss.
    temperature: float = 1.0
    top_p: float = 1.0  # 1 = off
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0  # 0 = off
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_estimator: str = "k3"
    use_kl_in_reward: bool = False
    kl_ctrl: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    kl_target: float = 0.1
    kl_horizon: int = 10000
    entropy_coeff: float = 0.0
    # optimizers: the unprefixed fields are the actor's (policy), critic_* the critic's
    actor_lr: float = 1e-5
    critic_lr: float = 5e-6
    weight_decay: float = 0.0  # AdamW decoupled weight decay of the actor
    critic_weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas of the actor
    critic_betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = 1.0  # gradient clipping of the actor (None: off)
    critic_max_grad_norm: float | None = 1.0
    warmup_steps: int = 0  # linear warm-up steps of the actor
    critic_warmup_steps: int = 0
    total_steps: int = 1000  # optimizer steps of the actor over the run (warm-up + cosine schedule length)
    critic_total_steps: int | None = None  # of the critic; None: total_steps
    min_lr_ratio: float = 0.0
    lr_schedule: str = "cosine"  # actor: cosine | constant | constant_with_warmup (warm-up first in all three)
    critic_lr_schedule: str = "cosine"

    def __post_init__(self) -> None:
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"unknown advantage estimator {self.advantage_estimator!r}; "
                             f"valid: {', '.join(ADVANTAGE_ESTIMATORS)}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss aggregation mode {self.loss_agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
        if self.policy_loss_type not in POLICY_LOSSES:
            raise ValueError(f"unknown policy_loss_type {self.policy_loss_type!r}; valid: {', '.join(POLICY_LOSSES)}")
        if self.off_policy.enabled and not POLICY_LOSSES[self.policy_loss_type][1]:
            raise ValueError(f"policy_loss_type={self.policy_loss_type!r} takes no off-policy correction (SkyRL "
                             "applies none to it): turn off_policy_correction off or choose one of "
                             + ", ".join(k for k, (_, takes) in POLICY_LOSSES.items() if takes))
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown KL estimator {self.kl_estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
        if self.kl_ctrl not in KL_CONTROLLERS:
            raise ValueError(f"unknown kl_ctrl {self.kl_ctrl!r}; valid: {', '.join(KL_CONTROLLERS)}")
        for name in ("lr_schedule", "critic_lr_schedule"):
            if getattr(self, name) not in LR_SCHEDULES:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; valid: {', '.join(LR_SCHEDULES)}")
        for name in ("mini_batch_size", "micro_train_batch_size", "micro_forward_batch_size", "ppo_epochs",
                     "n_samples_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.critic_mini_batch_size is not None and self.critic_mini_batch_size < 1:
            raise ValueError(f"critic_mini_batch_size={self.critic_mini_batch_size} must be >= 1 "
                             "(or None for mini_batch_size)")
        for name in ("warmup_steps", "critic_warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.max_seq_len is None:
            raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' divides by max_seq_len: set max_seq_len "
                             "(prompt + response length, e.g. max_input_length + max_generate_length)")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ValueError(f"max_seq_len={self.max_seq_len} must be >= 1")
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (PPO needs the log-probs of a sampling "
                             "distribution; greedy rollouts have none)")
        check_truncation(self.top_p, self.top_k, self.min_p)
        if self.packing.enabled and self.loss_agg_mode == "token-mean-legacy":
            raise ValueError("loss_agg_mode='token-mean-legacy' averages per micro-batch, which packing regroups: "
                             "with use_sample_packing choose one of " + ", ".join(
                                 m for m in LOSS_AGG_MODES if m != "token-mean-legacy"))

    @property
    def critic_mini_batch(self) -> int:
        """Sequences per critic optimizer step."""
        return self.mini_batch_size if self.critic_mini_batch_size is None else self.critic_mini_batch_size

    @property
    def uses_critic(self) -> bool:
        return self.advantage_estimator in CRITIC_ESTIMATORS

    @property
    def needs_rollout_logprobs(self) -> bool:
        """Whether the update cannot run without the engine's log-probs (rollout_is, CISPO anchored on the
        rollout, rollout correction)."""
        needs_mu = ratio_to_rollout(self.policy_loss_type, self.loss_settings) and self.policy_loss_type != "dppo"
        return needs_mu or self.off_policy.enabled

    @property
    def loss_params(self) -> PolicyLossParams:
        """The policy loss's settings, PPO's clip range included."""
        return replace(self.loss_settings, eps_clip_low=self.eps_clip_low, eps_clip_high=self.eps_clip_high)
