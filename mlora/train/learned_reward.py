"""The learned reward of ``environment.env_class=reward_model``, scored on the trainer's own base.

The reward adapter and its scalar head (``reward_model.adapter_path``, a PEFT SEQ_CLS directory from
``mlora-train --config-name rm`` or :func:`mlora.export.reward_adapter.save_reward_adapter`) are
loaded once, frozen, onto the shared base that already carries policy, critic and reference: no
second copy of the base and no reward server. Each step, after the rollout batch is built, one
forward-only pass (the same family as values and reference log-probs,
:meth:`~mlora.train.engine.ActorCriticEngine.reward_scores`) scores the last token of every
prompt+response, and ``model_weight`` · score is added to the rows whose environment is
``reward_model`` (the rule part, ``rule_weight`` · ``rule_env``, came with the rollouts).

A reward adapter trained on top of a frozen adapter (the RM stage with
``trainer.policy.model.frozen_adapter_path``, e.g. the SFT adapter) records it
(:func:`mlora.export.reward_adapter.reward_base_adapter`), and scores under it here too: the run's own
frozen adapter when it is the very same one (same weights), else the recorded one loaded frozen as
``reward_base``. Without it the reward optimised would not be the one trained; a recorded adapter
that is missing or changed is an error.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from mlora.config.schema import TrainConfig
from mlora.rollout.envs import REWARD_MODEL_ENV
from mlora.train.batch import RolloutBatch

REWARD = "reward"  # the reward adapter's and its head's names on the trainer's model
REWARD_BASE = "reward_base"  # the frozen adapter the reward adapter was trained on, when not the run's own


def env_kwargs(cfg: TrainConfig, env_class: str) -> dict:
    """Constructor arguments of environment ``env_class`` from the config (the rule part of reward_model)."""
    if env_class != REWARD_MODEL_ENV:
        return {}
    return {"rule_env": cfg.reward_model.rule_env, "rule_weight": cfg.reward_model.rule_weight}


class LearnedReward:
    """The frozen reward adapter on the trainer's base, and how its scores join the rule rewards."""

    def __init__(self, cfg: TrainConfig, model, engine, run_frozen: str | None = None, name: str = REWARD) -> None:
        """``run_frozen``: the name of ``trainer.policy.model.frozen_adapter_path``'s adapter on ``model``
        (None: the run has none); ``name``: the reward adapter's and its head's name on ``model`` (an
        experiment's ``e/reward``), its frozen base adapter, when it needs its own, ``name + "_base"``."""
        from mlora.export.reward_adapter import load_reward_adapter

        section = cfg.reward_model
        if not section.adapter_path:
            raise ValueError("environment.env_class=reward_model needs reward_model.adapter_path (a reward adapter "
                             "directory written by mlora-train --config-name rm)")
        self.model, self.engine = model, engine
        self.weight = float(section.model_weight)
        self.zero_non_stop = cfg.generator.zero_reward_on_non_stop
        under = reward_base(cfg, model, run_frozen, f"{name}_base")  # checked before anything of it loads
        load_reward_adapter(model, section.adapter_path, adapter_name=name, head_name=name)
        self.adapters, self.head = (*under, name), name  # frozen stacked ones first, as the RM stage ran them

    def apply(self, batch: RolloutBatch, rows: Sequence[tuple[str, str | None]]) -> dict[str, float]:
        """Add ``model_weight`` · score to ``batch.rewards`` (in place) for the rows scored by the reward
        model; ``rows`` holds each row's ``(env_class, finish_reason)``. Collective (every rank, same
        batch). Returns metrics: the raw scores' mean and spread over those rows, the rule part's mean."""
        if len(rows) != batch.size:
            raise ValueError(f"{len(rows)} row descriptions for a batch of {batch.size}")
        use = torch.tensor([env == REWARD_MODEL_ENV and not (self.zero_non_stop and finish != "stop")
                            for env, finish in rows], dtype=torch.bool)
        if not bool(use.any()):
            return {}
        t0 = time.perf_counter()
        rule = float(batch.rewards.float().mean())
        scores = self.engine.reward_scores(batch, self.adapters, self.head)
        batch.rewards = batch.rewards.float() + torch.where(use, self.weight * scores, 0.0)
        used = scores[use]
        return {"timing/reward_model_s": time.perf_counter() - t0, "reward_model/score": float(used.mean()),
                "reward_model/score_std": float(used.std()) if used.numel() > 1 else 0.0,
                "reward_model/score_max": float(used.max()), "reward_model/score_min": float(used.min()),
                "reward_model/rule_mean": rule}  # the rule part (mean over the batch), before the score is added


def reward_base(cfg: TrainConfig, model, run_frozen: str | None, name: str = REWARD_BASE) -> tuple[str, ...]:
    """The adapters to stack under the reward adapter: none when it was trained on the base alone;
    ``run_frozen`` when the run's frozen adapter is the one recorded (same weights); else the recorded
    adapter, loaded frozen onto ``model`` as ``name``. Raises (naming the path) when the
    recorded adapter is missing or changed."""
    from mlora.export.reward_adapter import adapter_identity, reward_base_adapter
    from mlora.train.metrics_log import log

    recorded = reward_base_adapter(cfg.reward_model.adapter_path)
    if recorded is None:
        return ()
    own = cfg.trainer.policy.model.frozen_adapter_path
    if run_frozen is not None and own and adapter_identity(own)["sha256"] == recorded["sha256"]:
        model._require(run_frozen)
        return (run_frozen,)
    model.load_adapter(name, recorded["path"], trainable=False)
    log.info("reward model: stacking %s (the frozen adapter it was trained on) under it as %r", recorded["path"], name)
    return (name,)


def build_learned_reward(cfg: TrainConfig, model, engine, env_classes: set[str], run_frozen: str | None = None,
                         name: str = REWARD) -> LearnedReward | None:
    """The learned reward when any prompt's environment (``env_classes``) is ``reward_model``; None when
    none is. A ``reward_model.adapter_path`` that no prompt would use is an error (it would do nothing).
    ``run_frozen``: the name of the run's frozen adapter on ``model`` (see :class:`LearnedReward`)."""
    if REWARD_MODEL_ENV in env_classes:
        if cfg.data.val_data and cfg.trainer.eval_interval > 0:
            from mlora.train.metrics_log import log

            # evaluation generates and scores on global rank 0 alone; the reward model needs every rank
            log.warning("held-out evaluation (eval/*) scores %s prompts with their rule part only "
                        "(reward_model.rule_env), not with the reward model; the training metrics "
                        "reward_model/score* hold the reward model's scores", REWARD_MODEL_ENV)
        return LearnedReward(cfg, model, engine, run_frozen, name)
    if cfg.reward_model.adapter_path:
        raise ValueError(f"reward_model.adapter_path={cfg.reward_model.adapter_path!r} is set, but no prompt uses "
                         f"environment {REWARD_MODEL_ENV!r} (environment.env_class={cfg.environment.env_class!r}, "
                         f"prompt env_class values: {sorted(env_classes)}): set environment.env_class={REWARD_MODEL_ENV}")
    return None
