"""LoRA on parallel linears == HF+PEFT: logits, gradients, stacking, rank 3, zero extra collectives;
add_adapter's init and LoRA dropout do not depend on the mesh.

Three grouped torchrun launches cover (TP, PP) = (1,1), (2,1), (2,1)+SP, (1,2), (2,2), (2,2)+SP
for tiny Llama and Qwen2 with a random non-zero PEFT adapter (r 8, alpha 16, all seven projections).
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_records

pytestmark = pytest.mark.quick

LOGITS_TOL = 1e-4  # float32 absolute, issue 3
GRAD_REL_TOL = 1e-5  # ||g - g_peft|| / ||g_peft|| per factor
DROPOUT_TOL = 1e-5  # float32, dropout 0.3 in train mode vs TP1: relative loss, ||g - g_tp1|| / ||g_tp1|| per factor
MODELS = {"llama", "qwen2"}
LAUNCHES = {1: "1,1", 2: "2,1;2,1,sp;1,2", 4: "2,2;2,2,sp"}
EXPECTED = {1: {(1, 1, False)}, 2: {(2, 1, False), (2, 1, True), (1, 2, False)}, 4: {(2, 2, False), (2, 2, True)}}


@pytest.fixture(scope="module")
def records(tiny_models, peft_refs_dir, tmp_path_factory):
    out = {}
    for nproc, layouts in LAUNCHES.items():
        tmp = tmp_path_factory.mktemp(f"lora{nproc}")
        out[nproc] = run_records(nproc, "lora_equivalence.py", tmp / "out.json", str(tiny_models), str(peft_refs_dir),
                                 str(tmp / "out.json"), layouts)
    return out


def _layouts(recs, check):
    return {(r["tp"], r["pp"], r["sp"]) for r in recs if r["check"] == check}


@pytest.mark.parametrize("nproc", sorted(LAUNCHES))
@pytest.mark.parametrize("check", ["policy_logits", "stack_logits", "r3_logits"])
def test_logits_equal_peft(records, nproc, check):
    recs = [r for r in records[nproc] if r["check"] == check]
    assert _layouts(recs, check) == EXPECTED[nproc]
    assert {r["model"] for r in recs} == MODELS
    for r in recs:
        assert r["max_abs_diff"] < LOGITS_TOL, r


@pytest.mark.parametrize("nproc", sorted(LAUNCHES))
def test_gradients_equal_peft(records, nproc):
    recs = [r for r in records[nproc] if r["check"] == "grads"]
    assert _layouts(recs, "grads") == EXPECTED[nproc] and {r["model"] for r in recs} == MODELS
    for r in recs:
        assert not r["missing"] and not r["extra"], r
        assert r["max_rel"] < GRAD_REL_TOL, r


@pytest.mark.parametrize("nproc", sorted(LAUNCHES))
def test_base_never_requires_or_holds_grad(records, nproc):
    recs = [r for r in records[nproc] if r["check"] == "base_frozen"]
    assert len(recs) == nproc * len(MODELS) * len(EXPECTED[nproc])
    assert all(not r["offenders"] for r in recs), [r for r in recs if r["offenders"]]


@pytest.mark.parametrize("nproc", [2, 4])
def test_lora_adds_no_collectives(records, nproc):
    recs = [r for r in records[nproc] if r["check"] == "collectives"]
    assert len(recs) == nproc * len(MODELS) * len(EXPECTED[nproc])
    for r in recs:
        assert r["base"], r  # the base alone does communicate at these layouts
        assert r["lora"] == r["base"], r
        assert r["dropout"] == r["base"], r  # per-projection dropout masks add no collective either
    sp = [r for r in recs if r["sp"]]
    if sp:
        assert all("reduce_scatter_tensor" in r["lora"] and "all_reduce" not in r["lora"] for r in sp)


def _by_layout(records, check: str, model: str) -> dict:
    recs = [r for rs in records.values() for r in rs if r["check"] == check and r["model"] == model]
    return {(r["tp"], r["pp"], r["sp"]): r for r in recs}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_fresh_adapter_init_is_mesh_independent(records, model):
    # add_adapter(init_method="gaussian") gathered to PEFT layout: bit-identical on every mesh
    recs = _by_layout(records, "fresh_init", model)
    assert set(recs) == set().union(*EXPECTED.values())
    ref = torch.load(recs[(1, 1, False)]["file"])
    assert len(ref) == 2 * 7 * 4 and all(t.shape[0] == 3 or t.shape[1] == 3 for t in ref.values())
    for layout, r in recs.items():
        got = torch.load(r["file"])
        assert set(got) == set(ref), layout
        assert all(torch.equal(got[k], ref[k]) for k in ref), layout


@pytest.mark.parametrize("model", sorted(MODELS))
def test_dropout_is_mesh_independent(records, model, peft_refs_dir):
    recs = _by_layout(records, "dropout", model)
    assert set(recs) == set().union(*EXPECTED.values())
    assert all(r["calls"] == [2] for r in recs.values())  # two micro-batches: two mask draws per branch
    ref = torch.load(recs[(1, 1, False)]["file"])
    # dropout really acted: without it the two identical micro-batches give twice the PEFT gradient
    no_dropout = torch.load(peft_refs_dir / model / "refs.pt")["policy_grads"]
    assert set(ref["grads"]) == set(no_dropout)
    assert all(((ref["grads"][k] - 2 * g).norm() / (2 * g).norm()).item() > 1e-2 for k, g in no_dropout.items())
    for layout, r in recs.items():
        got = torch.load(r["file"])
        assert abs(got["loss"] - ref["loss"]) <= DROPOUT_TOL * abs(ref["loss"]), (layout, got["loss"], ref["loss"])
        assert set(got["grads"]) == set(ref["grads"]), layout
        rel = {k: ((got["grads"][k] - g).norm() / g.norm()).item() for k, g in ref["grads"].items()}
        assert max(rel.values()) < DROPOUT_TOL, (layout, max(rel, key=rel.get), max(rel.values()))


def test_recompute_equals_none_at_tp2_pp2(records):
    """Activation recompute (selective core_attn+mlp, full uniform, full block) at TP2xPP2 with and
    without SP, LoRA dropout 0.3, two micro-batches through megatron's 1F1B schedule: loss and every
    gradient equal recompute none's at the same layout (float32, 1e-6), and the recompute ran (a
    recomputed layer or core attention runs twice per micro-batch: 4 calls; full block recomputes the
    first of each stage's 2 layers: 3 on average)."""
    recs = [r for r in records[4] if r["check"] == "recompute"]
    assert {(r["setting"], r["sp"]) for r in recs} == {(s, sp) for s in ("selective", "full_uniform", "full_block")
                                                       for sp in (False, True)}
    for r in recs:
        assert not r["missing"], r
        assert r["loss_diff"] <= 1e-6 and r["max_abs"] <= 1e-6 and r["max_rel"] <= 1e-6, r
    calls = {"selective": {"layer": 2, "core_attn": 4}, "full_uniform": {"layer": 4, "core_attn": 4},
             "full_block": {"layer": 3, "core_attn": 3}}
    runs = [r for r in records[4] if r["check"] == "recompute_calls"]
    assert len(runs) == 4 * 2 * 3  # every rank, both layouts, three settings
    for r in runs:
        assert r["per_layer"] == calls[r["setting"]], r
