"""A reward adapter trained on top of a frozen SFT adapter (mlora-train --config-name rm with
trainer.policy.model.frozen_adapter_path) records it, and PPO's reward (environment.env_class=reward_model)
scores with it stacked under the reward adapter: the PPO score of a sequence equals the RM stage's own
score of it (float32, |diff| <= 1e-5), whether PPO runs on that same SFT adapter (reused) or on none (loaded
as ``reward_base``). A recorded adapter that is missing or changed is refused, naming it (tiny Llama, TP1)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.quick

TOL = 1e-5  # float32, the same forward on the same base and adapters
N_VAL = 8  # held-out pairs: scored by the RM stage at its last step, and by PPO


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    from mlora.demos.preference_assets import build_preference_assets

    return build_preference_assets(tmp_path_factory.mktemp("reward_base_assets"), n_train=16, n_val=N_VAL)


@pytest.fixture(scope="module")
def model(assets):
    import mlora

    return mlora.from_pretrained(assets / "tiny-llama", mlora.init_parallel(tp=1, pp=1))


def _clear(model) -> None:
    for name in list(model.adapters):
        model.delete_adapter(name)
    for name in list(model.heads):
        del model.heads[name]


@pytest.fixture(scope="module")
def sft_dir(model, tmp_path_factory) -> Path:
    """A random SFT adapter (B != 0, so the reward adapter's scores depend on it)."""
    from mlora.lora.config import LoraConfig

    model.add_adapter("sft_src", LoraConfig(rank=4, alpha=8, seed=3))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.adapter_parameters("sft_src"):
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    out = tmp_path_factory.mktemp("sft") / "final_adapter"
    model.save_adapter("sft_src", out)
    _clear(model)
    return out


@pytest.fixture(scope="module")
def rm_run(assets, sft_dir, tmp_path_factory) -> tuple[Path, dict]:
    """The RM stage on top of the frozen SFT adapter, evaluated on the held-out pairs at its last step;
    returns its final adapter and that step's metrics."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlora.config.schema import register_schema
    from mlora.config.validate import finalize
    from mlora.train.__main__ import CONFIG_DIR
    from mlora.train.preference_stage import run_preference

    run_dir = tmp_path_factory.mktemp("rm")
    overrides = [f"trainer.policy.model.path={assets / 'tiny-llama'}",
                 f"data.train_data=[{assets}/pairs_train.parquet]", f"data.val_data=[{assets}/pairs_val.parquet]",
                 f"trainer.run_dir={run_dir}", f"trainer.policy.model.frozen_adapter_path={sft_dir}",
                 "trainer.train_batch_size=8", "trainer.micro_train_batch_size_per_gpu=4", "trainer.total_steps=2",
                 "trainer.eval_interval=2", "trainer.eval_before_train=false", "trainer.ckpt_interval=0",
                 "trainer.policy.optimizer_config.lr=3e-2", "trainer.policy.model.lora.rank=4",
                 "trainer.policy.model.lora.alpha=8"]
    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="rm", overrides=overrides))
    run_preference(cfg, finalize(cfg, 1, False, overrides))
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 2 and "eval/rewards/chosen" in last
    return run_dir / "final_adapter", last


def _held_out(assets: Path):
    """The held-out pairs as the RM stage batches them (every chosen row, then every rejected row), and
    the pad id."""
    from transformers import AutoTokenizer

    from mlora.train.preference_data import collate, load_examples

    tok = AutoTokenizer.from_pretrained(str(assets / "tiny-llama"))
    examples, _ = load_examples([str(assets / "pairs_val.parquet")], tok, True, 1024, "val")
    assert len(examples) == N_VAL
    return examples, collate(examples, tok.pad_token_id, True), tok.pad_token_id


def _ppo_scores(model, reward_dir: Path, batch, frozen: Path | None):
    """PPO's learned reward of every row (model_weight 1, rule part 0), as the RL loop builds it; returns
    ``(scores, adapters scored under, PPO engine)``."""
    from mlora.config.schema import TrainConfig
    from mlora.train.batch import RolloutBatch
    from mlora.train.config import PPOConfig
    from mlora.train.engine import ActorCriticEngine
    from mlora.train.learned_reward import build_learned_reward
    from mlora.train.loop import FROZEN

    cfg = TrainConfig()
    cfg.environment.env_class = "reward_model"
    cfg.reward_model.adapter_path = str(reward_dir)
    cfg.trainer.policy.model.frozen_adapter_path = None if frozen is None else str(frozen)
    if frozen is not None:  # as mlora.train.loop.load_model does
        model.load_adapter(FROZEN, frozen, trainable=False)
    engine = ActorCriticEngine(model, PPOConfig(mini_batch_size=2, micro_forward_batch_size=2,
                                                micro_train_batch_size=2),
                               reference_adapters=(FROZEN,) if frozen is not None else ())
    learned = build_learned_reward(cfg, model, engine, {"reward_model"},
                                   run_frozen=FROZEN if frozen is not None else None)
    rows = RolloutBatch(batch.input_ids, batch.attention_mask, batch.response_mask, torch.zeros(batch.rows))
    learned.apply(rows, [("reward_model", "stop")] * batch.rows)
    return rows.rewards, learned.adapters, engine


def test_ppo_scores_equal_the_rm_stage_scores(model, assets, sft_dir, rm_run):
    from mlora.export.reward_adapter import REWARD_META, adapter_identity, load_reward_adapter
    from mlora.train.batch import RolloutBatch
    from mlora.train.learned_reward import REWARD
    from mlora.train.loop import FROZEN
    from mlora.train.preference_data import collate
    from mlora.train.preference_engine import PreferenceConfig, PreferenceEngine

    reward_dir, last = rm_run
    meta = json.loads((reward_dir / REWARD_META).read_text())
    assert meta["frozen_adapter"] == adapter_identity(sft_dir)
    examples, batch, pad = _held_out(assets)

    # the RM stage's own score of each sequence: its loss function, one held-out pair at a time, on its adapters
    _clear(model)
    model.load_adapter(FROZEN, sft_dir, trainable=False)
    load_reward_adapter(model, reward_dir, adapter_name=REWARD, head_name=REWARD)
    rm = PreferenceEngine(model, PreferenceConfig(stage="rm", micro_batch_size=1), adapter=REWARD,
                          reference_adapters=(FROZEN,))
    own = [rm.evaluate(collate([ex], pad, True)) for ex in examples]
    rm_scores = torch.tensor([m["rewards/chosen"] for m in own] + [m["rewards/rejected"] for m in own])
    # ... and what the RM run itself logged for these pairs at its last step (its means)
    assert abs(float(rm_scores[:N_VAL].mean()) - last["eval/rewards/chosen"]) < TOL
    assert abs(float(rm_scores[N_VAL:].mean()) - last["eval/rewards/rejected"]) < TOL
    _clear(model)

    # PPO on no frozen adapter: the recorded SFT adapter is loaded under the reward adapter
    scores, adapters, engine = _ppo_scores(model, reward_dir, batch, frozen=None)
    assert adapters == ("reward_base", REWARD)
    assert not any(p.requires_grad for p in model.adapter_parameters("reward_base"))
    print(f"max |PPO - RM| {(scores - rm_scores).abs().max():.2e} over {batch.rows} sequences")
    assert (scores - rm_scores).abs().max().item() < TOL, (scores, rm_scores)
    # what PPO scored before: the reward adapter alone, far off
    alone = engine.reward_scores(RolloutBatch(batch.input_ids, batch.attention_mask, batch.response_mask,
                                             torch.zeros(batch.rows)), (REWARD,), REWARD)
    assert (alone - rm_scores).abs().max().item() > 100 * TOL
    _clear(model)

    # PPO on the same SFT adapter (a copy elsewhere: the same weights): reused, not loaded twice
    copy = sft_dir.parent / "copy_of_sft"
    shutil.copytree(sft_dir, copy, dirs_exist_ok=True)
    scores, adapters, _ = _ppo_scores(model, reward_dir, batch, frozen=copy)
    assert adapters == ("frozen", REWARD) and "reward_base" not in model.adapters
    assert (scores - rm_scores).abs().max().item() < TOL, (scores, rm_scores)
    _clear(model)


def test_missing_or_changed_frozen_adapter_is_refused(model, assets, sft_dir, rm_run, tmp_path):
    from mlora.config.schema import TrainConfig
    from mlora.config.validate import ConfigError, finalize
    from mlora.export.reward_adapter import REWARD_META

    reward_dir, _ = rm_run
    moved_sft = tmp_path / "sft"
    shutil.copytree(sft_dir, moved_sft)
    reward = tmp_path / "reward"
    shutil.copytree(reward_dir, reward)
    meta = json.loads((reward / REWARD_META).read_text())
    meta["frozen_adapter"]["path"] = str(moved_sft)
    (reward / REWARD_META).write_text(json.dumps(meta))
    _, batch, _ = _held_out(assets)

    shutil.rmtree(moved_sft)
    _clear(model)
    with pytest.raises(FileNotFoundError, match=f"trained on top of the frozen adapter '{moved_sft}'.*missing"):
        _ppo_scores(model, reward, batch, frozen=None)
    assert not {"reward", "reward_base"} & set(model.adapters)  # refused before anything of it loaded
    cfg = TrainConfig()
    cfg.trainer.policy.model.path = str(assets / "tiny-llama")
    cfg.environment.env_class = "reward_model"
    cfg.reward_model.adapter_path = str(reward)
    with pytest.raises(ConfigError, match=f"reward_model.adapter_path=.*'{moved_sft}', which is missing"):
        finalize(cfg, 1, cuda=False)  # at start-up, before any model loads

    shutil.copytree(sft_dir, moved_sft)
    weights = moved_sft / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(ValueError, match=f"'{moved_sft}'.*changed since.*sha256"):
        _ppo_scores(model, reward, batch, frozen=None)
    _clear(model)
