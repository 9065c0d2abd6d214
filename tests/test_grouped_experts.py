"""The local experts as grouped GEMMs (:mod:`mlora.models.grouped_experts`) against megatron's sequential loop on the
same model: logits and every LoRA factor's gradient, float32, one process (the meshes are
``tests/test_moe_equivalence.py``'s, which run the grouped path against transformers)."""

from __future__ import annotations

import zlib

import pytest
import torch

import mlora
from mlora.models import grouped_experts
from mlora.models.grouped_experts import GroupedLoraExperts

LOGITS_TOL = 5e-6  # relative to the largest logit: float32 GEMMs over the same tokens, summed in another order
GRAD_TOL = 2e-5  # relative to the factor's largest gradient: sums over an expert's tokens in another order


def _experts(model) -> list[GroupedLoraExperts]:
    return [m for m in model.gpt.modules() if isinstance(m, GroupedLoraExperts)]


def _randomise(model, names) -> None:
    """Every factor of ``names`` random (B included: every branch changes the output and has a gradient)."""
    with torch.no_grad():
        for n, p in model.gpt.named_parameters():
            if any(f".lora.{a}." in n for a in names):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(n.encode()))) * 0.1)


def _run(model, ids, mask, names, grouped: bool, calls: list | None = None, **batch) -> tuple[torch.Tensor, dict]:
    """Logits and factor gradients of one forward_backward with the experts grouped or sequential."""
    for m in _experts(model):
        m.grouped = grouped
    lo, hi = model.vocab_shard_range()

    def loss_fn(logits, mb):
        return (logits[..., :hi - lo] * mb["attention_mask"][..., None]).sum() * 1e-3, {"logits": logits.detach()}

    with model.use_adapters(*names):
        out = model.forward_backward([{"input_ids": ids, "attention_mask": mask, **batch}], loss_fn)
    grads = {n: p.grad.clone() for n, p in model.gpt.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out[0]["logits"], grads


def _compare(seq, grp, zero_for_missing: bool = False) -> tuple[float, float]:
    (ls, gs), (lg, gg) = seq, grp
    logits = ((lg - ls).abs().max() / ls.abs().max()).item()
    if zero_for_missing:  # a branch routed to none of an expert's tokens: no gradient sequentially, zeros grouped
        assert set(gs) <= set(gg) and all(not gg[k].any() for k in set(gg) - set(gs))
    else:
        assert gs.keys() == gg.keys()
    grad = max(((gg[k] - gs[k]).abs().max() / gs[k].abs().max().clamp_min(1e-30)).item() for k in gs)
    return logits, grad


@pytest.fixture
def count_grouped(monkeypatch):
    """How many grouped GEMMs ran (0: the layers took megatron's sequential loop)."""
    calls = []
    real = grouped_experts.GROUPED_MM

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(grouped_experts, "GROUPED_MM", counted)
    return calls


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "glm4_moe"])
def test_grouped_equals_sequential(tiny_models, arch, count_grouped):
    """Two adapters at once on every expert (one of rank 2 on gate and down only: padded ranks, a projection left
    out), the router and attention: the grouped layers run (the GEMMs are counted) and give the sequential
    loop's logits and gradients; Qwen2-MoE and GLM-4.5 with their shared experts beside."""
    model = mlora.from_pretrained(tiny_models / arch, mlora.init_parallel(), dtype=torch.float32)
    model.add_adapter("a", mlora.LoraConfig(rank=4, alpha=8, target_modules=["all-linear", "gate"]))
    model.add_adapter("b", mlora.LoraConfig(rank=2, alpha=4, target_modules=["gate_proj", "down_proj", "q_proj"]))
    _randomise(model, ("a", "b"))
    ids = torch.randint(0, model.spec.vocab_size, (3, 19), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[2, 15:] = 0
    seq = _run(model, ids, mask, ("a", "b"), grouped=False)
    assert not count_grouped
    grp = _run(model, ids, mask, ("a", "b"), grouped=True)
    assert len(count_grouped) >= 4 * len(_experts(model))  # fc1 and fc2: the base and each adapter's A and B
    logits, grad = _compare(seq, grp)
    assert any(".experts." in k for k in seq[1])
    assert logits <= LOGITS_TOL and grad <= GRAD_TOL, (logits, grad)


def test_grouped_mixed_adapter_rows_equal_sequential(tiny_models, count_grouped):
    """A mixed-adapter micro-batch (two adapters on alternate rows, routed through the dispatcher with the tokens):
    each grouped adapter's delta is masked to its tokens, which equals the sequential loop's routed branches."""
    model = mlora.from_pretrained(tiny_models / "qwen3_moe", mlora.init_parallel(), dtype=torch.float32)
    for i, name in enumerate(("m1", "m2")):
        model.add_adapter(name, mlora.LoraConfig(rank=3 + 2 * i, alpha=8, seed=i, target_modules="all-linear"))
    _randomise(model, ("m1", "m2"))
    ids = torch.randint(0, model.spec.vocab_size, (4, 13), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    rows = {"m1": [0, 2], "m2": [1, 3]}
    seq = _run(model, ids, mask, ("m1", "m2"), grouped=False, adapter_rows=rows)
    grp = _run(model, ids, mask, ("m1", "m2"), grouped=True, adapter_rows=rows)
    assert count_grouped
    logits, grad = _compare(seq, grp, zero_for_missing=True)
    assert logits <= LOGITS_TOL and grad <= GRAD_TOL, (logits, grad)


def test_what_grouping_does_not_cover_runs_sequentially(tiny_models, count_grouped):
    """An adapter on some experts only: megatron's sequential loop runs (no grouped GEMM) and the result is the
    same as with grouping asked for; weights whose data was replaced after the build are stacked again."""
    model = mlora.from_pretrained(tiny_models / "mixtral", mlora.init_parallel(), dtype=torch.float32)
    model.add_adapter("some", mlora.LoraConfig(rank=4, alpha=8, target_modules=["experts.1.w1", "experts.2.w2"]))
    _randomise(model, ("some",))
    ids = torch.randint(0, model.spec.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    seq = _run(model, ids, mask, ("some",), grouped=False)
    grp = _run(model, ids, mask, ("some",), grouped=True)
    assert not count_grouped
    assert _compare(seq, grp) == (0.0, 0.0)
    model.delete_adapter("some")
    model.add_adapter("all", mlora.LoraConfig(rank=4, alpha=8, target_modules=["w1", "w2", "w3"]))
    _randomise(model, ("all",))
    before = _run(model, ids, mask, ("all",), grouped=True)
    fc1 = _experts(model)[0].local_experts[3].linear_fc1
    fc1.weight.data = fc1.weight.data.clone()  # no longer a view of the stack
    assert _compare(before, _run(model, ids, mask, ("all",), grouped=True)) == (0.0, 0.0)
    with torch.no_grad():
        fc1.weight.mul_(2.0)  # in place: the stack sees it
    changed = _run(model, ids, mask, ("all",), grouped=True)
    assert (changed[0] - before[0]).abs().max() > 1e-3
