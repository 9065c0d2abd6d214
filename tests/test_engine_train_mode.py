"""LoRA dropout is active in the actor/critic update passes (train mode) and off in the forward-only
passes (eval mode: old/ref log-probs and values are deterministic); the model's modes are restored."""

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


def _engine(tiny_models, dropout: float) -> ActorCriticEngine:
    mesh = mlora.init_parallel(tp=1, pp=1)
    model = mlora.from_pretrained(tiny_models / "llama", mesh)
    model.add_adapter("policy", mlora.LoraConfig(rank=4, alpha=8, dropout=dropout, seed=3))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B = 0 would make the branch (and its dropout) invisible
        for p in model.adapter_parameters("policy"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    # lr 0: parameters never move, so every update pass starts from the same adapter
    cfg = PPOConfig(advantage_estimator="gae", n_samples_per_prompt=2, mini_batch_size=8, micro_train_batch_size=4,
                    micro_forward_batch_size=4, actor_lr=0.0, critic_lr=0.0)
    engine = ActorCriticEngine(model, cfg, critic_lora=mlora.LoraConfig(rank=4, dropout=dropout, seed=5))
    with torch.no_grad():  # the critic's adapter and head (both start at 0) too
        for p in engine.critic_params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return engine


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_dropout_in_updates_only(tiny_models, dropout):
    engine = _engine(tiny_models, dropout)
    batch = synthetic_rollouts(engine.model.spec.vocab_size)
    old = [engine._forward_pass(batch, ("policy",), values=False) for _ in range(2)]
    values = [engine._forward_pass(batch, ("critic",), values=True) for _ in range(2)]
    assert torch.equal(old[0], old[1]) and torch.equal(values[0], values[1])  # forward-only: deterministic
    first, second = engine.step(batch), engine.step(batch)
    # ppo_kl = mean(old - new): the update pass recomputes the old log-probs exactly unless dropout is on
    kl = [m["actor/ppo_kl"] for m in (first, second)]
    if dropout == 0.0:
        assert max(abs(k) for k in kl) < 1e-6, kl
        assert first["actor/pg_loss"] == pytest.approx(second["actor/pg_loss"], abs=1e-7)
    else:
        assert min(abs(k) for k in kl) > 1e-4, kl  # dropout changed the update pass's log-probs
        assert abs(kl[0] - kl[1]) > 1e-5, kl  # and drew new masks in the second update
        assert abs(first["critic/value_loss"] - second["critic/value_loss"]) > 0
    # the old-logprob pass after two updates (lr 0) is still the same: eval mode
    assert torch.equal(engine._forward_pass(batch, ("policy",), values=False), old[0])


def test_modes_restored(tiny_models):
    engine = _engine(tiny_models, 0.5)
    model, batch = engine.model, synthetic_rollouts(engine.model.spec.vocab_size)
    assert not model.training  # from_pretrained gives eval mode, like HF
    before = {name: m.training for name, m in model.named_modules()}
    engine.step(batch)
    assert {name: m.training for name, m in model.named_modules()} == before
    model.train()
    model.heads.eval()  # a mixed state comes back exactly
    engine.step(batch)
    assert model.training and not any(m.training for m in model.heads.modules())
    assert all(m.training for m in model.gpt.modules())
