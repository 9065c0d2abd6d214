"""mlora logits == transformers logits and == the old unfused attention path at every layout;
HF -> mlora -> HF round trip; per-rank reads.

Three grouped torchrun launches (1, 2 and 4 CPU ranks) cover (TP, PP, DP) = (1,1,1), (2,1,1),
(2,1,1)+SP, (1,2,1), (1,1,2) and (2,2,1) for tiny Llama (llama3 RoPE scaling, sharded
checkpoint), Qwen2 (tied embeddings, q/k/v bias) and Mistral (head_dim 64 != hidden/heads,
sliding window shorter than the sequence), with and without sequence parallelism.
Vocabulary 1001: TP 2 pads it; 19-token sequences: SP pads them. Each model runs with the default
fused attention (SDPA) and with ``attention="unfused"`` (megatron's DotProductAttention + full mask)
on a right-padded, an unpadded and a left-padded batch; Mistral's window (8) is shorter than them.
"""

from __future__ import annotations

import pytest
from conftest import run_records

pytestmark = pytest.mark.quick

LOGITS_TOL = 1e-5  # float32: issue 2 asked 1e-4, issue 12 (fused attention) 1e-5
LAUNCHES = {
    1: ("1,1", {(1, 1, 1, False)}),
    2: ("2,1;2,1,sp;1,2;1,1", {(2, 1, 1, False), (2, 1, 1, True), (1, 2, 1, False), (1, 1, 2, False)}),
    4: ("2,2;2,2,sp", {(2, 2, 1, False), (2, 2, 1, True)}),
}
MODELS = {"llama", "qwen2", "mistral"}
BATCHES = {"right_pad", "no_pad", "left_pad"}
MAX_READ_FRACTION = 0.35


@pytest.fixture(scope="module")
def records(tiny_models, tmp_path_factory):
    out = {}
    for nproc, (layouts, _) in LAUNCHES.items():
        tmp = tmp_path_factory.mktemp(f"world{nproc}")
        extra = ["--roundtrip", str(tmp / "roundtrip")] if nproc == 4 else []
        out[nproc] = run_records(nproc, "hf_equivalence.py", tmp / "out.json", str(tiny_models), str(tmp / "out.json"),
                                 layouts, *extra)
    return out


@pytest.mark.parametrize("nproc", sorted(LAUNCHES))
def test_logits_equal_hf(records, nproc):
    logits = [r for r in records[nproc] if r["check"] == "logits"]
    seen = {(r["tp"], r["pp"], r["dp"], r["sp"]) for r in logits}
    assert seen == LAUNCHES[nproc][1]
    assert {r["model"] for r in logits} == MODELS and {r["batch"] for r in logits} == BATCHES
    for r in logits:
        assert r["shape"] == r["ref_shape"] and r["shape"][-1] == 1001, r
        assert r["max_abs_diff"] < LOGITS_TOL, r  # fused attention vs transformers
        assert r["sdpa_vs_unfused"] < LOGITS_TOL and r["unfused_max_abs_diff"] < LOGITS_TOL, r  # vs today's path
    # every last-stage rank reports (DP ranks see different batches)
    for tp, pp, dp, sp in LAUNCHES[nproc][1]:
        n = sum(1 for r in logits if (r["tp"], r["pp"], r["dp"], r["sp"]) == (tp, pp, dp, sp))
        assert n == len(MODELS) * len(BATCHES) * tp * dp


@pytest.mark.parametrize("nproc", sorted(LAUNCHES))
def test_fused_attention_masks_are_minimal(records, nproc):
    """At every layout: no mask for unpadded and right-padded batches without a window; Mistral's
    window (shorter than the sequence) one [1, 1, s, s] mask; left padding the full [b, 1, s, s]."""
    for r in (r for r in records[nproc] if r["check"] == "logits"):
        s = r["seq"] + ((-r["seq"]) % r["tp"] if r["sp"] else 0)  # SP pads the sequence to a multiple of TP
        if r["batch"] == "left_pad":
            assert r["sdpa_mask_shape"] == [3, 1, s, s], r
        elif r["model"] == "mistral":
            assert r["sliding_window"] < r["seq"] and r["sdpa_mask_shape"] == [1, 1, s, s], r
        else:
            assert r["sdpa_mask_shape"] is None, r


def test_roundtrip_bit_identical(records):
    rt = [r for r in records[4] if r["check"] == "roundtrip"]
    assert {r["model"] for r in rt} == MODELS
    for r in rt:
        assert r["same_names"] and r["bit_identical"], r
        assert "model.safetensors.index.json" in r["files"] and "tokenizer.json" in r["files"], r


def test_each_rank_reads_only_its_shard(records):
    reads = [r for r in records[4] if r["check"] == "bytes_read"]
    assert len(reads) == 4 * len(MODELS)
    for r in reads:
        assert r["bytes_read"] == r["own_param_bytes"], r  # exactly its slices, nothing else
        assert r["bytes_read"] <= MAX_READ_FRACTION * r["checkpoint_bytes"], r
