"""Stacked adapters as one PEFT adapter (mlora.export.stack): PEFT loading the stacked adapter computes what the
stack computes. The reference is PEFT itself: both adapters loaded and active at once (PEFT adds their updates),
on the tiny Llama (logits within 1e-10 of their largest in float64, 1e-4 in float32). Ranks and scalings
differ (r 8 / alpha 16 with rsLoRA off, r 4 / alpha 4 with rsLoRA on), the top adapter targets fewer modules,
and one has a rank_pattern. Bad stacks are refused naming the adapter and the reason."""

from __future__ import annotations

import json

import pytest
import torch

from mlora.export.stack import stack_adapters

# float64: the sum is exact (measured 0.0); float32: the stacked GEMM rounds in another order than two adapters'
# (measured 2.4e-5 of the largest logit, the updates being large: B scaled x20)
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def _adapter(base, out, seed: int, **lora):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(init_lora_weights=False, task_type="CAUSAL_LM", **lora))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(20.0)  # an update large enough to move the logits well beyond the tolerance
    peft.save_pretrained(out)
    return out


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_the_stacked_adapter_is_the_stack(tiny_llama, tmp_path, dtype):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    bottom = _adapter(tiny_llama, tmp_path / "bottom", 1, r=8, lora_alpha=16,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                      rank_pattern={"down_proj": 4})
    top = _adapter(tiny_llama, tmp_path / "top", 2, r=4, lora_alpha=4, use_rslora=True,
                   target_modules=["q_proj", "v_proj", "down_proj"])
    stacked = stack_adapters([bottom, top], tmp_path / "stacked")
    config = json.loads((stacked / "adapter_config.json").read_text())
    # per layer q_proj and v_proj have 8 + 4, k, o, gate and up 8, down_proj 4 + 4: rank 8, the others by pattern
    assert config["lora_alpha"] == config["r"] == 8 and not config["use_rslora"]
    assert set(config["rank_pattern"].values()) == {12} and config["alpha_pattern"] == config["rank_pattern"]
    assert all(k.endswith(("q_proj", "v_proj")) for k in config["rank_pattern"])
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"}

    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=dtype)
    plain = _logits(base, ids)
    both = PeftModel.from_pretrained(base, bottom, adapter_name="bottom")
    both.load_adapter(top, adapter_name="top")
    both.base_model.set_adapter(["bottom", "top"])  # PEFT's own stack: both adapters active, each unmerged
    want = _logits(both, ids)
    got = _logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=dtype), stacked),
                  ids)
    scale = want.abs().max()
    assert (want - plain).abs().max() > 0.1 * scale  # the adapters do move the logits
    assert (got - want).abs().max() <= TOL[dtype] * scale, float((got - want).abs().max() / scale)


def test_bad_stacks_are_refused(tiny_llama, tmp_path):
    one = _adapter(tiny_llama, tmp_path / "one", 1, r=4, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="at least two adapters, got 1"):
        stack_adapters([one], tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="not a PEFT adapter directory"):
        stack_adapters([one, tmp_path], tmp_path / "out")
    dora = _adapter(tiny_llama, tmp_path / "dora", 2, r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(ValueError, match=r"dora: use_dora=True cannot be stacked \(DoRA rescales the merged weight\)"):
        stack_adapters([one, dora], tmp_path / "out")
    other = tmp_path / "other"
    other.mkdir()
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        (other / f).write_bytes((one / f).read_bytes())
    cfg = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**cfg, "task_type": "SEQ_CLS"}))
    with pytest.raises(ValueError, match="task_type='SEQ_CLS', but .* has 'CAUSAL_LM': stacked adapters must be"):
        stack_adapters([one, other], tmp_path / "out")
