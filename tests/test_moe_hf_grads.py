"""LoRA gradients of every MoE family against transformers' own gradients, by the chain rule.

The reference: transformers' model with each adapted weight replaced by W + s·B·A (mlora's factors, merged here by
hand into transformers 5's layout: the stacked experts' ``gate_up_proj`` ``[E, 2·ffn, hidden]`` and ``down_proj``
``[E, hidden, ffn]``, the router ``mlp.gate``, attention, shared and dense MLPs), the same loss, and autograd's
G = dL/dW there; then dL/dA = s·Bᵀ·G and dL/dB = s·G·Aᵀ for each module, which is what mlora's factors must get
(mlora in float32 against transformers in float64, one process; the layouts are ``tests/test_moe_equivalence.py``'s,
which checks the gradients the same at every mesh). Every expert's gate, up and down, the routers (through the routing weights) and the attention (DeepSeek-V3's
multi-latent attention's five projections) are compared; gpt-oss's experts are held transposed with gate and up
interleaved, and its attention has sinks and a window on every other layer.
"""

from __future__ import annotations

import re

import pytest
import torch

import mlora

GRAD_TOL = 1e-5  # max |mlora (float32) − chain rule (float64)| over every factor / the largest gradient
# gpt-oss's tiny model is worse conditioned in float32 (large (up + 1)·glu outputs, sinks): measured 6.5e-6
MODEL_GRAD_TOL = {"gpt_oss": 2e-5}
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3", "gpt_oss"]
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)$")
_FACTOR = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")


def _hf_slot(module: str, spec) -> tuple[str, tuple, bool]:
    """The transformers-5 parameter holding PEFT module ``module``'s weight, the index of its rows there, and whether
    it is held transposed (gpt-oss's experts: ``x @ W``, gate and up columns interleaved)."""
    m = _EXPERT.match(module)
    if m is None:  # Mixtral's block is ``mlp`` in transformers 5 (its checkpoints say block_sparse_moe)
        return module.replace("block_sparse_moe", "mlp") + ".weight", (), False
    layer, expert, k = int(m.group(1)), int(m.group(2)), spec.moe.projections.index(m.group(3))
    if k == 2:
        return f"model.layers.{layer}.mlp.experts.down_proj", (expert,), spec.moe.gpt_oss
    if spec.moe.gpt_oss:
        return f"model.layers.{layer}.mlp.experts.gate_up_proj", (expert, slice(None), slice(k, None, 2)), True
    f = spec.moe.ffn_size  # an expert's gate rows, then its up rows
    return f"model.layers.{layer}.mlp.experts.gate_up_proj", (expert, slice(k * f, (k + 1) * f)), False


@pytest.mark.parametrize("arch", [*FAMILIES, "deepseek_v3-no-q-rank"])
def test_lora_gradients_equal_transformers_chain_rule(tiny_models, tmp_path, arch):
    """``deepseek_v3-no-q-rank``: DeepSeek-V3 without ``q_lora_rank`` (one ``q_proj``, DeepSeek-V2-Lite's shape)."""
    import transformers

    from mlora.testing import build_tiny_model

    model_dir = tiny_models / arch
    if arch.endswith("-no-q-rank"):
        model_dir = build_tiny_model("deepseek_v3", tmp_path / "lite", q_lora_rank=None)
    model = mlora.from_pretrained(model_dir, mlora.init_parallel(), dtype=torch.float32)
    model.add_adapter("g", mlora.LoraConfig(rank=4, alpha=8, target_modules=["all-linear", "gate"]))
    scaling = model.adapters["g"].config.scaling
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # B non-zero: every factor has a gradient of both kinds
        for p in model.adapter_parameters("g"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ids = torch.randint(0, model.spec.vocab_size, (3, 17), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0  # right padding, as rollouts have
    lo, hi = model.vocab_shard_range()

    def loss_fn(logits, mb):
        return (logits[..., :hi - lo] * mb["attention_mask"][..., None]).sum() * 1e-3, {}

    with model.use_adapters("g"):
        model.forward_backward([{"input_ids": ids, "attention_mask": mask}], loss_fn)
    model.reduce_tp_replicated_grads()
    grads = model.adapter_tensors("g", grads=True)
    factors = model.adapter_tensors("g")

    # the reference in float64 (transformers' eager experts: its grouped GEMM takes no float64), so that the
    # comparison measures mlora's float32 error, not the sum of two float32 errors
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, experts_implementation="eager")
    params = dict(hf.named_parameters())
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in factors.items():
        m = _FACTOR.match(name)
        modules.setdefault(m.group(1), {})[m.group(2)] = t
    with torch.no_grad():
        for module, ab in modules.items():
            param, index, transposed = _hf_slot(module, model.spec)
            delta = scaling * ab["B"].double() @ ab["A"].double()
            params[param][index] += delta.T if transposed else delta
    logits = hf(input_ids=ids, attention_mask=mask).logits
    (logits * mask[..., None]).sum().mul(1e-3).backward()

    want, experts, routers = {}, 0, 0
    for module, ab in modules.items():
        param, index, transposed = _hf_slot(module, model.spec)
        w_grad = params[param].grad[index].T if transposed else params[param].grad[index]
        want[f"base_model.model.{module}.lora_A.weight"] = scaling * ab["B"].double().T @ w_grad
        want[f"base_model.model.{module}.lora_B.weight"] = scaling * w_grad @ ab["A"].double().T
        experts += _EXPERT.match(module) is not None
        routers += module.endswith((".gate", ".router"))
    assert experts == 3 * model.spec.moe.num_experts * len(model.spec.sparse_layers)
    assert routers == len(model.spec.sparse_layers)
    assert grads.keys() == want.keys()
    scale = max(w.abs().max() for w in want.values())
    diffs = {name: ((grads[name].double() - w).abs().max() / scale).item() for name, w in want.items()}
    worst = max(diffs, key=diffs.get)
    print(f"{arch}: {len(modules)} modules, worst {diffs[worst]:.2e} ({worst})")
    assert diffs[worst] <= MODEL_GRAD_TOL.get(arch, GRAD_TOL), (worst, diffs[worst])
    # an expert no token reached: zero gradients on both sides
    idle = [n for n, w in want.items() if not w.any()]
    assert all(not grads[n].any() for n in idle)
