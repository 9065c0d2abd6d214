"""The critic's optimizer has its own weight decay, warm-up, schedule and betas, and its own mini-batch
size (before, both optimizers were built from the policy's settings and one mini-batch size)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import mlora
from mlora.train.config import PPOConfig
from mlora.train.engine import ActorCriticEngine

pytestmark = pytest.mark.quick

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from ppo_equivalence import synthetic_rollouts  # noqa: E402  (8 sequences, 4 prompts x 2 samples)

LR = 1e-3


@pytest.fixture(scope="module")
def mesh():
    return mlora.init_parallel(tp=1, pp=1)


def _engine(tiny_models, mesh, **kw) -> ActorCriticEngine:
    model = mlora.from_pretrained(tiny_models / "llama", mesh)
    cfg = dict(advantage_estimator="gae", mini_batch_size=4, micro_train_batch_size=2, micro_forward_batch_size=4,
               actor_lr=LR, critic_lr=LR, lr_schedule="constant", warmup_steps=0, weight_decay=0.0,
               critic_lr_schedule="constant_with_warmup", critic_warmup_steps=4, critic_weight_decay=0.5,
               critic_betas=(0.8, 0.95))
    cfg.update(kw)
    return ActorCriticEngine(model, PPOConfig(**cfg), critic_lora=mlora.LoraConfig(rank=4, seed=5))


def test_critic_weight_decay_and_warmup_take_effect(tiny_models, mesh):
    engine = _engine(tiny_models, mesh)
    assert engine.critic_opt.param_groups[0]["betas"] == (0.8, 0.95)
    assert engine.actor_opt.param_groups[0]["betas"] == (0.9, 0.999)
    # one AdamW step with zero gradients moves nothing but the decoupled weight decay: p <- p·(1 - lr·wd),
    # lr = 1e-3 · 1/4 in the first of 4 warm-up steps; the actor (wd 0) stays put (exact, float32 1e-7)
    critic_before = [p.detach().clone() for p in engine.critic_params]
    actor_before = [p.detach().clone() for p in engine.actor_params]
    assert any(p.abs().sum() > 0 for p in critic_before)
    for opt, params in ((engine.actor_opt, engine.actor_params), (engine.critic_opt, engine.critic_params)):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
    shrink = 1 - LR / 4 * 0.5
    for p, before in zip(engine.critic_params, critic_before):
        torch.testing.assert_close(p.detach(), before * shrink, atol=1e-7, rtol=1e-6)
    for p, before in zip(engine.actor_params, actor_before):
        assert torch.equal(p.detach(), before)


def test_critic_lr_schedule_and_mini_batch_in_step(tiny_models, mesh):
    # 8 sequences: the actor takes 2 mini-batches of 4, the critic 4 of 2 (critic_mini_batch_size);
    # the critic warms up over 4 steps (lr·(s+1)/4), the actor's lr is constant
    engine = _engine(tiny_models, mesh, critic_mini_batch_size=2)
    metrics = engine.step(synthetic_rollouts(engine.model.spec.vocab_size))
    assert [s["lr"] for s in metrics["actor/per_minibatch"]] == pytest.approx([LR, LR])
    assert [s["lr"] for s in metrics["critic/per_minibatch"]] == pytest.approx([LR * k / 4 for k in (1, 2, 3, 4)])


def test_lr_schedules():
    from mlora.rl.lr_schedule import lr_lambda

    # constant_with_warmup (SkyRL's name) == constant here: linear warm-up, then 1
    assert [lr_lambda(s, 2, 10, 0.0, "constant_with_warmup") for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert [lr_lambda(s, 2, 10, 0.0, "constant") for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_lambda(6, 2, 10, 0.0, "cosine") == pytest.approx(0.5)  # halfway through the decay
    with pytest.raises(ValueError, match="unknown lr schedule 'linear'; valid: constant, constant_with_warmup, "
                                         "cosine"):
        lr_lambda(0, 0, 10, 0.0, "linear")


def test_critic_mini_batch_errors(tiny_models, mesh):
    with pytest.raises(ValueError, match="critic_mini_batch_size=0 must be >= 1"):
        PPOConfig(critic_mini_batch_size=0)
    with pytest.raises(ValueError, match="unknown critic_lr_schedule 'linear'; valid: constant, "
                                         "constant_with_warmup, cosine"):
        PPOConfig(critic_lr_schedule="linear")
    batch = synthetic_rollouts(512)
    engine = _engine(tiny_models, mesh, critic_mini_batch_size=3)
    with pytest.raises(ValueError, match="batch of 8 sequences is not divisible by critic_mini_batch_size=3"):
        engine.step(batch)
    engine = _engine(tiny_models, mesh, critic_mini_batch_size=2, micro_train_batch_size=4)
    with pytest.raises(ValueError, match="critic_mini_batch_size=2 is not divisible by micro_train_batch_size x DP "
                                         "= 4 x 1"):
        engine.step(batch)
