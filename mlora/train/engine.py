"""The shared-base actor/critic engine: one frozen base per rank, policy and critic as adapters.

Actor = base (+ frozen stacked adapters) + ``policy``; critic = the same + ``critic`` + value
head; reference = the base with the RL adapters off. All passes run through megatron's
pipeline schedule in micro-batches; each DP rank takes its slice of every mini-batch; losses
are normalised by global counts so that the plain sum of gradients over micro-batches and DP
ranks is the gradient of the mini-batch loss (see :mod:`mlora.lora.grads`).

Every log-prob and entropy (old, new, reference) is of ``softmax(logits / temperature)``, the
distribution the rollouts were drawn from (``PPOConfig.temperature``, as verl and SkyRL do); the
engine's own log-probs (vLLM's processed ones, after min-p / top-k / top-p) are compared with the
same truncation reproduced vocab-parallel. Update passes run in train mode (LoRA dropout on),
forward-only passes in eval mode.
"""

from __future__ import annotations

from typing import Sequence

import torch

from mlora.checkpoint.run_state import VALUE_HEAD, StageState, TrainedAdapter, head_parameters
from mlora.facade.model import MLoraModel
from mlora.lora.config import LoraConfig
from mlora.rl import AdaptiveKLController, FixedKLController, gae_advantages, kl_penalty, value_loss
from mlora.rl.advantages import (
    broadcast_to_tokens,
    grpo_advantages,
    maxrl_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from mlora.rl.kl import apply_kl_in_reward
from mlora.rl.losses import micro_batch_token_mean_term, reduction_scale, sequence_mean_term
from mlora.rl.masked import masked_mean, masked_sum
from mlora.rl.policy_losses import POLICY_LOSSES, token_policy_loss
from mlora.rl.rollout_correction import off_policy_correction
from mlora.rl.vocab_parallel import next_token_logits, vocab_parallel_logprobs, vocab_parallel_truncation_logmass
from mlora.train import joint_passes
from mlora.train.batch import RolloutBatch
from mlora.train.config import PPOConfig
from mlora.train.joint_passes import JointBatch, Trained
from mlora.train.micro_batches import last_token_scores, unpack_tokens
from mlora.train.optim import build_optimizer


class ActorCriticEngine:
    """PPO / GRPO / RLOO updates of LoRA adapters on one shared frozen base."""

    def __init__(self, model: MLoraModel, cfg: PPOConfig, policy: str = "policy", critic: str = "critic",
                 reference_adapters: Sequence[str] = (), policy_lora: LoraConfig | None = None,
                 critic_lora: LoraConfig | None = None) -> None:
        self.model, self.cfg, self.mesh = model, cfg, model.mesh
        self.policy, self.critic = policy, (critic if cfg.uses_critic else None)
        self.reference = tuple(reference_adapters)
        model._require(*self.reference)
        # an experiment's adapters (e/policy, e/critic) draw by their role's name: each starts where a run of its
        # own with the same seed starts (mlora.train.experiments)
        if policy not in model.adapters:
            model.add_adapter(policy, policy_lora or LoraConfig(), key=policy.rsplit("/", 1)[-1])
        model.require_peft_loadable(policy)  # exported in PEFT's format (trainer.hf_save_interval, the final adapter)
        model.set_trainable(policy, True)
        self.actor_params = model.adapter_parameters(policy)
        self.actor_opt, self.actor_sched = build_optimizer(
            self.actor_params, cfg.actor_lr, weight_decay=cfg.weight_decay, betas=cfg.betas,
            warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps, min_lr_ratio=cfg.min_lr_ratio,
            schedule=cfg.lr_schedule)
        if self.critic is not None:
            if self.critic not in model.adapters:
                model.add_adapter(self.critic, critic_lora or LoraConfig(seed=1), key=self.critic.rsplit("/", 1)[-1])
            model.set_trainable(self.critic, True)
            if self.critic not in model.heads:
                model.add_value_head(self.critic)
            head = model.heads[self.critic] if self.critic in model.heads else None
            self.critic_params = model.adapter_parameters(self.critic) + (list(head.parameters()) if head else [])
            self.critic_opt, self.critic_sched = build_optimizer(
                self.critic_params, cfg.critic_lr, weight_decay=cfg.critic_weight_decay, betas=cfg.critic_betas,
                warmup_steps=cfg.critic_warmup_steps, total_steps=cfg.critic_total_steps or cfg.total_steps,
                min_lr_ratio=cfg.min_lr_ratio,
                schedule=cfg.critic_lr_schedule)
        self.kl_ctrl = (AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.kl_ctrl == "adaptive"
                        else FixedKLController(cfg.kl_coef))
        self.global_step = 0
        self.last_trained: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ checkpoint
    def stage_state(self) -> StageState:
        """What this engine trains, for :mod:`mlora.checkpoint.run_state`: the policy (actor) and, with a
        critic, the critic adapter and its value head."""
        trained = [TrainedAdapter("actor", self.policy, self.actor_opt, self.actor_sched)]
        if self.critic is not None:
            trained.append(TrainedAdapter("critic", self.critic, self.critic_opt, self.critic_sched,
                                          head_parameters(self.model, self.critic, VALUE_HEAD)))
        return StageState("rl", trained, {"global_step": self.global_step, "kl_coef": self.kl_ctrl.value})

    def restore_counters(self, counters: dict[str, float]) -> None:
        self.global_step, self.kl_ctrl.value = int(counters["global_step"]), counters["kl_coef"]

    # ------------------------------------------------------------------ sizes
    def _check_sizes(self, batch: RolloutBatch, joint: bool = False) -> None:
        """The batch and mini-batch sizes this engine's step can split. ``joint``: one of several experiments'
        batches in a joint step (:func:`step_experiments`): micro-batches may mix experiments, so each
        data-parallel rank need only take an equal share of every mini-batch, and the rows of a whole pass
        must fill micro-batches (:meth:`mlora.train.joint_passes.JointBatch.micro_batches` checks that)."""
        c, dp = self.cfg, self.mesh.dp
        who = f"{self.policy}: " if joint else ""
        sizes = [("mini_batch_size", c.mini_batch_size)]
        if self.critic is not None:
            sizes.append(("critic_mini_batch_size", c.critic_mini_batch))
        for name, size in sizes:
            if batch.size % size:
                raise ValueError(f"{who}batch of {batch.size} sequences is not divisible by {name}={size}")
            if joint and size % dp:
                raise ValueError(f"{who}{name}={size} is not divisible by the data-parallel size {dp}")
            if not joint and size % (c.micro_train_batch_size * dp):
                raise ValueError(f"{name}={size} is not divisible by micro_train_batch_size x DP = "
                                 f"{c.micro_train_batch_size} x {dp}; valid mini-batch sizes are multiples of "
                                 f"{c.micro_train_batch_size * dp}")
        if not joint and batch.size % (c.micro_forward_batch_size * dp):
            raise ValueError(f"batch of {batch.size} sequences is not divisible by micro_forward_batch_size x DP = "
                             f"{c.micro_forward_batch_size} x {dp}")
        if c.advantage_estimator != "gae" and batch.size % c.n_samples_per_prompt:
            raise ValueError(f"batch of {batch.size} is not a whole number of groups of "
                             f"n_samples_per_prompt={c.n_samples_per_prompt}")

    # ------------------------------------------------------------------ forward-only passes
    def _token_logprobs(self, logits: torch.Tensor, mb: dict, with_entropy: bool):
        """``[rows, S - 1]`` log-probs (and entropy) of the next tokens under ``softmax(logits / temperature)``,
        the distribution the rollouts were sampled from before truncation; vocab-parallel."""
        lo, hi = self.model.vocab_shard_range()
        logprob, entropy = vocab_parallel_logprobs(
            next_token_logits(logits), mb["input_ids"][:, 1:].to(logits.device), lo, hi - lo,
            self.mesh.tp_group if self.mesh.tp > 1 else None, with_entropy, self.cfg.temperature)
        return unpack_tokens(logprob, mb, 1), None if entropy is None else unpack_tokens(entropy, mb, 1)

    @property
    def _sampling_truncated(self) -> bool:
        c = self.cfg
        return c.top_p < 1.0 or c.top_k > 0 or c.min_p > 0.0

    def _old_and_sampled_logprobs(self, logits: torch.Tensor, mb: dict) -> torch.Tensor:
        """``[b, S - 1, 2]``: the tempered log-probs (PPO's old log-probs) and the log-probs under the
        distribution vLLM sampled from (tempered, then min-p / top-k / top-p, renormalised), which
        is what the engine reports with ``logprobs_mode="processed_logprobs"``: for the gap metric only."""
        logprob, _ = self._token_logprobs(logits, mb, False)
        sampled = logprob
        if self._sampling_truncated:
            c, (lo, hi) = self.cfg, self.model.vocab_shard_range()
            sampled = logprob - unpack_tokens(vocab_parallel_truncation_logmass(
                next_token_logits(logits), hi - lo, self.mesh.tp_group if self.mesh.tp > 1 else None, c.temperature, c.top_k,
                c.top_p, c.min_p), mb, 1)
        return torch.stack([logprob, sampled], dim=-1)

    def _values(self, hidden: torch.Tensor, mb: dict) -> torch.Tensor:
        return unpack_tokens(self.model.heads[self.critic](hidden)[..., 0][:, :-1].float(), mb, 1)

    def _forward_pass(self, batch: RolloutBatch, adapters: tuple[str, ...], values: bool,
                      sampled: bool = False) -> torch.Tensor:
        """Per-action log-probs (or values) of the whole batch under ``adapters``, on every rank, in eval mode.

        ``sampled``: ``[B, S - 1, 2]``, the log-probs and the engine-comparable ones
        (:meth:`_old_and_sampled_logprobs`)."""
        if values:
            fn, trailing = self._values, ()
        elif sampled:
            fn, trailing = self._old_and_sampled_logprobs, (2,)
        else:
            fn, trailing = self._logprobs, ()
        joint = JointBatch([self], [batch])
        return joint_passes.forward(joint, [0], adapters, {}, {0: fn}, values, (joint.width - 1, *trailing))[0]

    def _logprobs(self, logits: torch.Tensor, mb: dict) -> torch.Tensor:
        return self._token_logprobs(logits, mb, False)[0]

    # ------------------------------------------------------------------ learned reward (env_class=reward_model)
    def reward_scores(self, batch: RolloutBatch, adapters: tuple[str, ...], head: str) -> torch.Tensor:
        """``[B]`` float32 on every rank: scalar head ``head`` on the last token of each prompt+response
        under ``adapters`` (a frozen reward adapter on this same base; see
        :func:`mlora.export.reward_adapter.load_reward_adapter`). The same forward-only pass as the
        values: micro-batches through megatron's schedule, each DP rank its slice, eval mode."""
        self._check_sizes(batch)
        module = self.model.heads[head] if self.mesh.is_last_stage else None

        def fn(hidden, mb):
            return last_token_scores(module, hidden, mb)

        return joint_passes.forward(JointBatch([self], [batch]), [0], adapters, {}, {0: fn}, True, ())[0]

    # ------------------------------------------------------------------ advantages
    def compute_advantages(self, batch: RolloutBatch, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                           values: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """:func:`compute_advantages` with this engine's settings and KL-in-reward coefficient."""
        return compute_advantages(self.cfg, batch, old_logprobs, ref_logprobs, values, self.kl_ctrl.value)

    # ------------------------------------------------------------------ updates
    def _clip_cov_generator(self, mb: dict) -> torch.Generator | None:
        """clip_cov's random token choice: seeded by the step and the micro-batch's first row, so that every
        TP rank of a micro-batch cuts the same tokens."""
        if self.cfg.policy_loss_type != "clip_cov":
            return None
        seed = (self.global_step * 1_000_003 + self.mesh.dp_rank * 10_007 + int(mb["rows"][0])) % (2 ** 63)
        return torch.Generator().manual_seed(seed)

    def _actor_loss(self, rows: int, tokens: float):
        """The actor's loss of a micro-batch of a mini-batch of ``rows`` rows and ``tokens`` loss tokens, as SkyRL
        forms it (``worker.py``): the policy loss summed over the tokens (its advantages already scaled by the
        loss reduction), the KL term a per-row token mean averaged over the mini-batch's rows, the entropy term
        this micro-batch's token mean weighted by its share of the rows; both whatever ``loss_reduction`` is."""
        c, params = self.cfg, self.cfg.loss_params

        def loss_fn(logits, mb):
            mask = mb["action_mask"].to(logits.device)
            logprob, entropy = self._token_logprobs(logits, mb, with_entropy=True)
            tok, m = token_policy_loss(c.policy_loss_type, logprob, mb["old_logprobs"], mb["advantages"], mask,
                                       params, mb.get("rollout_logprobs"), self._clip_cov_generator(mb))
            weights = mb.get("is_weights")  # rollout correction (TIS, masks): None when off
            if weights is not None:
                tok = tok * weights
            pg = (tok * mask).sum()
            ent = micro_batch_token_mean_term(entropy, mask, rows)
            kl = sequence_mean_term(kl_penalty(logprob, mb["ref_logprobs"], c.kl_estimator) * mask, mask, rows)
            loss = pg - c.entropy_coeff * ent + (c.kl_loss_coef * kl if c.use_kl_loss else 0.0)
            share = mask.sum() / max(tokens, 1.0)  # token-weighted, so micro-batch sums are mini-batch means
            # the entropy metric: the mini-batch's token mean (the loss term's weighting depends on the micro-batch cut)
            return loss, {"pg_loss": pg.detach(), "entropy": (masked_sum(entropy, mask) / max(tokens, 1.0)).detach(),
                          "kl_loss": kl.detach(),
                          "loss": loss.detach(), "clipfrac": m["clipfrac"] * share, "ppo_kl": m["ppo_kl"] * share}

        return loss_fn

    def _critic_loss(self, rows: int, tokens: float):
        """SkyRL's critic loss (``ppo_critic_loss``): each row's token mean of the (clipped) squared error, averaged
        over the mini-batch's rows, whatever ``loss_reduction`` is."""
        c = self.cfg

        def loss_fn(hidden, mb):
            mask = mb["action_mask"].to(hidden.device)
            values = self._values(hidden, mb)
            vl, m = value_loss(values, mb["old_values"], mb["returns"], mask, c.value_clip, "seq-mean-token-mean",
                               float(rows))
            share = mask.sum() / max(tokens, 1.0)
            return vl, {"value_loss": vl.detach(), "values": (masked_sum(values, mask) / max(tokens, 1.0)).detach(),
                        "vf_clipfrac": m["vf_clipfrac"] * share}

        return loss_fn

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """One RL step on a rollout batch: forward-only passes, advantages, actor and critic updates.

        Every rank passes the same (global) batch; each DP rank trains on its slice.
        Returns metrics, identical on every rank.
        """
        return step_experiments([(self, batch)])[0]

    def _prepare_update(self, batch: RolloutBatch, old: torch.Tensor, sampled_logprobs: torch.Tensor | None,
                        ref: torch.Tensor, values: torch.Tensor | None) -> tuple[dict, dict, dict | None]:
        """After the forward-only passes: advantages, the step's metrics so far, and what the actor's and the
        critic's updates read per row (None: no critic). Advances the adaptive KL controller."""
        adv = self.compute_advantages(batch, old, ref, values)
        # what the update trained on, for trainer.dump_data_batch (SkyRL dumps the batch with its advantages)
        self.last_trained = {"token_rewards": adv["token_rewards"], "advantages": adv["advantages"]}
        mask = batch.action_mask
        metrics: dict[str, float] = {
            "reward/mean": float(batch.rewards.float().mean()),
            "kl/mean": float(masked_mean(adv["kl"], mask)),
            "advantages/mean": float(masked_mean(adv["advantages"], mask)),
            "response_length/mean": float(batch.response_positions.sum(-1).mean()),  # filtered rows too
        }
        actor_extra = {"old_logprobs": old, "ref_logprobs": ref, "advantages": self._reduced(adv["advantages"], mask)}
        if batch.rollout_logprobs is not None:
            # like with like: the engine reports log-probs of its processed (tempered, truncated) distribution
            gap = torch.where(mask > 0, (batch.rollout_logprobs - sampled_logprobs).abs(), 0.0)
            metrics["rollout/logprob_abs_diff"] = float(gap.sum() / mask.sum().clamp(min=1))
            metrics["rollout/logprob_abs_diff_max"] = float(gap.max())
            # μ in the trainer's untruncated space (the engine's log-prob minus the truncation's log-mass), so
            # that π_old / μ is the processed distributions' ratio and log π - log μ is comparable to it
            mu = batch.rollout_logprobs - (sampled_logprobs - old)
            weights, corr = off_policy_correction(old, mu, mask, self.cfg.off_policy)
            metrics.update({f"off_policy/{k}": v for k, v in corr.items()})
            if self.cfg.off_policy.enabled and POLICY_LOSSES[self.cfg.policy_loss_type][1]:
                actor_extra["is_weights"] = weights
            actor_extra["rollout_logprobs"] = mu  # as SkyRL, every loss gets μ when there is one
        elif self.cfg.needs_rollout_logprobs:
            raise ValueError("rollout correction (policy_loss_type='rollout_is', cispo_anchor='rollout', "
                             "off_policy_correction) needs the "
                             "engine's log-probs of the sampled tokens: RolloutBatch.rollout_logprobs is None")
        if self.cfg.use_kl_in_reward:
            self.kl_ctrl.update(metrics["kl/mean"], batch.size)
            metrics["kl/coef"] = self.kl_ctrl.value
        critic_extra = {"old_values": values, "returns": adv["returns"]} if self.critic is not None else None
        return metrics, actor_extra, critic_extra

    def _reduced(self, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The advantages each actor mini-batch trains on: scaled by its loss reduction
        (:func:`mlora.rl.losses.reduction_scale`), as SkyRL's ``_normalize_advantages`` does before the update."""
        c, out = self.cfg, torch.zeros_like(advantages)
        for start in range(0, advantages.shape[0], c.mini_batch_size):
            rows = slice(start, start + c.mini_batch_size)
            out[rows] = advantages[rows] * reduction_scale(mask[rows], c.loss_agg_mode, c.micro_train_batch_size,
                                                           c.max_seq_len, c.n_samples_per_prompt)
        return out

    def _schedule(self, batch: RolloutBatch, mini_batch_size: int) -> list[tuple[int, int]]:
        """``(start, size)`` of each optimizer step's mini-batch: ``ppo_epochs`` passes over the batch."""
        return [(start, mini_batch_size) for _ in range(self.cfg.ppo_epochs)
                for start in range(0, batch.size, mini_batch_size)]

    def _trained(self, critic: bool) -> Trained:
        c = self.cfg
        if critic:
            return Trained(self.critic_params, self.critic_opt, self.critic_sched, c.critic_max_grad_norm)
        return Trained(self.actor_params, self.actor_opt, self.actor_sched, c.max_grad_norm)

    def _loss(self, batch: RolloutBatch, start: int, count: int, critic: bool):
        """The actor's (or critic's) loss function of mini-batch ``[start, start + count)``, normalised by its
        global counts."""
        mask = batch.action_mask[start:start + count]
        factory = self._critic_loss if critic else self._actor_loss
        return factory(count, float(mask.sum()))

    def _finish_step(self, metrics: dict, actor_steps: list[dict], critic_steps: list[dict] | None) -> dict:
        for role, steps in (("actor", actor_steps), ("critic", critic_steps)):
            if steps is None:
                continue
            for k in steps[0]:
                metrics[f"{role}/{k}"] = sum(s[k] for s in steps) / len(steps)
            metrics[f"{role}/per_minibatch"] = steps  # type: ignore[assignment]
        self.global_step += 1
        return metrics


def step_experiments(pairs: Sequence[tuple[ActorCriticEngine, RolloutBatch]]) -> list[dict[str, float]]:
    """One RL step of each experiment ``(engine, its batch)`` on their shared base, every pass once for all
    (:mod:`mlora.train.joint_passes`): old log-probs (each row under its own policy), reference log-probs,
    values (each row under its own critic), then each experiment's advantages, then the actor updates and the
    critic updates in rounds of every experiment's next optimizer step. Returns each experiment's metrics,
    identical on every rank; each equals what its engine's :meth:`ActorCriticEngine.step` gives alone (to
    float32 rounding: the micro-batches differ)."""
    engines, batches = [e for e, _ in pairs], [b for _, b in pairs]
    for e, b in pairs:
        e._check_sizes(b, joint=len(pairs) > 1)
    joint = JointBatch(engines, batches)
    everyone, ref, width = range(len(pairs)), engines[0].reference, joint.width - 1

    def old_fn(e, b):
        if b.rollout_logprobs is not None:
            return e._old_and_sampled_logprobs
        return lambda logits, mb: e._logprobs(logits, mb)[..., None].expand(-1, -1, 2)

    old = joint_passes.forward(joint, everyone, ref, {p: e.policy for p, e in enumerate(engines)},
                               {p: old_fn(e, b) for p, (e, b) in enumerate(pairs)}, False, (width, 2))
    refs = joint_passes.forward(joint, everyone, ref, {}, {p: e._logprobs for p, e in enumerate(engines)}, False,
                                (width,))
    critics = [p for p, e in enumerate(engines) if e.critic is not None]
    values = (joint_passes.forward(joint, critics, ref, {p: engines[p].critic for p in critics},
                                   {p: engines[p]._values for p in critics}, True, (width,)) if critics else {})

    def own(t: torch.Tensor, p: int) -> torch.Tensor:  # experiment p's width
        return t[:, :batches[p].input_ids.shape[1] - 1]

    metrics, actor_extra, critic_extra = {}, {}, {}
    for p, (e, b) in enumerate(pairs):
        sampled = own(old[p][..., 1], p) if b.rollout_logprobs is not None else None
        metrics[p], actor_extra[p], critic_extra[p] = e._prepare_update(
            b, own(old[p][..., 0], p), sampled, own(refs[p], p), own(values[p], p) if p in values else None)
    actor_steps = _update_all(joint, everyone, actor_extra, critic=False)
    critic_steps = _update_all(joint, critics, critic_extra, critic=True) if critics else {}
    return [e._finish_step(metrics[p], actor_steps[p], critic_steps.get(p)) for p, e in enumerate(engines)]


def _update_all(joint: JointBatch, parts: Sequence[int], extras: dict[int, dict], critic: bool) -> dict[int, list]:
    """The actor (or critic) updates of experiments ``parts``, in rounds (:func:`mlora.train.joint_passes.update`)."""
    engines, batches = joint.engines, joint.batches
    keys = {p: frozenset(["action_mask", *extras[p]]) for p in parts}
    names = sorted(set().union(*keys.values()))
    per_row = {k: joint.per_token({p: (batches[p].action_mask if k == "action_mask" else extras[p][k])
                                   for p in parts if k in keys[p]}) for k in names}
    routed = {p: engines[p].critic if critic else engines[p].policy for p in parts}
    schedules = {p: engines[p]._schedule(batches[p], engines[p].cfg.critic_mini_batch if critic
                                         else engines[p].cfg.mini_batch_size) for p in parts}
    return joint_passes.update(joint, parts, schedules, engines[0].reference, routed, per_row, keys,
                               lambda p, start, count: engines[p]._loss(batches[p], start, count, critic),
                               {p: engines[p]._trained(critic) for p in parts}, hidden=critic)


def batch_normalize(advantages: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """SkyRL's ``advantage_batch_normalize``: ``(A - mean) · rsqrt(max(Σ (A - mean)²·m / Σ m, 1e-8))`` over the
    batch, the mean over SkyRL's ``[B, max response length]`` tensor (every entry, padding's zeros included), the
    variance over its response tokens ``m``."""
    width = int(span.sum(-1).max())
    mean = (advantages * span).sum() / max(advantages.shape[0] * width, 1)
    var = ((advantages - mean).square() * span).sum() / span.sum().clamp(min=1)
    return (advantages - mean) * var.clamp(min=1e-8).rsqrt() * span


def compute_advantages(c: PPOConfig, batch: RolloutBatch, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                       values: torch.Tensor | None, kl_coef: float = 0.0) -> dict[str, torch.Tensor]:
    """Token rewards (outcome reward on the last response token, or the batch's per-token turn rewards;
    KL penalty if in reward), then the estimator's advantages, as SkyRL computes them
    (:mod:`mlora.rl.advantages`): over each row's response span (in a multi-turn row the environment's
    tokens between turns too, which the loss mask leaves out). Pure given its inputs; identical on every rank."""
    # a filtered row (batch.loss_mask) keeps its reward at its last token: it counts in its group's statistics
    mask, span = batch.response_positions, batch.response_span
    if batch.token_rewards is not None:  # multi-turn: each turn's reward where the trainer placed it
        token_rewards = batch.token_rewards.float() * mask
    else:
        token_rewards = torch.zeros_like(mask)
        token_rewards[torch.arange(batch.size), batch.last_response_position] = batch.rewards.float()
    kl = kl_penalty(old_logprobs, ref_logprobs, c.kl_estimator) * mask
    out = {"kl": kl}
    if c.use_kl_in_reward:
        token_rewards = apply_kl_in_reward(token_rewards, kl, mask, kl_coef)
    estimator, n = c.advantage_estimator, c.n_samples_per_prompt
    if estimator == "gae":
        skip = c.gae_skip_observations
        adv, returns = gae_advantages(token_rewards, values * span, mask if skip else span, c.gamma, c.lam,
                                      skip_masked=skip)
        adv = adv * span
        out["returns"] = returns * span
    elif estimator == "reinforce++":
        adv, _ = reinforce_pp_advantages(token_rewards, span, c.gamma)
    else:
        scores = (token_rewards * mask).sum(-1)
        per_seq = {"grpo": lambda: grpo_advantages(scores, n, c.norm_adv_by_std_in_grpo),
                   "rloo": lambda: rloo_advantages(scores, n),
                   "maxrl": lambda: maxrl_advantages(scores, n)}[estimator]()
        adv = broadcast_to_tokens(per_seq, span)
    if c.advantage_batch_normalize:
        adv = batch_normalize(adv, span)
    out["advantages"] = adv
    out["token_rewards"] = token_rewards
    return out
