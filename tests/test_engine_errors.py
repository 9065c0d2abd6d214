"""Bad RL input gets a clear error."""

from __future__ import annotations

import pytest
import torch

import mlora
from mlora.train.batch import RolloutBatch
from mlora.train.config import PPOConfig
from mlora.train.engine import ActorCriticEngine


def test_config_errors():
    with pytest.raises(ValueError, match="unknown advantage estimator 'vtrace'; valid: gae, grpo, rloo"):
        PPOConfig(advantage_estimator="vtrace")
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'; valid: token-mean"):
        PPOConfig(loss_agg_mode="mean")
    with pytest.raises(ValueError, match="unknown KL estimator 'k7'"):
        PPOConfig(kl_estimator="k7")


def test_zero_length_response():
    ids = torch.zeros(2, 6, dtype=torch.long)
    attn = torch.ones(2, 6, dtype=torch.long)
    resp = torch.zeros(2, 6, dtype=torch.long)
    resp[0, 3:] = 1
    with pytest.raises(ValueError, match=r"responses of length zero in rows \[1\]"):
        RolloutBatch(ids, attn, resp, torch.zeros(2))


def test_minibatch_not_divisible(tiny_models):
    mesh = mlora.init_parallel(tp=1, pp=1)
    model = mlora.from_pretrained(tiny_models / "qwen2", mesh)
    engine = ActorCriticEngine(model, PPOConfig(advantage_estimator="grpo", n_samples_per_prompt=2,
                                                mini_batch_size=4, micro_train_batch_size=3))
    ids = torch.randint(0, 100, (4, 6))
    resp = torch.zeros(4, 6, dtype=torch.long)
    resp[:, 3:] = 1
    batch = RolloutBatch(ids, torch.ones_like(ids), resp, torch.ones(4))
    with pytest.raises(ValueError, match=r"mini_batch_size=4 is not divisible by micro_train_batch_size x DP = 3 x 1"):
        engine.step(batch)
