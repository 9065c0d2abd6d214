"""MoE adapters that PEFT 0.21 on transformers 5 cannot load are refused when saved, by PEFT's own verdict.

For each target set, on the tiny Mixtral and OLMoE (every layer a MoE layer) and GLM-4.5 (shared experts, a
sigmoid router, a dense first layer left out of its cases: mlora warns that PEFT drops a dense MLP's LoRA on a
MoE model): the adapter with random factors is
written the way mlora writes any adapter (the check bypassed on this instance), then loaded by PEFT itself over
transformers' model of the same checkpoint. Where PEFT refuses it or its logits differ from mlora's, mlora's
``save_adapter`` must refuse it with what PEFT requires, and so must the trainer before its first step; where
PEFT's logits equal mlora's (float32, 1e-5 relative), mlora must save it without a word.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import mlora
from mlora.lora.config import LoraConfig
from mlora.testing import right_padded_batch

pytestmark = pytest.mark.quick
TOL = 1e-5

# name -> (targets with Qwen-style expert names, what mlora's refusal says; None: PEFT loads it and mlora saves it)
CASES = {
    "gate_alone": (["q_proj", "gate_proj"], r"experts' (gate_proj|w1) without (up_proj|w3) \(layers \[0, 1, 2, 3\]\): "
                                            r"PEFT fuses them"),
    "gate_up_without_down": (["gate_proj", "up_proj"], r"without (down_proj|w2) \(layers \[0, 1, 2, 3\]\): PEFT 0\.21"),
    "one_expert": (["layers.0.mlp.experts.1.gate_proj", "layers.0.mlp.experts.1.up_proj",
                    "layers.0.mlp.experts.1.down_proj"], r"(down_proj|w2) of experts \[1\] in layer 0 but not of all 8"),
    "down_alone": (["down_proj"], None),
    "all_linear": (["all-linear"], None),
    "attention": (["q_proj", "v_proj"], None),
}
# GLM-4.5 (layer 0 dense): its shared experts' LoRA PEFT maps onto the routed experts; its sigmoid router's it loads
DENSE = ["layers.0.mlp.gate_proj", "layers.0.mlp.up_proj", "layers.0.mlp.down_proj"]
SHARED = ["shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"]
GLM_CASES = {
    "shared_experts": (["q_proj", *SHARED], r"the shared_experts' projections \(layers \[1, 2, 3\]\): PEFT 0\.21 maps"),
    "all_linear_and_shared": (["all-linear"], r"shared_experts' projections"),
    "routed_router_attention": ((["all-linear", "gate"], DENSE + SHARED), None),
    "router": (["q_proj", "gate"], None),
}
MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "mlp.": "block_sparse_moe."}


def _targets(arch: str, targets: list[str]) -> list[str]:
    if arch != "mixtral":
        return targets
    out = []
    for t in targets:
        if t != "all-linear" and not t.startswith(("q_", "v_")):
            for qwen, mixtral in MIXTRAL_NAMES.items():
                t = t.replace(qwen, mixtral)
        out.append(t)
    return out


def _peft_logits(model_dir, adapter_dir, ids, mask):
    """PEFT's logits of the adapter, or the exception PEFT raised loading it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    except (ValueError, RuntimeError) as exc:
        return exc
    with torch.no_grad():
        return peft(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("arch", ["mixtral", "olmoe", "glm4_moe"])
def test_saved_moe_adapters_load_in_peft_or_are_refused(tiny_models, tmp_path, arch):
    model = mlora.from_pretrained(tiny_models / arch, mlora.init_parallel(tp=1, pp=1))
    ids, mask = right_padded_batch(model.spec.vocab_size, (7, 5), seed=2)
    verdicts = {}
    cases = GLM_CASES if arch == "glm4_moe" else CASES
    for name, (targets, refusal) in cases.items():
        targets, exclude = targets if isinstance(targets, tuple) else (targets, None)
        model.add_adapter(name, LoraConfig(rank=2, alpha=4, seed=1, target_modules=_targets(arch, targets),
                                           exclude_modules=exclude))
        with torch.no_grad():
            for p in model.adapter_parameters(name):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
        with model.use_adapters(name), torch.no_grad():
            mine = model.logits(ids, attention_mask=mask)
        if refusal is None:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # not a word
                model.save_adapter(name, tmp_path / name)
        else:
            with pytest.raises(ValueError, match=refusal), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # all-linear on GLM-4.5: its dense layer's MLP too
                model.save_adapter(name, tmp_path / name)
            assert not (tmp_path / name).exists()
            model.require_peft_loadable = lambda _name: None  # write it anyway, for PEFT's verdict
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model.save_adapter(name, tmp_path / name)
            del model.require_peft_loadable
        peft = _peft_logits(tiny_models / arch, tmp_path / name, ids, mask)
        loads = not isinstance(peft, Exception) and bool(
            ((peft - mine)[mask.bool()].abs().max() <= TOL * mine.abs().max()).item())
        verdicts[name] = loads
    assert verdicts == {name: refusal is None for name, (_, refusal) in cases.items()}, verdicts


def test_the_trainer_refuses_before_training(tiny_models):
    from mlora.train.preference_engine import PreferenceConfig, PreferenceEngine

    model = mlora.from_pretrained(tiny_models / "olmoe", mlora.init_parallel(tp=1, pp=1))
    with pytest.raises(ValueError, match=r"adapter 'policy' cannot be written in PEFT's format for OlmoeForCausalLM: "
                                         r"the experts' gate_proj without up_proj"):
        PreferenceEngine(model, PreferenceConfig(stage="sft"), lora=LoraConfig(target_modules=["gate_proj"]))
