"""Planning mode: Llama-3-70B at TP8xPP4, r 32, all linears: names and shapes equal PEFT's (meta device)."""

from __future__ import annotations

import pytest
import torch

from mlora.cli import main as cli
from mlora.export.plan import plan_adapter
from mlora.formats.hf_config import load_hf_config, model_spec
from mlora.lora.config import LoraConfig

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}, rms_norm_eps=1e-5)
    cfg.architectures = ["LlamaForCausalLM"]
    d = tmp_path_factory.mktemp("llama70b")
    cfg.save_pretrained(str(d))
    return d


def test_plan_equals_peft_on_meta(llama70b):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(llama70b)))
    peft_model = get_peft_model(hf, PeftLoraConfig(r=32, lora_alpha=64, target_modules="all-linear"))
    expected = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(peft_model).items()}

    plan = plan_adapter(model_spec(load_hf_config(llama70b)), tp=8, pp=4, lora=LoraConfig(rank=32, alpha=64))
    assert plan.tensors == expected
    assert len(plan.tensors) == 80 * 7 * 2
    # r 32 on every linear of Llama-3-70B: 80 x 5,177,344 = 414,187,520 parameters
    assert plan.num_parameters == sum(torch.Size(s).numel() for s in expected.values()) == 414_187_520
    assert len(plan.rank_bytes) == 32 and max(plan.rank_bytes.values()) < plan.total_bytes / 4


def test_plan_cli_prints_size(llama70b, capsys):
    assert cli(["plan", "--model", str(llama70b), "--tp", "8", "--pp", "4", "--rank", "32"]) == 0
    out = capsys.readouterr().out
    assert "1120 tensors" in out and "414,187,520 parameters" in out and "790.0 MiB in bfloat16" in out


def test_plan_rejects_bad_layout(llama70b, capsys):
    assert cli(["plan", "--model", str(llama70b), "--tp", "16", "--pp", "4"]) == 2
    assert "tp=16 does not divide num_key_value_heads=8" in capsys.readouterr().err
