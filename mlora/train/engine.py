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

import contextlib
from typing import Sequence

import torch
import torch.distributed as dist

from mlora.checkpoint.run_state import VALUE_HEAD, StageState, TrainedAdapter, head_parameters
from mlora.facade.model import MLoraModel
from mlora.lora.config import LoraConfig
from mlora.lora.grads import clip_grads, finalize_grads
from mlora.rl import (
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    gae_advantages,
    grpo_advantages,
    kl_penalty,
    policy_loss,
    rloo_advantages,
    value_loss,
)
from mlora.rl.advantages import broadcast_to_tokens
from mlora.rl.kl import apply_kl_in_reward
from mlora.rl.masked import masked_mean, masked_sum
from mlora.rl.rollout_correction import off_policy_correction, rollout_is_loss
from mlora.rl.vocab_parallel import next_token_logits, vocab_parallel_logprobs, vocab_parallel_truncation_logmass
from mlora.train.batch import RolloutBatch
from mlora.train.config import PPOConfig
from mlora.train.micro_batches import group_units, in_row_order, last_token_scores, micro_batch, unpack_tokens
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
        if policy not in model.adapters:
            model.add_adapter(policy, policy_lora or LoraConfig())
        model.set_trainable(policy, True)
        self.actor_params = model.adapter_parameters(policy)
        self.actor_opt, self.actor_sched = build_optimizer(
            self.actor_params, cfg.actor_lr, weight_decay=cfg.weight_decay, betas=cfg.betas,
            warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps, min_lr_ratio=cfg.min_lr_ratio,
            schedule=cfg.lr_schedule)
        if self.critic is not None:
            if self.critic not in model.adapters:
                model.add_adapter(self.critic, critic_lora or LoraConfig(seed=1))
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

    # ------------------------------------------------------------------ layout helpers
    def _check_sizes(self, batch: RolloutBatch) -> None:
        c, dp = self.cfg, self.mesh.dp
        sizes = [("mini_batch_size", c.mini_batch_size)]
        if self.critic is not None:
            sizes.append(("critic_mini_batch_size", c.critic_mini_batch))
        for name, size in sizes:
            if batch.size % size:
                raise ValueError(f"batch of {batch.size} sequences is not divisible by {name}={size}")
            if size % (c.micro_train_batch_size * dp):
                raise ValueError(f"{name}={size} is not divisible by micro_train_batch_size x DP = "
                                 f"{c.micro_train_batch_size} x {dp}; valid mini-batch sizes are multiples of "
                                 f"{c.micro_train_batch_size * dp}")
        if batch.size % (c.micro_forward_batch_size * dp):
            raise ValueError(f"batch of {batch.size} sequences is not divisible by micro_forward_batch_size x DP = "
                             f"{c.micro_forward_batch_size} x {dp}")
        if c.advantage_estimator != "gae" and batch.size % c.n_samples_per_prompt:
            raise ValueError(f"batch of {batch.size} is not a whole number of groups of "
                             f"n_samples_per_prompt={c.n_samples_per_prompt}")

    def _dp_rows(self, start: int, count: int) -> slice:
        per = count // self.mesh.dp
        return slice(start + self.mesh.dp_rank * per, start + (self.mesh.dp_rank + 1) * per)

    def _micro_batches(self, batch: RolloutBatch, rows: slice, size: int, extra: dict) -> list[dict]:
        """Micro-batches of ``rows`` (``size`` sequences each, or packed under the token budget); each
        holds ``rows``, its sequences' places in the slice, for :func:`~mlora.train.micro_batches.in_row_order`."""
        per_row = {"action_mask": batch.action_mask, **extra}
        tokens = batch.attention_mask[rows].sum(-1).tolist()
        out = []
        for group in group_units(tokens, size, self.cfg.packing, batch.input_ids.shape[1]):
            local = torch.tensor(group)
            mb = micro_batch(batch.input_ids, batch.attention_mask, local + rows.start, per_row,
                             self.cfg.packing.enabled, self.mesh.device)
            mb["rows"] = local
            out.append(mb)
        return out

    def _from_last_stage(self, t: torch.Tensor | None, shape, dtype=torch.float32) -> torch.Tensor:
        """Broadcast a tensor computed on the last pipeline stage to every stage."""
        from megatron.core import parallel_state as ps

        if self.mesh.pp == 1:
            return t
        buf = t.contiguous() if self.mesh.is_last_stage else torch.zeros(shape, dtype=dtype, device=self.mesh.device)
        dist.broadcast(buf, src=ps.get_pipeline_model_parallel_last_rank(), group=self.mesh.pp_group)
        return buf

    def _dp_gather(self, t: torch.Tensor) -> torch.Tensor:
        if self.mesh.dp == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.mesh.dp)]
        dist.all_gather(parts, t.contiguous(), group=self.mesh.dp_group)
        return torch.cat(parts)

    @contextlib.contextmanager
    def _mode(self, training: bool):
        """Train mode for the update passes (LoRA dropout active), eval mode for the forward-only
        passes (deterministic old/ref log-probs and values); every module gets its own previous
        mode back afterwards (``model.train(x)`` alone would flatten mixed modes)."""
        previous = [(m, m.training) for m in self.model.modules()]
        self.model.train(training)
        try:
            yield
        finally:
            for m, mode in previous:
                m.training = mode

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

    @torch.no_grad()
    def _forward_pass(self, batch: RolloutBatch, adapters: tuple[str, ...], values: bool,
                      sampled: bool = False) -> torch.Tensor:
        """Per-action log-probs (or values) of the whole batch, on every rank, in eval mode.

        ``sampled``: ``[B, S - 1, 2]``, the log-probs and the engine-comparable ones
        (:meth:`_old_and_sampled_logprobs`)."""
        rows = self._dp_rows(0, batch.size)
        mbs = self._micro_batches(batch, rows, self.cfg.micro_forward_batch_size, {})
        if values:
            fn = lambda hidden, mb: (torch.zeros(()), {"out": self._values(hidden, mb)})  # noqa: E731
        elif sampled:
            def fn(logits, mb):
                return torch.zeros(()), {"out": self._old_and_sampled_logprobs(logits, mb)}
        else:
            fn = lambda logits, mb: (torch.zeros(()), {"out": self._token_logprobs(logits, mb, False)[0]})  # noqa: E731
        with self.model.use_adapters(*adapters), self._mode(training=False):
            outs = self.model.forward_backward(mbs, fn, forward_only=True, hidden_states=values)
        # collectives run on the mesh's device (NCCL needs CUDA tensors); results come back to CPU
        local = in_row_order(outs, mbs)
        shape = (rows.stop - rows.start, batch.input_ids.shape[1] - 1) + ((2,) if sampled and not values else ())
        local = self._from_last_stage(local, shape)
        return self._dp_gather(local).cpu()

    # ------------------------------------------------------------------ learned reward (env_class=reward_model)
    @torch.no_grad()
    def reward_scores(self, batch: RolloutBatch, adapters: tuple[str, ...], head: str) -> torch.Tensor:
        """``[B]`` float32 on every rank: scalar head ``head`` on the last token of each prompt+response
        under ``adapters`` (a frozen reward adapter on this same base; see
        :func:`mlora.export.reward_adapter.load_reward_adapter`). The same forward-only pass as the
        values: micro-batches through megatron's schedule, each DP rank its slice, eval mode."""
        self._check_sizes(batch)
        rows = self._dp_rows(0, batch.size)
        mbs = self._micro_batches(batch, rows, self.cfg.micro_forward_batch_size, {})
        module = self.model.heads[head] if self.mesh.is_last_stage else None

        def fn(hidden, mb):
            return torch.zeros(()), {"out": last_token_scores(module, hidden, mb)}

        with self.model.use_adapters(*adapters), self._mode(training=False):
            outs = self.model.forward_backward(mbs, fn, forward_only=True, hidden_states=True)
        local = in_row_order(outs, mbs)
        local = self._from_last_stage(local, (rows.stop - rows.start,))
        return self._dp_gather(local).cpu()

    # ------------------------------------------------------------------ advantages
    def compute_advantages(self, batch: RolloutBatch, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                           values: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Token rewards (outcome reward on the last response token, or the batch's per-token turn rewards;
        KL penalty if in reward), then GAE / GRPO / RLOO advantages (GAE skips the environment tokens of a
        multi-turn row: they are outside the mask). Pure given its inputs; identical on every rank."""
        # a filtered row (batch.loss_mask) keeps its reward at its last token: it counts in its group's statistics
        c, mask = self.cfg, batch.response_positions
        if batch.token_rewards is not None:  # multi-turn: each turn's reward where the trainer placed it
            token_rewards = batch.token_rewards.float() * mask
        else:
            last = mask.shape[1] - 1 - torch.flip(mask, dims=[1]).argmax(dim=1)  # last response position per row
            token_rewards = torch.zeros_like(mask)
            token_rewards[torch.arange(batch.size), last] = batch.rewards.float()
        kl = kl_penalty(old_logprobs, ref_logprobs, c.kl_estimator) * mask
        out = {"kl": kl}
        if c.use_kl_in_reward:
            token_rewards = apply_kl_in_reward(token_rewards, kl, mask, self.kl_ctrl.value)
        if c.advantage_estimator == "gae":
            adv, returns = gae_advantages(token_rewards, values, mask, c.gamma, c.lam)
            out["returns"] = returns
        else:
            scores = (token_rewards * mask).sum(-1)
            per_seq = (grpo_advantages(scores, c.n_samples_per_prompt, c.norm_adv_by_std_in_grpo)
                       if c.advantage_estimator == "grpo" else rloo_advantages(scores, c.n_samples_per_prompt))
            adv = broadcast_to_tokens(per_seq, mask)
        out["advantages"] = adv
        out["token_rewards"] = token_rewards
        return out

    # ------------------------------------------------------------------ updates
    def _normalizer(self, mask: torch.Tensor) -> float:
        if self.cfg.loss_agg_mode == "token-mean":
            return float(mask.sum())
        if self.cfg.loss_agg_mode == "token-mean-legacy":  # micro-batches of the mini-batch, all DP ranks'
            return float(mask.shape[0] // self.cfg.micro_train_batch_size)
        return float((mask.sum(-1) > 0).sum())

    def _update(self, batch: RolloutBatch, extra: dict, params, opt, sched, loss_fn_factory, hidden: bool,
                adapters: tuple[str, ...], mini_batch_size: int, max_grad_norm: float | None) -> list[dict]:
        """Optimizer steps over mini-batches of ``mini_batch_size`` sequences, ``ppo_epochs`` times,
        with the model in train mode (LoRA dropout active)."""
        c, results = self.cfg, []
        for _ in range(c.ppo_epochs):
            for start in range(0, batch.size, mini_batch_size):
                mini_mask = batch.action_mask[start:start + mini_batch_size]
                mbs = self._micro_batches(batch, self._dp_rows(start, mini_batch_size), c.micro_train_batch_size,
                                          extra)
                opt.zero_grad(set_to_none=True)
                with self.model.use_adapters(*adapters), self._mode(training=True):
                    outs = self.model.forward_backward(
                        mbs, loss_fn_factory(self._normalizer(mini_mask), float(mini_mask.sum())), hidden_states=hidden)
                finalize_grads(params)
                grad_norm = clip_grads(params, max_grad_norm)
                lr = sched.get_last_lr()[0]
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)  # gradients do not outlive the step
                metrics = self._reduce_metrics(outs)
                metrics["grad_norm"] = float(grad_norm)
                metrics["lr"] = lr
                results.append(metrics)
        return results

    def _reduce_metrics(self, outs: list[dict] | None) -> dict[str, float]:
        """Sum micro-batch metrics, then over DP; the same numbers on every rank."""
        keys = sorted(outs[0]) if outs else None
        keys = self._broadcast_keys(keys)
        if self.mesh.is_last_stage:
            vec = torch.stack([sum(o[k].detach().float() for o in outs) for k in keys]).to(self.mesh.device)
            if self.mesh.dp > 1:
                dist.all_reduce(vec, group=self.mesh.dp_group)
        else:
            vec = None
        vec = self._from_last_stage(vec, (len(keys),)).cpu()
        return {k: float(v) for k, v in zip(keys, vec)}

    def _broadcast_keys(self, keys):
        if self.mesh.pp == 1:
            return keys
        from megatron.core import parallel_state as ps

        box = [keys]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(), group=self.mesh.pp_group)
        return box[0]

    def _actor_loss(self, normalizer: float, tokens: float):
        c = self.cfg

        def loss_fn(logits, mb):
            mask = mb["action_mask"].to(logits.device)
            logprob, entropy = self._token_logprobs(logits, mb, with_entropy=True)
            weights = mb.get("is_weights")  # rollout correction (TIS, masks): None when off
            if c.policy_loss_type == "rollout_is":
                pg, m = rollout_is_loss(logprob, mb["rollout_logprobs"], mb["advantages"], mask, c.eps_clip_low,
                                        c.eps_clip_high, weights, c.loss_agg_mode, normalizer, c.max_seq_len)
            else:
                pg, m = policy_loss(logprob, mb["old_logprobs"], mb["advantages"], mask, c.eps_clip_low,
                                    c.eps_clip_high, c.dual_clip, c.loss_agg_mode, normalizer, c.max_seq_len,
                                    weights)
            ent = agg_loss(entropy, mask, c.loss_agg_mode, normalizer, c.max_seq_len)
            kl = agg_loss(kl_penalty(logprob, mb["ref_logprobs"], c.kl_estimator), mask, c.loss_agg_mode, normalizer,
                          c.max_seq_len)
            loss = pg - c.entropy_coeff * ent + (c.kl_loss_coef * kl if c.use_kl_loss else 0.0)
            share = mask.sum() / max(tokens, 1.0)  # token-weighted, so micro-batch sums are mini-batch means
            return loss, {"pg_loss": pg.detach(), "entropy": ent.detach(), "kl_loss": kl.detach(),
                          "loss": loss.detach(), "clipfrac": m["clipfrac"] * share, "ppo_kl": m["ppo_kl"] * share}

        return loss_fn

    def _critic_loss(self, normalizer: float, tokens: float):
        c = self.cfg

        def loss_fn(hidden, mb):
            mask = mb["action_mask"].to(hidden.device)
            values = self._values(hidden, mb)
            vl, m = value_loss(values, mb["old_values"], mb["returns"], mask, c.value_clip, c.loss_agg_mode,
                               normalizer, c.max_seq_len)
            share = mask.sum() / max(tokens, 1.0)
            return vl, {"value_loss": vl.detach(), "values": (masked_sum(values, mask) / max(tokens, 1.0)).detach(),
                        "vf_clipfrac": m["vf_clipfrac"] * share}

        return loss_fn

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """One RL step on a rollout batch: forward-only passes, advantages, actor and critic updates.

        Every rank passes the same (global) batch; each DP rank trains on its slice.
        Returns metrics, identical on every rank.
        """
        self._check_sizes(batch)
        actor = self.reference + (self.policy,)
        with_rollout = batch.rollout_logprobs is not None
        old = self._forward_pass(batch, actor, values=False, sampled=with_rollout)
        if with_rollout:
            old, sampled_logprobs = old[..., 0], old[..., 1]
        ref = self._forward_pass(batch, self.reference, values=False)
        values = self._forward_pass(batch, self.reference + (self.critic,), values=True) if self.critic else None
        adv = self.compute_advantages(batch, old, ref, values)
        mask = batch.action_mask
        metrics: dict[str, float] = {
            "reward/mean": float(batch.rewards.float().mean()),
            "kl/mean": float(masked_mean(adv["kl"], mask)),
            "advantages/mean": float(masked_mean(adv["advantages"], mask)),
            "response_length/mean": float(batch.response_positions.sum(-1).mean()),  # filtered rows too
        }
        actor_extra = {"old_logprobs": old, "ref_logprobs": ref, "advantages": adv["advantages"]}
        if with_rollout:
            # like with like: the engine reports log-probs of its processed (tempered, truncated) distribution
            gap = torch.where(mask > 0, (batch.rollout_logprobs - sampled_logprobs).abs(), 0.0)
            metrics["rollout/logprob_abs_diff"] = float(gap.sum() / mask.sum().clamp(min=1))
            metrics["rollout/logprob_abs_diff_max"] = float(gap.max())
            # μ in the trainer's untruncated space (the engine's log-prob minus the truncation's log-mass), so
            # that π_old / μ is the processed distributions' ratio and log π - log μ is comparable to it
            mu = batch.rollout_logprobs - (sampled_logprobs - old)
            weights, corr = off_policy_correction(old, mu, mask, self.cfg.off_policy)
            metrics.update({f"off_policy/{k}": v for k, v in corr.items()})
            if self.cfg.off_policy.enabled:
                actor_extra["is_weights"] = weights
            if self.cfg.policy_loss_type == "rollout_is":
                actor_extra["rollout_logprobs"] = mu
        elif self.cfg.policy_loss_type == "rollout_is" or self.cfg.off_policy.enabled:
            raise ValueError("rollout correction (policy_loss_type='rollout_is', off_policy_correction) needs the "
                             "engine's log-probs of the sampled tokens: RolloutBatch.rollout_logprobs is None")
        if self.cfg.use_kl_in_reward:
            self.kl_ctrl.update(metrics["kl/mean"], batch.size)
            metrics["kl/coef"] = self.kl_ctrl.value
        actor_steps = self._update(batch, actor_extra, self.actor_params, self.actor_opt, self.actor_sched,
                                   self._actor_loss, hidden=False, adapters=actor,
                                   mini_batch_size=self.cfg.mini_batch_size, max_grad_norm=self.cfg.max_grad_norm)
        for k in actor_steps[0]:
            metrics[f"actor/{k}"] = sum(s[k] for s in actor_steps) / len(actor_steps)
        metrics["actor/per_minibatch"] = actor_steps  # type: ignore[assignment]
        if self.critic is not None:
            critic_extra = {"old_values": values, "returns": adv["returns"]}
            critic_steps = self._update(batch, critic_extra, self.critic_params, self.critic_opt,
                                        self.critic_sched, self._critic_loss, hidden=True,
                                        adapters=self.reference + (self.critic,),
                                        mini_batch_size=self.cfg.critic_mini_batch,
                                        max_grad_norm=self.cfg.critic_max_grad_norm)
            for k in critic_steps[0]:
                metrics[f"critic/{k}"] = sum(s[k] for s in critic_steps) / len(critic_steps)
            metrics["critic/per_minibatch"] = critic_steps  # type: ignore[assignment]
        self.global_step += 1
        return metrics
