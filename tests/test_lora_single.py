"""Adapter registry behaviour on one rank: targets, stacking selection, dropout, init, errors."""

from __future__ import annotations

import json

import pytest
import torch
from peft_refs import random_peft_adapter

import mlora
from mlora.formats.checkpoint_reader import CheckpointError
from mlora.lora.targets import resolve_targets

pytestmark = pytest.mark.quick

L = 4


def ids():
    return torch.randint(0, 1001, (2, 9), generator=torch.Generator().manual_seed(0))


def test_target_resolution():
    every = resolve_targets("all-linear", None, L)
    assert len(every) == 7 * L
    assert resolve_targets(["linear_qkv"], None, L) == {(i, p) for i in range(L) for p in ("q_proj", "k_proj", "v_proj")}
    assert resolve_targets(["linear_fc1", "linear_fc2"], None, L) == {
        (i, p) for i in range(L) for p in ("gate_proj", "up_proj", "down_proj")}
    assert resolve_targets("all-linear", ["layers.0.self_attn.q_proj", "down_proj"], L) == every - {
        (0, "q_proj")} - {(i, "down_proj") for i in range(L)}
    assert resolve_targets(["decoder.layers.1.self_attention.linear_proj"], None, L) == {(1, "o_proj")}
    with pytest.raises(ValueError, match="unknown target module 'qkv_proj'; valid names: all-linear, q_proj"):
        resolve_targets(["qkv_proj"], None, L)
    with pytest.raises(ValueError, match="matches no module"):
        resolve_targets(["layers.9.self_attn.q_proj"], None, L)
    # the output layer: only when named (HF or megatron name), keyed by the last layer; never through all-linear
    assert resolve_targets(["q_proj", "lm_head"], None, L) == {(i, "q_proj") for i in range(L)} | {(L - 1, "lm_head")}
    assert resolve_targets(["output_layer"], None, L) == {(L - 1, "lm_head")}
    assert (L - 1, "lm_head") not in every


def test_lm_head_needs_a_vocabulary_tp_divides():
    from types import SimpleNamespace

    from mlora.lora.sites import check_lm_head

    spec = SimpleNamespace(num_layers=L, vocab_size=1001)
    check_lm_head(spec, 1, {(L - 1, "lm_head")})
    check_lm_head(spec, 2, {(0, "q_proj")})
    with pytest.raises(ValueError, match=r"LoRA on lm_head at TP=2: the vocabulary \(1001\) must divide by TP"):
        check_lm_head(spec, 2, {(L - 1, "lm_head")})


def test_config_errors():
    with pytest.raises(ValueError, match="LoRA rank=0 is invalid"):
        mlora.LoraConfig(rank=0)
    with pytest.raises(ValueError, match="LoRA rank=-2 is invalid"):
        mlora.LoraConfig(rank=-2)
    with pytest.raises(ValueError, match="dropout=1.5"):
        mlora.LoraConfig(dropout=1.5)


def test_new_adapter_leaves_output_unchanged_and_only_adapters_train(model):
    x = ids()
    base = model.logits(x)
    model.add_adapter("policy", mlora.LoraConfig(rank=4, alpha=8))
    assert torch.equal(model.logits(x), base)  # B starts at zero
    trainable = model.trainable_parameters()
    assert trainable and all(any(p is q for q in model.parameters()) for p in trainable)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(".lora." in n for n in names)
    with pytest.raises(ValueError, match="an adapter named 'policy' already exists"):
        model.add_adapter("policy", mlora.LoraConfig())


def test_q_v_only_adapts_q_and_v_only(model):
    model.add_adapter("qv", mlora.LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
    branches = [(type(m).__name__, m.lora["qv"].subs) for m in model._lora_linears() if "qv" in m.lora]
    assert branches == [("LoraColumnParallelLinear", ("q_proj", "v_proj"))] * L
    names = model.adapter_tensors("qv")
    assert {n.split(".")[-3] for n in names} == {"q_proj", "v_proj"}
    assert len(names) == 2 * 2 * L


def test_use_adapters_selects_and_restores(model, tmp_path):
    x = ids()
    base = model.logits(x)
    random_peft_adapter(model.hf_dir, tmp_path / "a", r=4, alpha=8, seed=11)
    model.load_adapter("a", tmp_path / "a")
    with_a = model.logits(x)
    assert not torch.allclose(with_a, base)
    with model.use_adapters():
        assert torch.equal(model.logits(x), base)
        with model.use_adapters("a"):
            assert torch.equal(model.logits(x), with_a)
        assert torch.equal(model.logits(x), base)
    assert torch.equal(model.logits(x), with_a)
    with pytest.raises(ValueError, match=r"unknown adapters \['b'\]; this model has \['a'\]"):
        with model.use_adapters("b"):
            pass
    assert not any(p.requires_grad for p in model.parameters())  # loaded frozen by default


def test_dropout_only_in_training(model, tmp_path):
    random_peft_adapter(model.hf_dir, tmp_path / "d", r=4, alpha=8, seed=12, dropout=0.5)
    model.load_adapter("d", tmp_path / "d", trainable=True)
    x = ids()
    model.eval()
    e1, e2 = model.logits(x), model.logits(x)
    assert torch.equal(e1, e2)
    with model.use_adapters():
        base = model.logits(x)
    model.train()
    t1, t2 = model.logits(x), model.logits(x)
    assert not torch.allclose(t1, e1) and not torch.allclose(t1, t2)
    with model.use_adapters():
        assert torch.equal(model.logits(x), base)  # dropout lives on the LoRA branch only


def test_adapter_that_does_not_fit_the_base(model, tiny_models, tmp_path):
    bad = random_peft_adapter(tiny_models / "mistral", tmp_path / "mistral_adapter", r=4, alpha=8, seed=13)
    with pytest.raises(CheckpointError, match=r"down_proj.lora_A.weight has shape \(4, 192\), this base needs "
                                              r"\(4, 256\) \(an adapter for another base\?\)"):
        model.load_adapter("m", bad)
    ok = random_peft_adapter(model.hf_dir, tmp_path / "r_mismatch", r=4, alpha=8, seed=14)
    cfg = json.loads((ok / "adapter_config.json").read_text())
    cfg["r"] = 6
    (ok / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"r in adapter_config.json is 6"):
        model.load_adapter("r", ok)
    cfg["r"], cfg["use_dora"] = 4, True
    (ok / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        model.load_adapter("r", ok)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        model.load_adapter("x", tmp_path / "nope")
    assert not model.adapters  # nothing half-created


def test_weights_load_only_under_the_scaling_they_were_trained_with(model, tmp_path):
    """Resuming puts saved factors into the run's adapters (``load_adapter_weights``): another lora_alpha or
    rsLoRA would make the same factors compute another function, and is refused naming both."""
    saved = random_peft_adapter(model.hf_dir, tmp_path / "saved", r=4, alpha=8, seed=15)
    model.add_adapter("same", mlora.LoraConfig(rank=4, alpha=8))
    model.load_adapter_weights("same", saved)  # same rank and scaling: fine
    model.add_adapter("alpha", mlora.LoraConfig(rank=4, alpha=16))
    with pytest.raises(ValueError, match=r"lora_alpha=8, use_rslora=False \(scaling 2\), adapter 'alpha' has "
                                         r"lora_alpha=16, use_rslora=False \(scaling 4\)"):
        model.load_adapter_weights("alpha", saved)
    model.add_adapter("rs", mlora.LoraConfig(rank=4, alpha=8, use_rslora=True))
    with pytest.raises(ValueError, match=r"adapter 'rs' has lora_alpha=8, use_rslora=True \(scaling 4\)"):
        model.load_adapter_weights("rs", saved)
