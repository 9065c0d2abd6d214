"""Initialisation of new adapters: per-module and per-adapter seeds, and LoraConfig.init_method.

The mesh-independence of the init (TP1 vs TP2, PP2, TP2xPP2) is checked in the torchrun launches
of tests/test_lora_equivalence.py (check "fresh_init").
"""

from __future__ import annotations

import math

import pytest
import torch

import mlora
from mlora.export.peft_files import peft_adapter_config
from mlora.facade.adapters import _draw_a
from mlora.lora.config import INIT_METHODS, derive_seed

pytestmark = pytest.mark.quick

L = 4
SHAPE = (16, 4096)  # 65536 draws: the standard error of a sample std is 0.28 %, the tolerance 2 % (> 7 se)
STD_REL_TOL = 0.02
MEAN_TOL_SE = 6  # |mean| below 6 standard errors


def a_factors(model, name: str, factor: str = "A") -> dict[tuple[int, str], torch.Tensor]:
    """(layer, projection) -> A (or B) of adapter ``name``, in PEFT layout."""
    out = {}
    for key, t in model.adapter_tensors(name).items():
        if key.endswith(f"lora_{factor}.weight"):
            parts = key.split(".")
            out[(int(parts[parts.index("layers") + 1]), parts[-3])] = t
    return out


def test_every_module_gets_its_own_a(model):
    # tiny Llama: q_proj, gate_proj and o_proj all read 128 features; the positional seed gave
    # q_proj and gate_proj (and k_proj and up_proj) the same A in every layer
    model.add_adapter("policy", mlora.LoraConfig(rank=4, alpha=8))
    a = a_factors(model, "policy")
    assert len(a) == 7 * L
    for layer in range(L):
        assert not torch.equal(a[(layer, "q_proj")], a[(layer, "gate_proj")])
        assert not torch.equal(a[(layer, "k_proj")], a[(layer, "up_proj")])
    flat = [t.flatten()[:64] for t in a.values()]  # any two modules: no shared draws at all
    assert len({tuple(t.tolist()) for t in flat}) == len(flat)


def test_adapter_names_get_their_own_a_and_are_reproducible(model):
    cfg = mlora.LoraConfig(rank=4, alpha=8, seed=3)
    model.add_adapter("policy", cfg)
    model.add_adapter("critic", cfg)
    policy, critic = a_factors(model, "policy"), a_factors(model, "critic")
    assert all(not torch.equal(policy[k], critic[k]) for k in policy)
    model.delete_adapter("policy")
    model.add_adapter("policy", cfg)
    again = a_factors(model, "policy")
    assert all(torch.equal(policy[k], again[k]) for k in policy)  # same name + config: same adapter
    model.add_adapter("seed4", mlora.LoraConfig(rank=4, alpha=8, seed=4))
    model.add_adapter("seed5", mlora.LoraConfig(rank=4, alpha=8, seed=5))
    s4, s5 = a_factors(model, "seed4"), a_factors(model, "seed5")
    assert all(not torch.equal(s4[k], s5[k]) for k in s4)


def test_derive_seed_is_stable():
    # a fixed value: the hash must not change between processes (Python's hash() is salted)
    assert derive_seed(0, "policy", 3, "q_proj", "init_A") == derive_seed(0, "policy", 3, "q_proj", "init_A")
    assert derive_seed(0, "policy", 3, "q_proj") != derive_seed(0, "policy", 3, "gate_proj")
    assert derive_seed(1, "a") == 6440554082728056534
    assert 0 <= derive_seed("x") < 2**63


def _std(method: str, rank: int, fan_in: int) -> float:
    return {"kaiming": 1 / math.sqrt(3 * fan_in),  # U(±b) has std b/√3, b = 1/√in
            "gaussian": 1 / rank,  # PEFT: normal_(std=1/r)
            "xavier": math.sqrt(2 / (fan_in + rank)),  # xavier_normal_ on [r, in]
            "normal": 0.2}[method]


@pytest.mark.parametrize("method", ["kaiming", "gaussian", "xavier", "normal"])
def test_init_method_statistics(method):
    rank, fan_in = SHAPE
    a = _draw_a(method, SHAPE, torch.Generator().manual_seed(0))
    assert a.shape == SHAPE and a.dtype == torch.float64
    std = _std(method, rank, fan_in)
    assert abs(a.std().item() / std - 1) < STD_REL_TOL, (a.std().item(), std)
    assert abs(a.mean().item()) < MEAN_TOL_SE * std / math.sqrt(a.numel())
    if method == "kaiming":
        assert a.abs().max().item() <= 1 / math.sqrt(fan_in)
    else:  # gaussian tails: beyond 3 std ~0.27 % of draws, never for a uniform
        tail = (a.abs() > 3 * std).double().mean().item()
        assert 0.0015 < tail < 0.004, tail


def test_zero_init_and_its_warning():
    with pytest.warns(UserWarning, match="will not train"):
        cfg = mlora.LoraConfig(init_method="zero")
    assert cfg.init_method == "zero"
    assert not _draw_a("zero", (4, 8), torch.Generator().manual_seed(0)).any()


@pytest.mark.parametrize("method", ["gaussian", "xavier", "normal", "zero"])
def test_init_method_reaches_the_adapter(model, method):
    # every site of the model: A [r, in] with the method's std, B zero
    if method == "zero":
        with pytest.warns(UserWarning):
            cfg = mlora.LoraConfig(rank=8, alpha=16, init_method=method)
    else:
        cfg = mlora.LoraConfig(rank=8, alpha=16, init_method=method)
    model.add_adapter("m", cfg)
    b_factors = a_factors(model, "m", "B")
    for (layer, proj), a in a_factors(model, "m").items():
        fan_in = 256 if proj == "down_proj" else 128
        assert a.shape == (8, fan_in)
        assert not b_factors[(layer, proj)].any()
        if method == "zero":
            assert not a.any()
        else:  # 1024 or 2048 draws: std within 15 % (> 4.5 standard errors)
            assert abs(a.std().item() / _std(method, 8, fan_in) - 1) < 0.15, (layer, proj)


def test_unknown_init_method_names_the_valid_ones():
    with pytest.raises(ValueError, match="LoRA init_method='uniform' is invalid; valid: kaiming, gaussian, "
                                         "xavier, normal, zero"):
        mlora.LoraConfig(init_method="uniform")
    assert INIT_METHODS == ("kaiming", "gaussian", "xavier", "normal", "zero")
    assert mlora.LoraConfig().init_method == "kaiming"


def test_peft_config_records_gaussian_init():
    modules = {(0, "q_proj")}
    cfg = peft_adapter_config(mlora.LoraConfig(init_method="gaussian"), modules, 1, "base", "LlamaForCausalLM")
    assert cfg["init_lora_weights"] == "gaussian"
    assert peft_adapter_config(mlora.LoraConfig(), modules, 1, "base", "LlamaForCausalLM")["init_lora_weights"] is True
