"""The learned reward of ``environment.env_class=reward_model``, scored on the trainer's own base.

The reward adapter and its scalar head (``reward_model.adapter_path``, a PEFT SEQ_CLS directory from
``mlora-train --config-name rm`` or :func:`mlora.export.reward_adapter.save_reward_adapter`) are
loaded once, frozen, onto the shared base that already carries policy, critic and reference: no
second copy of the base and no reward server. Each step, after the rollout batch is built, one
forward-only pass (the same family as values and reference log-probs,
:meth:`~mlora.train.engine.ActorCriticEngine.reward_scores`) scores the last token of every
prompt+response, and ``model_weight`` · score is added to the rows whose environment is
``reward_model`` (the rule part, ``rule_weight`` · ``rule_env``, came with the rollouts).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from mlora.config.schema import TrainConfig
from mlora.rollout.envs import REWARD_MODEL_ENV
from mlora.train.batch import RolloutBatch

REWARD = "reward"  # the reward adapter's and its head's names on the trainer's model


def env_kwargs(cfg: TrainConfig, env_class: str) -> dict:
    """Constructor arguments of environment ``env_class`` from the config (the rule part of reward_model)."""
    if env_class != REWARD_MODEL_ENV:
        return {}
    return {"rule_env": cfg.reward_model.rule_env, "rule_weight": cfg.reward_model.rule_weight}


class LearnedReward:
    """The frozen reward adapter on the trainer's base, and how its scores join the rule rewards."""

    def __init__(self, cfg: TrainConfig, model, engine) -> None:
        from mlora.export.reward_adapter import load_reward_adapter

        section = cfg.reward_model
        if not section.adapter_path:
            raise ValueError("environment.env_class=reward_model needs reward_model.adapter_path (a reward adapter "
                             "directory written by mlora-train --config-name rm)")
        self.model, self.engine = model, engine
        self.weight = float(section.model_weight)
        self.zero_non_stop = cfg.generator.zero_reward_on_non_stop
        load_reward_adapter(model, section.adapter_path, adapter_name=REWARD, head_name=REWARD)

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
        scores = self.engine.reward_scores(batch, (REWARD,), REWARD)
        batch.rewards = batch.rewards.float() + torch.where(use, self.weight * scores, 0.0)
        used = scores[use]
        return {"timing/reward_model_s": time.perf_counter() - t0, "reward_model/score": float(used.mean()),
                "reward_model/score_std": float(used.std()) if used.numel() > 1 else 0.0,
                "reward_model/score_max": float(used.max()), "reward_model/score_min": float(used.min()),
                "reward_model/rule_mean": rule}  # the rule part (mean over the batch), before the score is added


def build_learned_reward(cfg: TrainConfig, model, engine, env_classes: set[str]) -> LearnedReward | None:
    """The learned reward when any prompt's environment (``env_classes``) is ``reward_model``; None when
    none is. A ``reward_model.adapter_path`` that no prompt would use is an error (it would do nothing)."""
    if REWARD_MODEL_ENV in env_classes:
        if cfg.data.val_data and cfg.trainer.eval_interval > 0:
            from mlora.train.metrics_log import log

            # evaluation generates and scores on global rank 0 alone; the reward model needs every rank
            log.warning("held-out evaluation (eval/*) scores %s prompts with their rule part only "
                        "(reward_model.rule_env), not with the reward model; the training metrics "
                        "reward_model/score* hold the reward model's scores", REWARD_MODEL_ENV)
        return LearnedReward(cfg, model, engine)
    if cfg.reward_model.adapter_path:
        raise ValueError(f"reward_model.adapter_path={cfg.reward_model.adapter_path!r} is set, but no prompt uses "
                         f"environment {REWARD_MODEL_ENV!r} (environment.env_class={cfg.environment.env_class!r}, "
                         f"prompt env_class values: {sorted(env_classes)}): set environment.env_class={REWARD_MODEL_ENV}")
    return None
