"""A MoE adapter's experts at a rank of their own (``LoraConfig.expert_rank``, ``trainer.*.model.lora.expert_rank``).

Its PEFT files carry the experts' rank as ``r`` (PEFT's transformers-5 conversion derives the fused experts'
ranks from ``r`` alone) and every other module's in ``rank_pattern``, by exact path; they load back into mlora
with the same ranks and give the same logits; the planner counts the factors at those ranks; vLLM's own
``PEFTHelper`` reads each module's rank and scaling from the files; the engine hand-off folds each module's
scaling into its B. (PEFT loading such an adapter on Mixtral, layouts up to TP2 × EP2, and its merge:
``tests/test_moe_equivalence.py``.)
"""
from __future__ import annotations

import json

import pytest
import torch

import mlora
from mlora.lora.config import LoraConfig

pytestmark = pytest.mark.quick


def test_expert_rank_config():
    cfg = LoraConfig(rank=8, alpha=16, expert_rank=2)
    assert (cfg.rank_of(False), cfg.rank_of(True), cfg.scaling, cfg.scaling_of(True), cfg.max_rank) == (8, 2, 2, 8, 8)
    assert LoraConfig(rank=8, expert_rank=8).expert_rank is None  # the same adapter as without it
    assert LoraConfig(rank=4, alpha=8, use_rslora=True, expert_rank=16).scaling_of(True) == 2
    with pytest.raises(ValueError, match=r"expert_rank=0 is invalid: it must be a positive integer"):
        LoraConfig(expert_rank=0)


def test_expert_rank_saves_loads_and_scales(tiny_models, tmp_path):
    from vllm.lora.peft_helper import PEFTHelper

    from mlora.rollout.tensor_sync import lora_scaling, prescaled_config
    from mlora.testing import right_padded_batch

    mesh = mlora.init_parallel(tp=1, pp=1)
    with pytest.raises(ValueError, match=r"expert_rank=2 but the adapter adapts no MoE expert"):
        mlora.from_pretrained(tiny_models / "llama", mesh).add_adapter("a", LoraConfig(expert_rank=2))
    model = mlora.from_pretrained(tiny_models / "olmoe", mesh)
    with pytest.raises(ValueError, match=r"expert_rank=2 but the adapter adapts no MoE expert"):
        model.add_adapter("q", LoraConfig(expert_rank=2, target_modules=["q_proj"]))
    model.add_adapter("a", LoraConfig(rank=4, alpha=8, expert_rank=2, seed=1))
    layout = model.adapter_layout("a")
    expert = "base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight"
    attention = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert layout[expert][1][0] == 2 and layout[attention][1][0] == 4
    with torch.no_grad():
        for p in model.adapter_parameters("a"):
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    model.save_adapter("a", tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    pattern = config["rank_pattern"]
    assert config["r"] == 2 and set(pattern.values()) == {4} and r"model\.layers\.0\.self_attn\.q_proj" in pattern
    assert not any("experts" in key for key in pattern) and len(pattern) == 4 * 4  # q k v o of 4 layers

    # the planner counts the experts' factors at their rank
    from mlora.plan.weights import adapter_bytes

    planned = adapter_bytes(model.spec, 1, 1, model.adapters["a"].config, torch.float32)[(0, 0)]
    assert planned == sum(p.numel() * 4 for p in model.adapter_parameters("a"))

    model.load_adapter("b", tmp_path / "a")
    loaded = model.adapters["b"].config
    assert (loaded.rank, loaded.expert_rank, loaded.scaling_of(True)) == (4, 2, 4.0)
    ids, mask = right_padded_batch(model.spec.vocab_size, (9, 6), seed=2)
    with model.use_adapters("a"):
        want = model.logits(ids, attention_mask=mask)
    with model.use_adapters("b"):
        assert torch.equal(model.logits(ids, attention_mask=mask), want)
    model.load_adapter_weights("a", tmp_path / "a")  # the same ranks: resumes
    model.add_adapter("c", LoraConfig(rank=4, alpha=8, expert_rank=1))
    with pytest.raises(ValueError, match=r"its experts have rank 2, adapter 'c' 1"):
        model.load_adapter_weights("c", tmp_path / "a")

    # vLLM reads each module's rank and scaling as mlora trains them (fused experts keyed as PEFT stores them)
    helper = PEFTHelper.from_local_dir(str(tmp_path / "a"), max_position_embeddings=None)
    assert helper.get_rank_and_scaling("model.layers.0.self_attn.q_proj") == (4, 2.0)
    assert helper.get_rank_and_scaling("model.layers.0.mlp.experts.3.gate_proj") == (2, 4.0)
    # the hand-off folds each module's own scaling into its B, and tells vLLM every module's is then 1
    assert lora_scaling(config, attention.replace("lora_A", "lora_B")) == 2.0
    assert lora_scaling(config, expert.replace("lora_A", "lora_B")) == 4.0
    # another project's rank_pattern (a regex, not an exact path) resolves as vLLM's: the first matching key
    foreign = {**config, "rank_pattern": {"q_proj": 8, r"layers\.0\..*": 1}}
    assert lora_scaling(foreign, attention) == 1.0 and lora_scaling(foreign, expert) == 8.0
    vllm_foreign = PEFTHelper.from_dict({**foreign, "vllm_max_position_embeddings": None})
    assert vllm_foreign.get_rank_and_scaling("model.layers.0.self_attn.q_proj") == (8, 1.0)
    prescaled, _ = prescaled_config(config)
    helper = PEFTHelper.from_dict({**prescaled, "vllm_max_position_embeddings": None})
    assert {helper.get_rank_and_scaling(m)[1] for m in ("model.layers.1.self_attn.o_proj",
                                                        "model.layers.1.mlp.experts.0.down_proj")} == {1.0}
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({**config, "rank_pattern": {"q_proj": 8, "v_proj": 2}}))
    with pytest.raises(ValueError, match=r"rank_pattern .* is not supported"):
        model.load_adapter("d", bad)


def test_expert_rank_on_a_dense_base_is_a_config_error(tiny_models):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlora.config.errors import ConfigError
    from mlora.config.schema import register_schema
    from mlora.config.validate import finalize
    from mlora.train.__main__ import CONFIG_DIR

    register_schema()
    args = [f"trainer.policy.model.path={tiny_models / 'llama'}", "trainer.critic.model.lora.expert_rank=2"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="ppo", overrides=args))
    with pytest.raises(ConfigError, match=r"trainer.critic.model.lora.expert_rank=2 on .*llama, which has no experts"):
        finalize(cfg, 1, cuda=False, explicit=[a.split("=", 1)[0] for a in args])
