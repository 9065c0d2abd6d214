"""LoRA dropout on one rank: PEFT semantics (one mask per projection), eval mode, mask slicing.

TP/PP independence of the masks (loss and gradients at TP2, TP2+SP, PP2, TP2xPP2 equal TP1) is
checked in the torchrun launches of tests/test_lora_equivalence.py (check "dropout").
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from peft_refs import random_peft_adapter

import mlora
from mlora.lora import layers
from mlora.lora.layers import DropoutKey, dropout_mask

pytestmark = pytest.mark.quick

P = 0.3
TOL = 1e-5  # float32, fused path vs per-projection reference (rtol and atol)
KEEP_TOL = 0.05  # keep fraction vs 1 - p; >= 1280 draws per mask: 0.05 is > 3.9 standard errors


def _with_random_b(model, name: str, cfg: mlora.LoraConfig) -> None:
    model.add_adapter(name, cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.adapter_parameters(name):
            if p.dim() == 2 and not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _peft_reference(linear, branch, x: torch.Tensor, masks: list[torch.Tensor]) -> torch.Tensor:
    """PEFT's forward, written from the layer geometry: each projection k computes
    ``s · B_k A_k (m_k ∘ x)`` in its HF layout, then the blocks are placed into the fused output."""
    site = linear.lora_site
    lead = x.shape[:-1]
    deltas = [F.linear(F.linear(x * m, branch.a_of(k)), branch.lora_B[k]) * branch.scaling
              for k, m in enumerate(masks)]
    base = F.linear(x, linear.weight, linear.bias)
    if site.parallel == "row":  # one projection, output in HF layout already
        return base + deltas[0]
    assert [off for off, _ in site.placement] == [sum(s for _, s in site.placement[:k]) for k in range(len(masks))]
    pieces = [d.view(*lead, site.groups, size) for d, (_, size) in zip(deltas, site.placement)]
    return base + torch.cat(pieces, dim=-1).reshape(*lead, site.groups * site.block)


@pytest.mark.parametrize("where", ["linear_qkv", "linear_fc1", "linear_proj"])
def test_fused_branch_matches_per_projection_dropout(model, where):
    _with_random_b(model, "d", mlora.LoraConfig(rank=4, alpha=8, dropout=P, seed=1))
    layer = model.gpt.decoder.layers[1]
    linear = getattr(layer.self_attention if where in ("linear_qkv", "linear_proj") else layer.mlp, where)
    branch = linear.lora["d"]
    x = torch.randn(5, 2, linear.lora_site.in_local, generator=torch.Generator().manual_seed(2), requires_grad=True)
    model.train()
    out, _ = linear(x)
    assert branch.dropout_calls == 1
    masks = branch.dropout_masks(x, 0)
    assert len(masks) == len(branch.subs)
    for m in masks:
        kept = m[m != 0]
        assert torch.equal(kept, torch.full_like(kept, 1 / (1 - P)))  # keep / (1 - p), as torch's dropout
        assert abs((m > 0).float().mean().item() - (1 - P)) < KEEP_TOL
    for i in range(len(masks)):  # q, k, v (gate, up) each draw their own mask
        for j in range(i):
            assert not torch.equal(masks[i], masks[j])
    ref = _peft_reference(linear, branch, x, masks)
    torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    params = [x, branch.lora_A, *branch.lora_B]
    got = torch.autograd.grad((out * w).sum(), params)
    want = torch.autograd.grad((ref * w).sum(), params)
    for g, r in zip(got, want):
        assert r.abs().sum() > 0
        torch.testing.assert_close(g, r, rtol=TOL, atol=TOL)
    out2, _ = linear(x)  # the next forward draws new masks
    assert branch.dropout_calls == 2 and not torch.allclose(out2, out)


def test_eval_mode_applies_no_dropout(model, tmp_path):
    random_peft_adapter(model.hf_dir, tmp_path / "d", r=4, alpha=8, seed=12, dropout=P)
    shutil.copytree(tmp_path / "d", tmp_path / "nod")
    cfg = json.loads((tmp_path / "nod" / "adapter_config.json").read_text())
    cfg["lora_dropout"] = 0.0
    (tmp_path / "nod" / "adapter_config.json").write_text(json.dumps(cfg))
    model.load_adapter("d", tmp_path / "d", trainable=True)
    model.load_adapter("nod", tmp_path / "nod", trainable=True)
    ids = torch.randint(0, 1001, (2, 9), generator=torch.Generator().manual_seed(0))
    branches = [m.lora["d"] for m in model._lora_linears() if "d" in m.lora]
    model.eval()
    with model.use_adapters("d"):
        dropped = model.logits(ids)
    with model.use_adapters("nod"):
        plain = model.logits(ids)
    assert torch.equal(dropped, plain)  # bit-identical: same stacked path, no mask
    assert all(b.dropout_calls == 0 for b in branches)  # eval draws nothing
    model.train()
    with model.use_adapters("d"):
        trained = model.logits(ids)
    assert not torch.allclose(trained, plain)
    assert all(b.dropout_calls == 1 for b in branches)  # one draw per forward call


def test_row_parallel_slice_is_a_slice_of_the_full_mask(monkeypatch):
    # a TP rank of a row-parallel layer applies its columns of the full-input mask; small chunks
    # make several generators per mask (the chunking must not depend on the slice)
    monkeypatch.setattr(layers, "MASK_CHUNK", 16)
    key = DropoutKey(seed=4, adapter="policy", layer=2, in_full=8)
    full = dropout_mask(key, "o_proj", 5, P, torch.ones(3, 5, 8))
    for offset in (0, 4):
        half = dropout_mask(DropoutKey(seed=4, adapter="policy", layer=2, in_full=8, in_offset=offset),
                            "o_proj", 5, P, torch.ones(3, 5, 4))
        assert torch.equal(half, full[..., offset:offset + 4])
    assert not torch.equal(full, dropout_mask(key, "o_proj", 6, P, torch.ones(3, 5, 8)))  # next call
    assert not torch.equal(full, dropout_mask(key, "down_proj", 5, P, torch.ones(3, 5, 8)))
    with pytest.raises(ValueError, match=r"input features \[6, 10\) do not fit in the full input width 8"):
        dropout_mask(DropoutKey(in_full=8, in_offset=6), "o_proj", 0, P, torch.ones(2, 4))
