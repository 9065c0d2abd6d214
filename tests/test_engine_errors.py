"""Bad RL input gets a clear error."""

from __future__ import annotations

import pytest
import torch

import mlora
from mlora.train.batch import RolloutBatch
from mlora.train.config import PPOConfig
from mlora.train.engine import ActorCriticEngine

pytestmark = pytest.mark.quick


def test_config_errors():
    with pytest.raises(ValueError, match="unknown advantage estimator 'vtrace'; valid: gae, grpo, rloo"):
        PPOConfig(advantage_estimator="vtrace")
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'; valid: token-mean"):
        PPOConfig(loss_agg_mode="mean")
    with pytest.raises(ValueError, match="unknown KL estimator 'k7'"):
        PPOConfig(kl_estimator="k7")
    with pytest.raises(ValueError, match="'seq-mean-token-sum-norm' divides by max_seq_len: set max_seq_len"):
        PPOConfig(loss_agg_mode="seq-mean-token-sum-norm")
    PPOConfig(loss_agg_mode="seq-mean-token-sum-norm", max_seq_len=1024)
    with pytest.raises(ValueError, match="temperature=0 must be > 0"):
        PPOConfig(temperature=0)
    with pytest.raises(ValueError, match=r"top_p=1.5 must be in \(0, 1\]"):
        PPOConfig(top_p=1.5)
    with pytest.raises(ValueError, match="top_k=-2 must be >= 1, or -1 / 0 for off"):
        PPOConfig(top_k=-2)
    with pytest.raises(ValueError, match=r"min_p=2 must be in \[0, 1\]"):
        PPOConfig(min_p=2)
    with pytest.raises(ValueError, match="unknown lr_schedule 'step'; valid: constant, constant_with_warmup, cosine"):
        PPOConfig(lr_schedule="step")


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
