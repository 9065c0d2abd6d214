"""Vocab-parallel log-probs and entropy at TP 2 == full vocabulary within 1e-5, without gathering it."""

from __future__ import annotations

from conftest import run_records

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
