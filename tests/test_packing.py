"""Sequence packing (``trainer.use_sample_packing``): the packed layout by hand, first-fit-decreasing
groups, attention that never crosses a sequence (logits of packed rows equal the padded batch's for Llama,
Qwen2 and Mistral's sliding window), and packed vs padded micro-batches for PPO (actor + critic), GRPO,
SFT, RM and DPO on a batch whose lengths spread 12x: log-probs, values, metrics and LoRA gradients
within 1e-5 relative at TP1, TP2xPP2 and TP2xPP2 with SP and full recompute (one launch of 1 and one of
4 ranks); the configuration's keys and errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import torchrun

import mlora
from mlora.models.packing import PackedRows, balanced_shares, pack_bins
from mlora.testing import right_padded_batch
from mlora.train.micro_batches import Packing, group_units

TOL = 1e-5
sys.path.insert(0, str(Path(__file__).parent / "dist"))


def test_packed_layout_by_hand():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    ids = torch.tensor([[5, 6, 0, 0], [7, 8, 9, 0]])
    p = PackedRows.of(mask).widened(7)  # two rows, then a padding segment of 2
    assert p.lengths == (2, 3) and p.tokens == 5 and p.starts == [0, 2]
    assert p.pack(ids).tolist() == [[5, 6, 7, 8, 9, 0, 0]]
    assert p.positions().tolist() == [[0, 1, 0, 1, 2, 0, 1]]
    assert p.cu_seqlens().tolist() == [0, 2, 5, 7] and p.cu_seqlens().dtype == torch.int32
    params = p.packed_seq_params()
    assert params.qkv_format == "thd" and params.max_seqlen_q == 3
    values = torch.arange(10.0, 17.0)[None]  # one value per packed position
    assert p.unpack(values).tolist() == [[10, 11, 0, 0], [12, 13, 14, 0]]
    # next-token quantities: a row's last position would predict the next row's first token, dropped
    assert p.unpack(values[:, :-1], shift=1).tolist() == [[10, 0, 0], [12, 13, 0]]
    assert p.last_positions().tolist() == [1, 4]
    with pytest.raises(ValueError, match="right-padded"):
        PackedRows.of(torch.tensor([[0, 1, 1]]))
    with pytest.raises(ValueError, match="at least one token"):
        PackedRows.of(torch.tensor([[1, 1], [0, 0]]))


def test_balanced_shares():
    # longest first to the share with the fewest tokens: 9 -> s0, 7 -> s1, 5 -> s1, 4 -> s0, 1 -> s1 (13 and 13)
    assert balanced_shares([5, 9, 1, 7, 4], 2) == [[1, 4], [0, 2, 3]]
    assert balanced_shares([3], 2) == [[0], []]  # fewer rows than shares: one stays empty
    assert balanced_shares([2, 2, 2], 1) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="parts=0 must be >= 1"):
        balanced_shares([1], 0)


def test_first_fit_decreasing_groups():
    # longest first into the first group with room: 5 -> g0, 4 -> g1, 3 -> g2, 2 -> g1, 1 -> g0
    assert pack_bins([5, 1, 4, 3, 2], 6) == [[0, 1], [2, 4], [3]]
    assert pack_bins([3, 3, 3], 9) == [[0, 1, 2]]
    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch=4 is smaller than .* of 5 tokens; valid "
                                         r"budgets are >= 5"):
        pack_bins([5, 1], 4)
    # padded: consecutive counts; packed with the default budget (2 rows x width 48): fewer micro-batches
    tokens = [4, 48, 6, 40, 5, 33, 4, 27]
    assert group_units(tokens, 2, Packing(), 48) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    packed = group_units(tokens, 2, Packing(enabled=True), 48)
    assert sorted(i for g in packed for i in g) == list(range(8)) and len(packed) == 2
    assert all(sum(tokens[i] for i in g) <= 96 for g in packed)
    with pytest.raises(ValueError, match="needs enabled=True"):
        Packing(max_tokens=10)


@pytest.fixture(scope="module")
def mesh1():
    return mlora.init_parallel(tp=1, pp=1)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt_oss"])
def test_packed_logits_equal_padded(tiny_models, mesh1, arch):
    """Rows of 3..30 tokens packed into one row: logits at every token equal the padded batch's (Mistral's
    window of 8 applies inside each sequence, gpt-oss's on every other layer with its sinks; Llama's llama3 RoPE
    restarts per sequence)."""
    model = mlora.from_pretrained(tiny_models / arch, mesh1)
    ids, mask = right_padded_batch(model.spec.vocab_size, (3, 30, 12, 2, 25), seed=0)
    ref = model.logits(ids, mask)
    packed = PackedRows.of(mask)
    out = model.forward_backward([{"input_ids": packed.pack(ids), "packed": packed}], forward_only=True)[0]
    got = packed.unpack(out[..., : model.spec.vocab_size].float())
    token = mask.bool()
    assert (got[token] - ref[token]).abs().max() <= TOL * ref.abs().max()


def test_unfused_attention_refuses_packing(tiny_models, mesh1):
    model = mlora.from_pretrained(tiny_models / "llama", mesh1, attention="unfused")
    ids, mask = right_padded_batch(model.spec.vocab_size, (3, 5), seed=0)
    packed = PackedRows.of(mask)
    with pytest.raises(ValueError, match="sequence packing needs the fused core attention"):
        model.forward_backward([{"input_ids": packed.pack(ids), "packed": packed}], forward_only=True)


@pytest.fixture(scope="module")
def results(tiny_models, peft_refs_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("packing")
    args = [str(tiny_models / "llama"), str(peft_refs_dir / "llama" / "policy"), str(out)]
    torchrun(1, "packing_equivalence.py", *args, "1,1")
    torchrun(4, "packing_equivalence.py", *args, "2,2;2,2,sp:full")
    return out


def _flat(record: dict, stage: str) -> dict[str, torch.Tensor]:
    grads = record[stage]["grads"]
    if stage in ("gae", "grpo"):  # per trained adapter
        return {f"{a}/{n}": t for a, d in grads.items() for n, t in d.items()}
    return grads


def _compare(ref: dict, got: dict) -> float:
    """The largest relative difference over every stage's metrics, log-probs, values and gradients."""
    worst = 0.0
    for stage in ("gae", "grpo", "sft", "dpo", "rm"):
        r, g = ref[stage], got[stage]
        assert set(r["metrics"]) == set(g["metrics"]), stage
        for k, v in r["metrics"].items():
            if not isinstance(v, list):
                worst = max(worst, abs(v - g["metrics"][k]) / max(abs(v), 1.0))
        for key in ("logprobs", "values"):
            if r.get(key) is not None:
                m = r["mask"] > 0
                worst = max(worst, float((r[key][m] - g[key][m]).abs().max() / r[key][m].abs().max()))
        rg, gg = _flat(ref, stage), _flat(got, stage)
        assert set(rg) == set(gg) and rg, stage
        for n in rg:
            assert rg[n].abs().max() > 0, (stage, n)  # every gradient is there and non-zero
            worst = max(worst, float((gg[n] - rg[n]).abs().max() / rg[n].abs().max()))
    return worst


@pytest.mark.parametrize("layout", ["tp1pp1_none", "tp2pp2_none", "tp2pp2sp_full"])
@pytest.mark.parametrize("packing", ["packed", "budget"])
def test_packed_equals_padded(results, layout, packing):
    """Seen: ≤ 3e-6 relative, on each layout and against padded TP1."""
    padded = torch.load(results / f"padded_{layout}.pt")
    got = torch.load(results / f"{packing}_{layout}.pt")
    assert _compare(padded, got) <= TOL
    assert _compare(torch.load(results / "padded_tp1pp1_none.pt"), got) <= TOL


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlora.config.schema import register_schema
    from mlora.train.__main__ import CONFIG_DIR

    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="cpu_demo", overrides=overrides))


def test_config_keys_and_errors():
    from mlora.config.errors import ConfigError
    from mlora.config.validate import finalize
    from mlora.train.from_config import packing, ppo_config
    from mlora.train.preference_stage import preference_config

    cfg = _compose(["trainer.remove_microbatch_padding=true", "trainer.max_tokens_per_microbatch=512"])
    finalize(cfg, world_size=4)
    assert cfg.trainer.use_sample_packing is True
    assert packing(cfg.trainer) == Packing(enabled=True, max_tokens=512)
    assert ppo_config(cfg, 3).packing == Packing(enabled=True, max_tokens=512)
    cfg.preference.stage = "sft"  # SFT, RM and DPO take the same keys
    assert preference_config(cfg, 3).packing == Packing(enabled=True, max_tokens=512)
    cfg = _compose([])
    finalize(cfg, world_size=4)
    assert packing(cfg.trainer) == Packing()
    cases = {
        ("trainer.use_sample_packing=true", "trainer.flash_attn=false"): "needs the fused core attention "
                                                                          r"\(trainer.flash_attn=true\)",
        ("trainer.use_sample_packing=true", "trainer.algorithm.loss_reduction=token_mean_legacy"):
            "token_mean_legacy averages per micro-batch",
        ("trainer.max_tokens_per_microbatch=64",): "max_tokens_per_microbatch=64 sizes packed micro-batches",
        ("trainer.max_tokens_per_microbatch=-3",): "max_tokens_per_microbatch=-3 is not valid",
        ("trainer.use_sample_packing=true", "trainer.remove_microbatch_padding=false"): "disagree",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            finalize(_compose(list(overrides)), world_size=4)
