"""The memory planner on mixtures of experts with expert parallelism (``mlora plan --memory --ep``).

- weights: the planner's base, adapter and head bytes equal ``parameter_bytes()`` of the tiny Qwen3-MoE,
  Mixtral and OLMoE built by mlora at EP 1 (the experts' LoRA included), and of the tiny Qwen3-MoE on 2 ranks
  at EP 2 and at TP 2 x EP 2 with SP (one 2-rank launch; this file is its worker);
- activations: per layer, the formula equals what autograd saves in those models' sparse and dense layers;
- Qwen3-235B-A22B and Qwen3-30B-A3B (config.json only): the parameter count, per-GPU bytes at SkyRL's layout
  checked by hand, what EP changes, the fit on 80 GB GPUs, the worst-case routing;
- errors: ep not dividing the experts or the ranks of a stage, ep on a dense model, MoE at TP > 1 without SP,
  FP8 on experts, an impossible expert load, from the API and the command line.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import mlora
from mlora.cli import main as cli
from mlora.formats.hf_config import load_hf_config, model_spec
from mlora.plan import Layout, Workload, fit_layouts, plan_memory
from mlora.plan.activations import layer_saved
from mlora.plan.memory import layer_geometries, layer_loras
from mlora.plan.weights import adapter_bytes, base_bytes, head_bytes
from mlora.testing.saved_tensors import saved_bytes_by_module

pytestmark = pytest.mark.quick

GIB = 1 << 30
MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe")
QWEN3_MOE = dict(vocab_size=151936, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                 norm_topk_prob=True, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
# SkyRL's DAPO LoRA workload: GRPO, r 128 on all linears, packed 10,240-token micro-batches, full recompute
SKYRL = Workload.packed_budget(10240, rank=128, critic=False, dtype=torch.bfloat16, recompute="full")
EP_LAYOUTS = "1,2;2,2,sp"  # (tp, ep[, sp]) on 2 ranks: EP 2, and TP 2 x EP 2 (the experts split over the TP ranks)


def _qwen3_moe_config(root: Path, name: str, **sizes) -> Path:
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**QWEN3_MOE, **sizes)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.save_pretrained(str(root / name))
    return root / name


@pytest.fixture(scope="module")
def qwen3_235b(tmp_path_factory) -> Path:
    """Qwen3-235B-A22B's config.json (no weights)."""
    return _qwen3_moe_config(tmp_path_factory.mktemp("moe"), "qwen3-235b-a22b", hidden_size=4096,
                             intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
                             num_attention_heads=64)


@pytest.fixture(scope="module")
def qwen3_30b(tmp_path_factory) -> Path:
    """Qwen3-30B-A3B's config.json (no weights)."""
    return _qwen3_moe_config(tmp_path_factory.mktemp("moe"), "qwen3-30b-a3b", hidden_size=2048,
                             intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                             num_attention_heads=32)


# ---------------------------------------------------------------------------------------------- weights
def _targets(arch: str) -> list:
    """All linears (every expert's gate/up/down), attention + a dense layer's MLP, one expert's down + k, the
    router + q."""
    block = "block_sparse_moe.experts.3.w2" if arch == "mixtral" else "mlp.experts.3.down_proj"
    # Qwen3-MoE's layer 1, Qwen2-MoE's layer 2 and GLM-4.5's layer 0 are dense; Qwen2-MoE's shared expert and
    # GLM-4.5's shared experts: a TP-split MLP of its own
    dense = {"qwen3_moe": ["layers.1.mlp.gate_proj"],
             "qwen2_moe": ["layers.2.mlp.gate_proj", "layers.0.mlp.shared_expert.down_proj"],
             "glm4_moe": ["layers.0.mlp.gate_proj", "layers.1.mlp.shared_experts.down_proj"]}.get(arch, [])
    if arch == "deepseek_v3":  # multi-latent attention's projections, the duplicated down ones included
        return ["all-linear", ["q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj", "layers.0.mlp.gate_proj"],
                ["layers.2.mlp.experts.3.down_proj", "q_b_proj", "o_proj"], ["gate", "q_a_proj"]]
    sparse = 3 if arch == "qwen2_moe" else 2  # a sparse layer
    return ["all-linear", ["q_proj", "v_proj", "o_proj", *dense], [f"layers.{sparse}.{block}", "k_proj"],
            ["gate", "q_proj"]]  # the router


@pytest.mark.parametrize("arch", [*MOE, "deepseek_v3", "gpt_oss"])
def test_weight_terms_equal_parameter_bytes_at_ep1(tiny_models, arch):
    mesh = mlora.init_parallel()
    spec = model_spec(load_hf_config(tiny_models / arch))
    for dtype in (torch.float32, torch.bfloat16):
        model = mlora.from_pretrained(tiny_models / arch, mesh, dtype=dtype)
        assert base_bytes(spec, 1, 1, 0, 0, dtype, ep=1) == model.parameter_bytes()["base"], (arch, dtype)
        for targets in _targets(arch):
            lora = mlora.LoraConfig(rank=8, alpha=16, target_modules=targets)
            model.add_adapter("policy", lora)
            if "policy" not in model.heads:
                model.add_value_head("policy")
            got = model.parameter_bytes()
            assert adapter_bytes(spec, 1, 1, lora, torch.float32, ep=1)[(0, 0)] == got["adapters"], (arch, targets)
            assert head_bytes(spec, torch.float32) == got["heads"]
            model.delete_adapter("policy")


def test_weight_terms_equal_parameter_bytes_at_ep2(tiny_models, tmp_path):
    """Each of 2 ranks holds 4 of the 8 experts (and their LoRA) at EP 2, whatever its TP rank."""
    from conftest import torchrun

    torchrun(2, "../test_moe_plan.py", str(tiny_models / "qwen3_moe"), str(tmp_path / "out.json"), EP_LAYOUTS)
    records = json.loads((tmp_path / "out.json").read_text())
    assert {(r["tp"], r["ep"], r["ep_rank"]) for r in records} == {(1, 2, 0), (1, 2, 1), (2, 2, 0), (2, 2, 1)}
    spec = model_spec(load_hf_config(tiny_models / "qwen3_moe"))
    lora = mlora.LoraConfig(rank=8, alpha=16)
    ep1 = base_bytes(spec, 1, 1, 0, 0, torch.bfloat16)
    for r in records:
        tp, ep = r["tp"], r["ep"]
        assert base_bytes(spec, tp, 1, 0, r["tp_rank"], torch.bfloat16, ep=ep, ep_rank=r["ep_rank"]) == r["base"], r
        assert adapter_bytes(spec, tp, 1, lora, torch.float32, ep=ep)[(0, r["tp_rank"])] == r["adapters"], r
    # arithmetic: EP 2 halves the experts (3 sparse layers x 4 experts x gate, up, down of 128 x 64, in bf16)
    half = next(r["base"] for r in records if (r["tp"], r["ep"]) == (1, 2))
    assert ep1 - half == 3 * 4 * 3 * 128 * 64 * 2


# ---------------------------------------------------------------------------------------------- activations
@pytest.mark.parametrize("arch", [*MOE, "gpt_oss"])
def test_layer_formula_equals_saved_tensors(tiny_models, arch):
    """Every byte autograd keeps per layer (router, permutation, experts, their LoRA; q/k norms) is in the formula,
    for attention LoRA, all linears, experts-only and router LoRA; selective ``mlp`` recompute skips MoE layers.
    gpt-oss: SDPA's q, k, v and output with the sink key, its windowed layers' padded masks, the biased experts'
    clamped SwiGLU computed one expert after another."""
    mesh = mlora.init_parallel()
    spec = model_spec(load_hf_config(tiny_models / arch))
    batch, seq = 2, 48
    ids = torch.randint(0, spec.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    cases = [(torch.float32, "none", ("q_proj", "v_proj", "o_proj")), (torch.bfloat16, "none", "all-linear"),
             (torch.bfloat16, "none", ("gate_proj",)), (torch.bfloat16, "selective", "all-linear"),
             (torch.bfloat16, "none", ("gate",)), (torch.float32, "none", ("gate", "v_proj"))]  # the router
    for dtype, recompute, targets in cases:
        modules = ("mlp",) if recompute == "selective" else ("core_attn",)
        model = mlora.from_pretrained(tiny_models / arch, mesh, dtype=dtype, recompute=recompute,
                                      recompute_modules=list(modules) if recompute == "selective" else None)
        model.add_adapter("policy", mlora.LoraConfig(rank=8, alpha=16, target_modules=targets))
        got = saved_bytes_by_module(model, ids, ("policy",))
        w = Workload(micro_batch=batch, seq=seq, rank=8, target_modules=targets, dtype=dtype, recompute=recompute,
                     recompute_modules=modules)
        layers = range(spec.num_layers)
        grad = recompute != "none"  # the embedding output requires grad under recompute
        for i, (g, lora) in enumerate(zip(layer_geometries(spec, Layout(), w, batch, layers),
                                          layer_loras(spec, w, layers))):
            assert (g.experts is not None) == spec.is_sparse(i)
            want, grad = layer_saved(g, lora, "sdpa", grad, modules if recompute == "selective" else ())
            # GLM-4.5's dense layer 0 keeps nothing when only the routers above it are adapted
            assert got.get(f"layers.{i}", 0) == want, (arch, dtype, recompute, targets, i)


# ---------------------------------------------------------------------------------------------- large models
def _skyrl_base_bytes(tp: int, ep: int, layers: int) -> int:
    """Qwen3-235B-A22B's first stage of ``layers`` layers at TP ``tp``, EP ``ep``, bf16, by hand."""
    h, q, kv, e, i = 4096, 64 * 128, 4 * 128, 128, 1536
    embedding = 151936 // tp * h
    attention = (q + 2 * kv) // tp * h + h * q // tp + 2 * h + 2 * 128  # qkv, o, two norms, q/k norms
    experts = e * h + e // ep * 3 * h * i  # router (replicated) + E / ep whole experts
    return 2 * (embedding + layers * (attention + experts))


def _skyrl_adapter_bytes(tp: int, ep: int, layers: int) -> int:
    """One r-128 adapter on all linears of those layers, float32: A of q/k/v whole and B split, o's A split and B
    whole; every expert of the rank's E / ep with gate, up and down (A and B whole)."""
    r, h, q, kv, i = 128, 4096, 64 * 128, 4 * 128, 1536
    attention = r * (3 * h + (q + 2 * kv) // tp) + r * (q // tp + h)
    experts = 128 // ep * 3 * r * (h + i)
    return 4 * layers * (attention + experts)


def test_qwen3_235b_at_skyrl_layout(qwen3_235b):
    spec = model_spec(load_hf_config(qwen3_235b))
    assert base_bytes(spec, 1, 1, 0, 0, torch.bfloat16) == 235_093_634_560 * 2  # Qwen3-235B-A22B's parameters
    # SkyRL's TP4 x PP4 x EP8 splits the 94 layers 26/26/26/16: mlora's even stages cannot
    with pytest.raises(ValueError, match=r"pp=4 does not divide num_hidden_layers=94; valid pp: \[1, 2, 47, 94\]"):
        plan_memory(spec, Layout(tp=4, pp=4, dp=2, ep=8, sp=True), SKYRL)
    plan = plan_memory(spec, Layout(tp=4, pp=2, dp=4, ep=8, sp=True), SKYRL)  # the same 32 GPUs, even stages
    assert len(plan.ranks) == 8  # (stage, TP rank); every EP rank holds as much
    first = plan.ranks[0]
    assert first.base == _skyrl_base_bytes(4, 8, 47)
    assert first.adapters == _skyrl_adapter_bytes(4, 8, 47)
    assert first.optimizer == 2 * first.adapters and first.heads == 0  # AdamW moments; GRPO: no critic, no head
    assert 25 * GIB < first.base < 30 * GIB and 6 * GIB < first.adapters < 7 * GIB
    assert 45 * GIB < plan.peak < 79 * GIB - 2 * GIB  # fits an 80 GB GPU with the 2 GiB reserve
    # EP 4 holds twice the experts (base, LoRA, AdamW): no longer fits 80 GB
    ep4 = plan_memory(spec, Layout(tp=4, pp=2, dp=4, ep=4, sp=True), SKYRL)
    assert ep4.ranks[0].base - first.base == 47 * 16 * 3 * 4096 * 1536 * 2
    assert ep4.peak > 79 * GIB
    # without recompute the 47 layers' activations of two in-flight 10k-token micro-batches do not fit
    assert plan_memory(spec, plan.layout, replace(SKYRL, recompute="none")).peak > 141 * GIB
    # every token of the EP group routed to one GPU's experts: 8x the expert activations
    worst = plan_memory(spec, plan.layout, replace(SKYRL, expert_load=8.0))
    assert worst.peak > plan.peak and worst.ranks[0].base == first.base


def test_qwen3_30b_on_one_node(qwen3_30b, capsys):
    spec = model_spec(load_hf_config(qwen3_30b))
    assert base_bytes(spec, 1, 1, 0, 0, torch.bfloat16) == 30_532_122_624 * 2  # Qwen3-30B-A3B's parameters
    fits = fit_layouts(spec, SKYRL, 8, 79 * GIB, 2 * GIB, ep=8)
    good = [str(f.plan.layout) for f in fits if f.fits]
    assert good[0] == "TP1xPP1xDP8xEP8"  # the least model parallelism that fits
    assert "TP2xPP1xDP4xEP8+SP" in good  # MoE at TP > 1 is planned with SP, which megatron's MoE layer needs
    plan = fits[0].plan
    r = plan.ranks[0]
    assert r.base == base_bytes(spec, 1, 1, 0, 0, torch.bfloat16, ep=8)
    assert 9 * GIB < r.base < 10 * GIB and r.peak < 60 * GIB
    # the command line prints the same plan, the experts per GPU and the worst case
    assert cli(["plan", "--memory", "--model", str(qwen3_30b / "config.json"), "--ep", "8", "--dp", "8", "--rank",
                "128", "--no-critic", "--max-tokens-per-microbatch", "10240", "--recompute", "full"]) == 0
    out = capsys.readouterr().out
    assert "TP1xPP1xDP8xEP8" in out and f"peak per GPU: {plan.peak / GIB:.2f} GiB" in out
    assert "16 of 128 per GPU" in out and "worst case" in out
    assert cli(["plan", "--memory", "--model", str(qwen3_30b), "--ep", "8", "--dp", "4", "--tp", "2", "--sp",
                "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"] == "TP2xPP1xDP4xEP8+SP"


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("layout, workload, message", [
    (Layout(ep=3, dp=3), Workload(), r"ep=3 does not divide the 128 experts of Qwen3MoeForCausalLM; valid ep: "
                                     r"\[1, 2, 4, 8, 16, 32, 64, 128\]"),
    (Layout(ep=0), Workload(), "ep=0 is invalid"),
    (Layout(tp=4, dp=1, ep=8, sp=True), Workload(), r"ep=8 does not divide the 4 ranks of a pipeline stage "
                                                    r"\(tp=4 x dp=1\).*valid ep: \[1, 2, 4\]"),
    (Layout(tp=2, dp=4, ep=8), Workload(), "at tp=2 megatron's MoE layer needs sequence parallelism"),
    (Layout(dp=8, ep=8), Workload(fp8="torch"), "FP8 experts are not built yet"),
    (Layout(dp=8, ep=8), Workload(expert_load=9.0), r"expert_load=9.0: valid from 1.0 \(balanced routing\) to 8"),
    (Layout(dp=8, ep=8), Workload(expert_load=0.5), "expert_load=0.5"),
])
def test_bad_moe_layouts(qwen3_30b, layout, workload, message):
    with pytest.raises(ValueError, match=message):
        plan_memory(model_spec(load_hf_config(qwen3_30b)), layout, workload)


def test_ep_on_a_dense_model(tiny_models, capsys):
    spec = model_spec(load_hf_config(tiny_models / "llama"))
    with pytest.raises(ValueError, match=r"ep=2 \(expert parallelism\) on LlamaForCausalLM, which has no experts; "
                                         "valid: ep=1"):
        plan_memory(spec, Layout(dp=2, ep=2), Workload(seq=64))
    with pytest.raises(ValueError, match="expert_load=2.0 on LlamaForCausalLM, which has no experts"):
        plan_memory(spec, Layout(), Workload(seq=64, expert_load=2.0))
    assert cli(["plan", "--memory", "--model", str(tiny_models / "llama"), "--ep", "2", "--dp", "2"]) == 2
    assert "ep=2 (expert parallelism) on LlamaForCausalLM" in capsys.readouterr().err


def test_cli_ep_errors(qwen3_30b, capsys):
    base = ["plan", "--memory", "--model", str(qwen3_30b)]
    assert cli(base + ["--ep", "3", "--dp", "3"]) == 2
    assert "ep=3 does not divide the 128 experts" in capsys.readouterr().err
    assert cli(base + ["--fit", "80", "--gpus", "8", "--ep", "3"]) == 2
    assert "ep=3 does not divide the 128 experts" in capsys.readouterr().err
    assert cli(base + ["--tp", "2", "--dp", "4", "--ep", "8"]) == 2
    assert "needs sequence parallelism (sp=True, --sp)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- EP worker
def _worker(model_dir: str, out: str, layouts: str) -> None:
    """On each rank, for each ``tp,ep[,sp]`` layout: the tiny model's parameter bytes with an all-linear adapter."""
    import torch.distributed as dist

    from mlora.parallel import reset_parallel

    records = []
    for layout in layouts.split(";"):
        fields = layout.split(",")
        tp, ep, sp = int(fields[0]), int(fields[1]), fields[2:] == ["sp"]
        mesh = mlora.init_parallel(tp=tp, sp=sp, ep=ep)
        model = mlora.from_pretrained(model_dir, mesh, dtype=torch.bfloat16)
        model.add_adapter("policy", mlora.LoraConfig(rank=8, alpha=16))
        records.append({"tp": tp, "ep": ep, "tp_rank": mesh.tp_rank, "ep_rank": mesh.ep_rank,
                        **model.parameter_bytes()})
        del model
        reset_parallel()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps([r for rs in gathered for r in rs]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # torchrun worker of test_weight_terms_equal_parameter_bytes_at_ep2
    _worker(*sys.argv[1:4])


def test_mla_layer_formula_equals_saved_tensors(tiny_models):
    """DeepSeek-V3's multi-latent attention layers: every byte autograd keeps per layer is in the formula, for LoRA on
    each MLA projection alone, the down projections together, all linears, experts only and a router with kv_b."""
    mesh = mlora.init_parallel()
    spec = model_spec(load_hf_config(tiny_models / "deepseek_v3"))
    batch, seq = 2, 48
    ids = torch.randint(0, spec.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    cases = [(torch.float32, ("q_b_proj",)), (torch.float32, ("kv_b_proj",)), (torch.float32, ("o_proj",)),
             (torch.float32, ("q_a_proj", "kv_a_proj_with_mqa")), (torch.bfloat16, "all-linear"),
             (torch.bfloat16, ("gate_proj",)), (torch.float32, ("gate", "kv_b_proj")), (torch.bfloat16, ("q_a_proj",))]
    for dtype, targets in cases:
        model = mlora.from_pretrained(tiny_models / "deepseek_v3", mesh, dtype=dtype)
        model.add_adapter("policy", mlora.LoraConfig(rank=8, alpha=16, target_modules=targets))
        got = saved_bytes_by_module(model, ids, ("policy",))
        w = Workload(micro_batch=batch, seq=seq, rank=8, target_modules=targets, dtype=dtype)
        layers = range(spec.num_layers)
        grad = False
        for i, (g, lora) in enumerate(zip(layer_geometries(spec, Layout(), w, batch, layers),
                                          layer_loras(spec, w, layers))):
            want, grad = layer_saved(g, lora, "sdpa", grad)
            assert got.get(f"layers.{i}", 0) == want, (dtype, targets, i, got.get(f"layers.{i}", 0), want)
