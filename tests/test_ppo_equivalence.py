"""One PPO update (actor + critic, 2 mini-batches of 2 micro-batches) and one GRPO update at
(TP, PP, DP) = (2,2,1) and (1,2,2) equal (1,1,1): losses, grad norms, updated adapters (PEFT layout)
and value head, within 1e-5; at sampling temperature 0.8 with top-k/top-p, so the tempered log-probs
and the truncated ones of the rollout gap metric are compared across layouts too. Two torchrun
launches (1 and 4 ranks)."""

from __future__ import annotations

import pytest
import torch
from conftest import torchrun

pytestmark = pytest.mark.quick

TOL = 1e-5
LAYOUTS = ["tp2pp2dp1", "tp1pp2dp2"]


@pytest.fixture(scope="module")
def results(tiny_models, peft_refs_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo")
    args = [str(tiny_models / "llama"), str(peft_refs_dir / "llama" / "policy"), str(out)]
    torchrun(1, "ppo_equivalence.py", *args, "1,1", "gae,grpo")
    torchrun(4, "ppo_equivalence.py", *args, "2,2;1,2", "gae,grpo")
    return out


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_update_matches_single_process(results, estimator, layout):
    ref = torch.load(results / f"{estimator}_tp1pp1dp1.pt")
    got = torch.load(results / f"{estimator}_{layout}.pt")
    parts = ["actor/per_minibatch"] + (["critic/per_minibatch"] if estimator == "gae" else [])
    for part in parts:
        assert len(ref["metrics"][part]) == len(got["metrics"][part]) == 2  # two mini-batches
        for a, b in zip(ref["metrics"][part], got["metrics"][part]):
            assert set(a) == set(b)
            for k in a:  # losses, grad norms, entropy, lr ...
                assert abs(a[k] - b[k]) <= TOL * max(1.0, abs(a[k])), (part, k, a[k], b[k])
    names = ["policy"] + (["critic", "head"] if estimator == "gae" else [])
    for name in names:
        assert set(ref[name]) == set(got[name]), name
        for k in ref[name]:
            assert (ref[name][k] - got[name][k]).abs().max().item() <= TOL, (name, k)
    for k in ("rollout/logprob_abs_diff", "rollout/logprob_abs_diff_max", "kl/mean"):
        assert abs(ref["metrics"][k] - got["metrics"][k]) <= TOL * max(1.0, abs(ref["metrics"][k])), k
    # the update did something
    assert ref["metrics"]["actor/per_minibatch"][0]["grad_norm"] > 0
    if estimator == "grpo":
        assert "critic" not in got and not any(k.startswith("critic/") for k in got["metrics"])
