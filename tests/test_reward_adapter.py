"""Reward adapters on disk (mlora.export.reward_adapter): mlora's LoRA + scalar head saved as a PEFT
SEQ_CLS adapter score like transformers' ``AutoModelForSequenceClassification`` + PEFT, load back into
mlora bit-identically, and bad files fail with errors that name the problem (tiny Llama, TP1, float32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mlora.export.reward_adapter import last_token_scores

pytestmark = pytest.mark.quick

TOL = 1e-5  # float32
LENGTHS = (9, 6, 12, 3)


@torch.no_grad()
def score_sequences(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    adapters: tuple[str, ...] = ("reward",), head_name: str = "reward") -> torch.Tensor | None:
    """Scores ``[b]`` of whole sequences under ``adapters`` and head ``head_name``: one forward-only pass
    in eval mode, the scores on the last stage (what the PPO engine's ``reward_scores`` computes in
    micro-batches over DP)."""
    head = model.heads[head_name] if model.mesh.is_last_stage else None

    def fn(hidden, mb):
        return torch.zeros(()), {"out": last_token_scores(head, hidden, mb.get("attention_mask"))}

    training = model.training
    model.eval()
    try:
        with model.use_adapters(*adapters):
            outs = model.forward_backward([{"input_ids": input_ids, "attention_mask": attention_mask}], fn,
                                          forward_only=True, hidden_states=True)
    finally:
        model.train(training)
    return None if outs is None else outs[0]["out"].cpu()


@pytest.fixture
def reward_model(model):
    """The tiny Llama with a random ``rm`` adapter (B ≠ 0) and a bias-free head ``rm``; heads are
    removed afterwards (the ``model`` fixture removes adapters only)."""
    from mlora.lora.config import LoraConfig

    model.add_adapter("rm", LoraConfig(rank=4, alpha=8, seed=3))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.adapter_parameters("rm"):
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.add_value_head("rm", init_std=0.3, seed=2, bias=False)
    yield model
    for name in list(model.heads):
        del model.heads[name]


def _batch(model):
    from mlora.testing import right_padded_batch

    ids, mask = right_padded_batch(model.spec.vocab_size, LENGTHS, seed=11)
    pad = json.loads((model.hf_dir / "config.json").read_text())["pad_token_id"]
    ids[(ids == pad) & mask.bool()] = pad + 1  # HF finds the last token by the pad id: no real token may be one
    return ids, mask


def _hf_scores(base_dir: Path, adapter_dir: Path, ids, mask) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(str(base_dir), num_labels=1, dtype=torch.float32)
    assert hf.config.pad_token_id is not None  # HF finds the last non-pad token by the pad id
    peft_model = PeftModel.from_pretrained(hf, str(adapter_dir)).eval()
    # padding ids are 0 in the batch; HF locates the last token by pad id, so pad with the pad id
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, hf.config.pad_token_id))
    assert not bool(((ids == hf.config.pad_token_id) & mask.bool()).any())  # no real token equals the pad id
    with torch.no_grad():
        return peft_model(input_ids=ids, attention_mask=mask).logits[:, 0].float()


def test_peft_seq_cls_scores_equal_mlora(reward_model, tiny_models, tmp_path):
    from mlora.export.reward_adapter import SCORE_TENSOR, save_reward_adapter

    ids, mask = _batch(reward_model)
    mine = score_sequences(reward_model, ids, mask, ("rm",), "rm")
    out = save_reward_adapter(reward_model, "rm", "rm", tmp_path / "rm")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"] and config["r"] == 4
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert tuple(tensors[SCORE_TENSOR].shape) == (1, reward_model.spec.hidden_size)
    ref = _hf_scores(tiny_models / "llama", out, ids, mask)
    assert mine.abs().max() > 0.05  # the head and adapter are not trivial
    assert (mine - ref).abs().max().item() < TOL, (mine, ref)


def test_round_trip_is_bit_identical(reward_model, tmp_path):
    from mlora.export.reward_adapter import load_reward_adapter, save_reward_adapter

    ids, mask = _batch(reward_model)
    first = save_reward_adapter(reward_model, "rm", "rm", tmp_path / "a")
    load_reward_adapter(reward_model, first, adapter_name="rm2", head_name="rm2")
    assert not reward_model.heads["rm2"].weight.requires_grad
    assert not any(p.requires_grad for p in reward_model.adapter_parameters("rm2"))
    assert torch.equal(score_sequences(reward_model, ids, mask, ("rm",), "rm"),
                       score_sequences(reward_model, ids, mask, ("rm2",), "rm2"))
    again = save_reward_adapter(reward_model, "rm2", "rm2", tmp_path / "b")
    for file in ("adapter_model.safetensors", "adapter_config.json"):
        assert (first / file).read_bytes() == (again / file).read_bytes(), file


def _edit(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    tensors = load_file(str(src / "adapter_model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "adapter_model.safetensors"), metadata={"format": "pt"})
    (dst / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    return dst


def test_bad_reward_adapters(reward_model, tmp_path):
    from mlora.export.reward_adapter import SCORE_TENSOR, load_reward_adapter, save_reward_adapter
    from mlora.formats.checkpoint_reader import CheckpointError

    good = save_reward_adapter(reward_model, "rm", "rm", tmp_path / "good")
    hidden = reward_model.spec.hidden_size

    wide = _edit(good, tmp_path / "wide", lambda t: t.update({SCORE_TENSOR: torch.zeros(1, hidden + 8)}))
    with pytest.raises(CheckpointError, match=rf"head width {hidden + 8}.*hidden size {hidden}"):
        load_reward_adapter(reward_model, wide)
    no_head = _edit(good, tmp_path / "no_head", lambda t: t.pop(SCORE_TENSOR))
    with pytest.raises(CheckpointError, match="scalar head is missing"):
        load_reward_adapter(reward_model, no_head)

    def other_base(t):  # an adapter trained on a wider base: every factor's input width differs
        for name in [n for n in t if n.endswith("q_proj.lora_A.weight")]:
            t[name] = torch.zeros(t[name].shape[0], hidden * 2)
    other = _edit(good, tmp_path / "other", other_base)
    with pytest.raises(CheckpointError, match="another base"):
        load_reward_adapter(reward_model, other)
    # a plain causal-LM adapter is not a reward adapter
    reward_model.save_adapter("rm", tmp_path / "plain")
    with pytest.raises(ValueError, match="task_type='CAUSAL_LM'.*SEQ_CLS"):
        load_reward_adapter(reward_model, tmp_path / "plain")
    # nothing was created by the failed loads
    assert set(reward_model.adapters) == {"rm"} and set(reward_model.heads) == {"rm"}

    # a head whose bias moved off zero has no HF score equivalent
    reward_model.add_value_head("biased")
    with torch.no_grad():
        reward_model.heads["biased"].bias.fill_(0.5)
    with pytest.raises(ValueError, match="non-zero bias"):
        save_reward_adapter(reward_model, "rm", "biased", tmp_path / "biased")
    with pytest.raises(ValueError, match="no scalar head named 'nope'"):
        save_reward_adapter(reward_model, "rm", "nope", tmp_path / "nope")
