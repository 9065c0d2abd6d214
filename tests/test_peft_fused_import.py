"""Adapters PEFT trains on transformers 5's stacked experts (``target_parameters``) load into mlora exactly.

PEFT 0.21 itself wraps the tiny MoE model of transformers 5 (Qwen3-MoE: a dense layer among the MoE ones; Mixtral:
``block_sparse_moe`` in its checkpoint, ``mlp`` in transformers 5) with ``LoraConfig(target_parameters=[...])`` on
``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj`` beside ``target_modules`` on the attention (and Mixtral's
router as a parameter), random factors replace PEFT's init (its lora_B starts at zero), and PEFT's own
``save_pretrained`` writes the adapter. mlora's ``load_adapter`` must give PEFT's logits (float32, ``TOL`` relative to
the largest logit) and the adapter must move them; ``load_adapter_weights`` must too. The same for a base saved by
transformers 5 with ``save_original_format=False`` (stacked expert tensors in the safetensors), which must load
exactly as the original-format checkpoint. Bad files are refused naming the bad value.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import mlora
from mlora.formats.checkpoint_reader import CheckpointError
from mlora.testing import right_padded_batch

pytestmark = pytest.mark.quick
TOL = 1e-5  # float32: mlora's logits vs PEFT's, relative to the largest |logit|
EFFECT = 1e-2  # the adapter must move some logit by more than this, relative to the largest |logit|
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def batch():
    from mlora.testing.tiny_models import VOCAB_SIZE

    return right_padded_batch(VOCAB_SIZE, (7, 5), seed=2)


@pytest.fixture(scope="module")
def bases(tiny_models):
    """One mlora model per family, loaded once; adapters are deleted by the tests that add them."""
    mesh = mlora.init_parallel(tp=1, pp=1)
    return {arch: mlora.from_pretrained(tiny_models / arch, mesh) for arch in ("qwen3_moe", "mixtral")}


def _peft_adapter(base_dir, out, batch, seed: int = 0, **config) -> torch.Tensor:
    """Wrap transformers' model of ``base_dir`` with PEFT (``config``: LoraConfig arguments, PEFT's defaults for
    the rest), give every factor random values, save it with PEFT into ``out``; returns PEFT's logits."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft = get_peft_model(hf, LoraConfig(**config)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.03)
        logits = peft(input_ids=batch[0], attention_mask=batch[1]).logits
    peft.save_pretrained(str(out))
    return logits


def _mlora_logits(model, batch, *adapters) -> torch.Tensor:
    with model.use_adapters(*adapters), torch.no_grad():
        return model.logits(batch[0], attention_mask=batch[1])


def _relative_gap(mine: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    keep = mask.bool()
    return ((mine - ref)[keep].abs().max() / ref[keep].abs().max()).item()


CASES = {
    # attention by module, experts by parameter, PEFT's defaults otherwise (r=8, lora_alpha=8)
    "qwen3_moe_mixed": ("qwen3_moe", dict(target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS)),
    # Mixtral's router as transformers 5 names it (mlp.gate, block_sparse_moe.gate in its checkpoint)
    "mixtral_mixed_router": ("mixtral", dict(target_modules=["q_proj", "o_proj"],
                                             target_parameters=[*EXPERTS, "mlp.gate.weight"])),
    # gate_up_proj alone, at rslora scaling
    "qwen3_moe_gate_up_rslora": ("qwen3_moe", dict(r=4, lora_alpha=16, use_rslora=True,
                                                   target_parameters=["mlp.experts.gate_up_proj"])),
    # the two stacked parameters at other ranks and alphas (as PEFT writes after converting per-expert files):
    # mlora takes the larger rank, pads the other, and scales B to PEFT's s·B·A
    "qwen3_moe_patterns": ("qwen3_moe", dict(r=4, lora_alpha=8, target_modules=["k_proj"], target_parameters=EXPERTS,
                                             rank_pattern={"gate_up_proj": 8}, alpha_pattern={"gate_up_proj": 32})),
}


@pytest.mark.parametrize("case", CASES)
def test_peft_stacked_expert_adapter_loads_exactly(tiny_models, bases, batch, tmp_path, case):
    arch, config = CASES[case]
    model = bases[arch]
    peft_logits = _peft_adapter(tiny_models / arch, tmp_path, batch, **config)
    model.load_adapter(case, tmp_path)
    try:
        mine, base = _mlora_logits(model, batch, case), _mlora_logits(model, batch)
        gap, effect = _relative_gap(mine, peft_logits, batch[1]), _relative_gap(base, peft_logits, batch[1])
        print(f"{case}: max |mlora - PEFT| / max |logit| = {gap:.2e}; the adapter moves logits by {effect:.2e}")
        assert gap <= TOL, gap
        assert effect > EFFECT, effect  # the adapter is applied, not only loaded
        experts = [p for layer, p in model.adapters[case].modules if ".experts." in p]
        assert len(experts) == len(model.spec.sparse_layers) * 8 * (3 if "gate_up" not in case else 2)
    finally:
        model.delete_adapter(case)


def test_load_adapter_weights_reads_stacked_experts(tiny_models, bases, batch, tmp_path):
    model = bases["qwen3_moe"]
    _, config = CASES["qwen3_moe_mixed"]
    _peft_adapter(tiny_models / "qwen3_moe", tmp_path / "first", batch, seed=1, **config)
    second = _peft_adapter(tiny_models / "qwen3_moe", tmp_path / "second", batch, seed=2, **config)
    model.load_adapter("resumed", tmp_path / "first", trainable=True)
    try:
        params = model.adapter_parameters("resumed")
        model.load_adapter_weights("resumed", tmp_path / "second")
        assert all(p is q for p, q in zip(params, model.adapter_parameters("resumed")))  # the same objects
        assert _relative_gap(_mlora_logits(model, batch, "resumed"), second, batch[1]) <= TOL
    finally:
        model.delete_adapter("resumed")


def test_both_ways_through_peft(tiny_models, bases, batch, tmp_path):
    """PEFT's stacked adapter -> mlora -> mlora's per-expert files -> PEFT (which converts them onto the stacked
    experts: gate_up_proj at 2r and 2·alpha in its rank/alpha_pattern) -> PEFT's files -> mlora: PEFT's logits
    at every step."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = bases["qwen3_moe"]
    ref = _peft_adapter(tiny_models / "qwen3_moe", tmp_path / "peft", batch, **CASES["qwen3_moe_mixed"][1])
    model.load_adapter("there", tmp_path / "peft")
    try:
        model.save_adapter("there", tmp_path / "mlora")
        hf = AutoModelForCausalLM.from_pretrained(str(tiny_models / "qwen3_moe"), dtype=torch.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft = PeftModel.from_pretrained(hf, str(tmp_path / "mlora")).eval()
        with torch.no_grad():
            assert _relative_gap(peft(input_ids=batch[0], attention_mask=batch[1]).logits, ref, batch[1]) <= TOL
        peft.save_pretrained(str(tmp_path / "back"))
        assert json.loads((tmp_path / "back" / "adapter_config.json").read_text())["rank_pattern"]  # 2r: padded
        model.load_adapter("back", tmp_path / "back")
        assert model.adapters["back"].config.expert_rank == 16
        assert _relative_gap(_mlora_logits(model, batch, "back"), ref, batch[1]) <= TOL
    finally:
        for name in ("there", "back"):
            if name in model.adapters:
                model.delete_adapter(name)


def test_transformers5_fused_base_checkpoint_loads_exactly(tiny_models, bases, batch, tmp_path):
    """``save_pretrained(save_original_format=False)``: the stacked expert tensors are read in place, each rank its
    experts' byte ranges, into the same parameters as the original layout's."""
    from transformers import AutoModelForCausalLM

    for arch in ("qwen3_moe", "mixtral"):
        hf = AutoModelForCausalLM.from_pretrained(str(tiny_models / arch), dtype=torch.float32)
        hf.save_pretrained(str(tmp_path / arch), save_original_format=False)
        names = load_file(str(tmp_path / arch / "model.safetensors")).keys()
        assert "model.layers.0.mlp.experts.gate_up_proj" in names  # the layout under test
        fused = mlora.from_pretrained(tmp_path / arch, mlora.init_parallel(tp=1, pp=1))
        original = bases[arch]
        assert fused.bytes_read == original.bytes_read
        for (name, p), (_, q) in zip(fused.gpt.named_parameters(), original.gpt.named_parameters()):
            assert torch.equal(p, q), name
        assert torch.equal(_mlora_logits(fused, batch), _mlora_logits(original, batch))


def _edited(src, dst, config=None, tensors=None):
    """A copy of the PEFT directory ``src`` with ``config`` entries replaced and ``tensors(dict)`` applied."""
    dst.mkdir()
    raw = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**raw, **(config or {})}))
    weights = load_file(str(src / "adapter_model.safetensors"))
    save_file(tensors(weights) if tensors else weights, str(dst / "adapter_model.safetensors"))
    return dst


def test_bad_stacked_expert_adapters_are_refused(tiny_models, bases, batch, tmp_path):
    model = bases["qwen3_moe"]
    _, config = CASES["qwen3_moe_mixed"]
    good = tmp_path / "good"
    _peft_adapter(tiny_models / "qwen3_moe", good, batch, **config)
    a0 = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"  # down_proj's: the outer wrapper

    def cut(weights):  # one row too few: no rank per expert fits
        return {**weights, a0: weights[a0][:-1]}

    cases = [
        (dict(tensors=cut), CheckpointError, r"layers\.0\.mlp\.experts\.lora_A\.weight has shape \(63, 64\) .* fit no "
                                             r"stacked expert parameter .* down_proj: lora_A \[r·8, 64\]"),
        (dict(config={"target_parameters": ["mlp.experts.gate_proj"]}), ValueError,
         r"target_parameters entry 'mlp\.experts\.gate_proj' names no parameter .* valid: "
         r"'mlp\.experts\.gate_up_proj'"),
        (dict(config={"target_parameters": ["mlp.experts.down_proj"]}), CheckpointError,
         r"LoRA of model\.layers\.0\.mlp\.experts\.gate_up_proj \(by its shape\), but target_parameters"),
        (dict(config={"lora_dropout": 0.05}), ValueError, r"lora_dropout=0\.05 with target_parameters"),
        (dict(config={"r": 4}), CheckpointError, r"rank 8 per expert \(64 rows / 8 experts\), but adapter_config\.json "
                                                 r"gives it r=4"),
    ]
    for i, (edit, error, message) in enumerate(cases):
        with pytest.raises(error, match=message):
            model.load_adapter(f"bad{i}", _edited(good, tmp_path / f"bad{i}", **edit))
        assert f"bad{i}" not in model.adapters
    # a dense base has no stacked experts
    dense = mlora.from_pretrained(tiny_models / "qwen3", mlora.init_parallel(tp=1, pp=1))
    with pytest.raises(CheckpointError, match=r"adapts stacked experts, and Qwen3ForCausalLM has none"):
        dense.load_adapter("other_base", _edited(good, tmp_path / "other", tensors=lambda w: {
            k: v for k, v in w.items() if "experts" in k}))
