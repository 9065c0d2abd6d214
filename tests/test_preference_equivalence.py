"""SFT, reward-model and DPO stages against implementations no one here wrote, on the same tiny Llama,
LoRA factors, head and batch (TRL's own collated batches):

- DPO (sigmoid and IPO): TRL's DPOTrainer with an explicit frozen copy of the base as reference (TRL's
  default) vs mlora with the reference = the same base with the adapter off: loss, ``rewards/chosen``,
  ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/*`` and the LoRA gradients;
- reward model: TRL's RewardTrainer on a PEFT SEQ_CLS model (``score`` head) vs mlora's ``reward``
  adapter + bias-free head loaded from that PEFT directory: loss, accuracy, margin, gradients;
- SFT: transformers' causal-LM loss (prompt labels -100) on a PEFT model: loss and gradients.

At TP1 in this process, and at TP2×PP2 and TP1×DP4 in one 4-rank torchrun launch.
Tolerance: 1e-5 × max(1, |reference|) for scalars; 1e-5 × max(1, max |gradient|) for gradients (float32).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import TESTS, torchrun

sys.path.insert(0, str(TESTS / "dist"))

TOL = 1e-5
STAGES = ("dpo_sigmoid", "dpo_ipo", "rm", "sft")
METRICS = {"dpo_sigmoid": ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                           "logps/chosen", "logps/rejected"),
           "dpo_ipo": ("rewards/chosen", "rewards/rejected", "rewards/margins"),
           "rm": ("accuracy", "margin"), "sft": ()}


@pytest.fixture(scope="module")
def refs_dir(tiny_models, tmp_path_factory) -> Path:
    from preference_refs import build_preference_refs

    return build_preference_refs(tiny_models / "llama", tmp_path_factory.mktemp("preference_refs"))


@pytest.fixture(scope="module")
def refs(refs_dir) -> dict:
    return torch.load(refs_dir / "refs.pt")


def _check(ref: dict, got: dict, stage: str, where: str) -> None:
    loss, want = got["metrics"]["loss"], ref["loss"]
    assert abs(loss - want) <= TOL * max(1.0, abs(want)), (where, stage, "loss", loss, want)
    for k in METRICS[stage]:
        a, b = got["metrics"][k], ref["metrics"][k]
        assert abs(a - b) <= TOL * max(1.0, abs(b)), (where, stage, k, a, b)
    assert set(got["grads"]) == set(ref["grads"]), (where, stage, sorted(set(got["grads"]) ^ set(ref["grads"]))[:6])
    scale = max(1.0, max(g.abs().max().item() for g in ref["grads"].values()))
    worst = max((got["grads"][k] - g).abs().max().item() for k, g in ref["grads"].items())
    assert worst <= TOL * scale, (where, stage, "grads", worst)
    assert max(g.abs().max().item() for g in ref["grads"].values()) > 1e-3  # a real gradient, not zeros


def test_references_are_not_trivial(refs):
    """The batch exercises what it should: log-ratios away from 0, both outcomes of a pair, padding."""
    dpo = refs["dpo_sigmoid"]
    assert abs(dpo["metrics"]["rewards/chosen"]) > 1e-2 and abs(dpo["metrics"]["rewards/rejected"]) > 1e-2
    assert 0 < dpo["metrics"]["rewards/accuracies"] < 1
    assert (dpo["batch"]["attention_mask"] == 0).any()
    assert refs["rm"]["metrics"]["accuracy"] not in (0.0, 1.0) or refs["rm"]["loss"] > 0.1


def test_tokenization_matches_trl(refs, tiny_models):
    """mlora's pair tokenisation (prompt / response split, EOS) gives TRL DPOTrainer's collated batch."""
    from preference_refs import PAIRS
    from transformers import AutoTokenizer

    from mlora.train.preference_data import collate, tokenize_example

    tok = AutoTokenizer.from_pretrained(str(tiny_models / "llama"))
    examples = [tokenize_example(tok, p["prompt"], (p["chosen"], p["rejected"]), "test") for p in PAIRS]
    batch = collate(examples, tok.pad_token_id, pairs=True)
    trl = refs["dpo_sigmoid"]["batch"]
    assert batch.input_ids.shape == trl["input_ids"].shape

    def pairs(ids, attn, resp):  # TRL's loader shuffles: compare the set of pairs
        n = ids.shape[0] // 2
        rows = [tuple(torch.cat([ids[i], attn[i], resp[i]]).tolist()) for i in range(2 * n)]
        return sorted(zip(rows[:n], rows[n:]))

    assert pairs(batch.input_ids, batch.attention_mask, batch.response_mask) == pairs(
        trl["input_ids"], trl["attention_mask"], trl["completion_mask"])


@pytest.mark.parametrize("stage", STAGES)
def test_tp1_matches_trl(model, refs_dir, refs, stage):
    from preference_equivalence import run_stages

    got = run_stages(model, refs_dir, refs)
    _check(refs[stage], got[stage], stage, "tp1")


@pytest.fixture(scope="module")
def multi_rank(tiny_models, refs_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("preference_dist")
    torchrun(4, "preference_equivalence.py", str(tiny_models / "llama"), str(refs_dir), str(out), "2,2;1,1")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2pp2dp1", "tp1pp1dp4"])
def test_multi_rank_matches_trl(multi_rank, refs, layout):
    got = torch.load(multi_rank / f"{layout}.pt")
    for stage in STAGES:
        _check(refs[stage], got[stage], stage, layout)
