"""The fused LoRA linear (hand-written backward) against the plain autograd composition it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlora.lora.layers import LoraBranch, LoraSite, lora_delta, lora_linear

pytestmark = pytest.mark.quick

R, T, D = 3, 5, 16  # rank, tokens, input features


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _branch(site, subs, seed, dropout=0.0, trainable=True):
    g = _gen(seed)
    a = torch.randn(len(subs) * R, site.in_local, generator=g, dtype=torch.float64)
    local = {sub: size * site.groups for sub, (_, size) in zip(site.subs, site.placement)} or {site.subs[0]: None}
    bs = [torch.randn(local[sub] or site.out_full[0], R, generator=g, dtype=torch.float64) for sub in subs]
    parallel = site.parallel
    return LoraBranch(subs, R, 1.5, dropout, a, bs, trainable=trainable, parallel=parallel)


# GQA q/k/v interleaved over 2 query groups (2 heads of 2 per group, head_dim 2); gate/up; a row site
QKV = LoraSite(layer=0, parallel="column", subs=("q_proj", "k_proj", "v_proj"), in_local=D, in_full=D,
               out_full=(8, 4, 4), groups=2, block=8, placement=((0, 4), (4, 2), (6, 2)))
FC1 = LoraSite(layer=0, parallel="column", subs=("gate_proj", "up_proj"), in_local=D, in_full=D, out_full=(6, 6),
               groups=1, block=12, placement=((0, 6), (6, 6)))
ROW = LoraSite(layer=0, parallel="row", subs=("o_proj",), in_local=D, in_full=D, out_full=(7,))


@pytest.mark.parametrize("case", ["qkv", "qkv_subset_two_branches", "fc1_bias_weight_grad", "row",
                                  "dropout", "frozen_input"])
def test_fused_equals_autograd_reference(case):
    site = {"qkv": QKV, "qkv_subset_two_branches": QKV, "dropout": QKV, "fc1_bias_weight_grad": FC1,
            "row": ROW, "frozen_input": FC1}[case]
    out_local = site.groups * site.block if site.parallel == "column" else site.out_full[0]
    g = _gen(1)
    x = torch.randn(T, 2, D, generator=g, dtype=torch.float64)
    weight = torch.randn(out_local, D, generator=g, dtype=torch.float64)
    bias = torch.randn(out_local, generator=g, dtype=torch.float64) if case == "fc1_bias_weight_grad" else None
    branches = [_branch(site, site.subs, 2, dropout=0.3 if case == "dropout" else 0.0)]
    if case == "qkv_subset_two_branches":
        branches = [_branch(site, ("q_proj", "v_proj"), 2), _branch(site, ("k_proj",), 3, trainable=False)]
    for b in branches:
        b.train()
    leaves = [t for t in (x, weight, bias) if t is not None]
    x.requires_grad_(case != "frozen_input")
    weight.requires_grad_(case == "fc1_bias_weight_grad")
    if bias is not None:
        bias.requires_grad_(True)
    params = [p for b in branches for p in b.parameters() if p.requires_grad]
    grad_out = torch.randn(T, 2, out_local, generator=g, dtype=torch.float64)

    def grads(fn):
        calls = [b.dropout_calls for b in branches]
        out = fn()
        for b, c in zip(branches, calls):
            b.dropout_calls = c  # both runs draw the same dropout masks
        wrt = [t for t in leaves + params if t.requires_grad]
        return [out.detach(), *torch.autograd.grad(out, wrt, grad_out)]

    ref = grads(lambda: F.linear(x, weight, bias) + sum(lora_delta(b, x, site) for b in branches))
    got = grads(lambda: lora_linear(x, weight, bias, branches, site))
    assert len(ref) == len(got)
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-12)
