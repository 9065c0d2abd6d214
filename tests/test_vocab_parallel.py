"""Vocab-parallel log-probs and entropy at TP 2 == full vocabulary within 1e-5, without gathering it (one target per
position, and K of them: a teacher's top-K); also
at a sampling temperature, and the log-probs of vLLM's min-p / top-k / top-p distribution vs vLLM's rule
(sort, cumsum, mask) on the whole vocabulary; rollout correction (TIS, masks, rollout_is) on those log-probs, loss and gradient."""

from __future__ import annotations

import pytest
from conftest import run_records

pytestmark = pytest.mark.quick

TOL = 1e-5


def test_vocab_parallel_logprobs_entropy(tmp_path):
    out = tmp_path / "vp.json"
    recs = run_records(2, "vocab_parallel.py", out, str(out))
    assert len(recs) == 2
    for r in recs:
        assert r["lp"] < TOL and r["ent"] < TOL and r["grad"] < TOL, r
        ops = r["collectives"]
        assert not any("gather" in op for op in ops), ops  # no all-gather of the vocabulary
        assert set(ops) == {"all_reduce"} and ops["all_reduce"][0] == 2  # max, then the stacked sums
        assert ops["all_reduce"][1] < r["vocab_bytes"] / 50  # a few scalars per token, not the vocabulary
        assert len(r["sampling"]) == 5
        for s in r["sampling"]:
            assert s["lp"] < TOL and s["ent"] < TOL and s["grad"] < TOL and s["sampled"] < TOL, s
            assert s["untempered_gap"] > 0.05, s  # the untempered log-prob is not what was sampled
            assert s["kept_mass"] < 0.999, s  # the filters did cut something
            ops = s["collectives"]
            assert set(ops) == {"all_reduce"}, ops  # per-token scalars only: no gather of the vocabulary
            # bisection: <= 2 x 32 steps + max, sums, kept masses; each a few scalars per token
            assert ops["all_reduce"][0] <= 72 and ops["all_reduce"][1] / ops["all_reduce"][0] < r["vocab_bytes"] / 50
        # K targets per position ([3, 7, 4]): each log-prob and the logits' gradient as the full vocabulary's, with
        # the same two all-reduces (max, then one of every per-token scalar)
        m = r["multi"]
        assert m["shape"] == [3, 7, 4] and m["lp"] < TOL and m["grad"] < TOL, m
        assert m["collectives"]["all_reduce"][0] == 2, m
        # rollout correction (token TIS + outlier mask on PPO, and rollout_is) on TP-2 log-probs == full vocabulary
        for name, c in r["correction"].items():
            assert c["loss"] < TOL and c["grad"] < TOL and c["grad_norm"] > 1e-3 and c["metrics_equal"], (name, c)
            assert 0 < c["clipped"] < 1 and 0 < c["masked"] < 1, (name, c)  # the cap and the mask both acted
