"""Mixture-of-experts bases (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GLM-4.5, DeepSeek-V3, gpt-oss) and Qwen3's per-head
q/k norm against transformers.

Tiny random models built locally (8 experts, top-2; Qwen3-MoE renormalises its top-k weights and has a
dense layer among its sparse ones; Qwen2-MoE adds a TP-split shared expert behind a sigmoid gate (LoRA on it
too; PEFT drops its routed experts' LoRA, so their B is zeroed for the PEFT and merge checks); OLMoE
normalises q/k over all heads at once; Mixtral routes top-k then softmax; Mixtral's experts take a LoRA rank
of their own, ``expert_rank``; GLM-4.5 routes by sigmoid scores plus a correction bias, group-limited and scaled,
beside two ungated shared experts (out of the PEFT adapter: PEFT maps their LoRA onto the routed experts), after a
dense first layer, with RoPE on half of each head; DeepSeek-V3's multi-latent attention; gpt-oss's attention sinks,
a window on every other layer, biases on every linear and stacked experts with a clamped SwiGLU, its adapter in PEFT's
``target_parameters`` form). Two grouped launches (2 and 4 CPU ranks) cover (TP, PP, EP) =
(1,1,1), (1,1,2), (2,1,2)+SP on 2 ranks (the experts split over the TP ranks), (1,2,1), and (2,1,2)+SP, (1,2,2) on 4
(DP 2) and (2,2,2)+SP (TP2 x PP2 x EP2): float32 logits
equal transformers' (relative ≤ 1e-5); at TP 1 the router picks HF's experts for every token with HF's
weights; the gradients of an all-linear LoRA (one adapter per expert and projection, and the attention's) plus
the router (Qwen2-MoE's in the mixed check only: PEFT refuses its router's LoRA),
one step after initialisation so that every factor's gradient is non-zero, are the same at every layout
(each DP rank takes its share of the rows; the reference is PP 2 on one rank each, which runs the whole
batch as one process does); that adapter loads in transformers + PEFT with mlora's logits; save_merged at
EP 2 gives the checkpoint back bit for bit, and with the adapter equals PEFT's merge_and_unload. Plus the
refusals: EP that does not divide the experts, EP on a dense model, MoE at TP > 1 without SP, dropout on
experts, MoE architectures not built. A mixed-adapter micro-batch (two adapters on alternate rows, every expert
adapted) equals each adapter alone on its rows at every layout.
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import run_records
from test_errors import fake_mesh

import mlora

pytestmark = pytest.mark.quick

REL_TOL = 1e-5  # float32 logits vs transformers (measured: ≤ 4.5e-7)
GRAD_TOL = 1e-5  # max |Δgrad| / max |grad| between layouts (measured: ≤ 8e-7)
# gpt-oss's tiny model (clamped SwiGLU on large (up + 1)·glu outputs, sinks) is worse conditioned: in float64 every
# layout's gradients agree to 3.1e-16, in float32 each layout's (the reference's too) differ from float64's by up to
# 2.3e-4 after the step, and from each other by ≤ 3.0e-5 (measured)
MODEL_GRAD_TOL = {"gpt_oss": 1e-4}
MERGE_TOL = 1e-6  # save_merged vs PEFT's merge_and_unload, max |Δ| / max |W| per tensor (measured: 0)
ROUTE_WEIGHT_TOL = 1e-5  # router weights vs HF's (measured: ≤ 2.4e-6)
LAUNCHES = {
    2: ("1,1,1;1,1,2;2,1,2,sp;1,2,1", {(1, 1, 1, False), (1, 1, 2, False), (2, 1, 2, True), (1, 2, 1, False)}),
    4: ("2,1,2,sp;1,2,2;2,2,2,sp", {(2, 1, 2, True), (1, 2, 2, False), (2, 2, 2, True)}),
}
MOE = {"mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "glm4_moe", "deepseek_v3", "gpt_oss"}
SPARSE = {"qwen3_moe": {0, 2, 3}, "qwen2_moe": {0, 1, 3}, "glm4_moe": {1, 2, 3},  # the others: every layer
          "deepseek_v3": {1, 2, 3}}
REFERENCE = (1, 2, 1)


@pytest.fixture(scope="module")
def records(tiny_models, tmp_path_factory):
    out = []
    for nproc, (layouts, _) in LAUNCHES.items():
        tmp = tmp_path_factory.mktemp(f"moe{nproc}")
        out += run_records(nproc, "moe_equivalence.py", tmp / "out.json", str(tiny_models), str(tmp / "out.json"),
                           layouts)
    return out


def test_logits_equal_transformers(records):
    logits = [r for r in records if r["check"] == "logits"]
    seen = {(r["tp"], r["pp"], r["ep"], r["sp"]) for r in logits}
    assert seen == set().union(*(want for _, want in LAUNCHES.values()))
    assert {r["model"] for r in logits} == MOE | {"qwen3"}
    assert {r["model"] for r in logits if r["ep"] > 1} == MOE  # EP on a dense model is refused
    for r in logits:
        assert r["shape"] == [4, 17, 1001] and r["rel"] < REL_TOL, r


def test_router_assignment_equals_transformers(records):
    routes = [r for r in records if r["check"] == "routes"]
    assert {(r["model"], r["ep"]) for r in routes} == {(m, ep) for m in MOE for ep in (1, 2)}
    for r in routes:
        assert r["same_experts"] and r["max_weight_diff"] < ROUTE_WEIGHT_TOL, r
    # Qwen3-MoE's layer 1 and Qwen2-MoE's layer 2 are dense (mlp_only_layers): no router there
    for model, layers in SPARSE.items():
        assert {i for r in routes if r["model"] == model for i in r["layers"]} == layers


def test_lora_gradients_of_every_expert_are_layout_independent(records):
    grads = {}
    for r in records:
        if r["check"] == "grads":
            grads[(r["model"], r["tp"], r["pp"], r["ep"], r["dp"])] = r["grads"]
    for model in MOE | {"qwen3"}:
        ref = next(g for (m, tp, pp, ep, _), g in grads.items() if m == model and (tp, pp, ep) == REFERENCE)
        scale = max(abs(x) for v in ref.values() for x in v)
        assert scale > 0
        layouts = [k for k in grads if k[0] == model]
        assert len(layouts) == (7 if model in MOE else 2)
        experts = [k for k in ref if ".experts." in k]
        # every expert's gate, up and down, A and B, in each of its sparse layers (Qwen3-MoE, Qwen2-MoE: 3 of 4)
        assert len(experts) == (0 if model not in MOE else 2 * 3 * 8 * len(SPARSE.get(model, range(4))))
        # the router (gate), A and B, in each sparse layer (not Qwen2-MoE's: see ROUTER_IN_PEFT in the worker)
        routers = [k for k in ref if k.rsplit(".lora_", 1)[0].endswith((".gate", ".router"))]  # gpt-oss: router
        assert len(routers) == (2 * len(SPARSE.get(model, range(4))) if model in MOE - {"qwen2_moe"} else 0), routers
        # Qwen2-MoE's shared expert: gate, up and down, A and B, in each sparse layer, with gradients at every layout
        assert len([k for k in ref if ".shared_expert." in k]) == (2 * 3 * 3 if model == "qwen2_moe" else 0)
        # one step on, every factor that saw a token has a gradient; an expert no token was routed to has none, and
        # one first reached after the step (routing moves with the attention's LoRA) still has B = 0: B's, not A's
        used: dict[str, set] = {}
        for k in ref:
            group = f"{k.rsplit('.', 3)[0]}.lora_{'A' if '.lora_A.' in k else 'B'}" if ".experts." in k else k
            used.setdefault(group, set()).add(max(map(abs, ref[k])) > 0)
        assert all(len(flags) == 1 for flags in used.values()), used
        assert all(used[k] == {True} for k in used if ".experts." not in k)
        busy = [k for k in used if k.endswith(".lora_A") and used[k] == {True}]
        assert all(used[k[:-1] + "B"] == {True} for k in busy)
        # GLM-4.5's group-limited routing takes a token's experts from one group of 4: more of them idle
        assert len(busy) >= (0.6 if model in ("glm4_moe", "deepseek_v3") else 0.75) * len(experts) / 6, busy
        for key in layouts:
            assert grads[key].keys() == ref.keys(), key
            diff = max(abs(a - b) for k in ref for a, b in zip(grads[key][k], ref[k]))
            assert diff <= MODEL_GRAD_TOL.get(model, GRAD_TOL) * scale, (key, diff, scale)


def test_mixed_adapter_batches_route_through_experts(records):
    """Two adapters on alternate rows of one micro-batch, every expert adapted: each rank's factor gradients and
    logits equal each adapter's run alone on its rows, at every layout (routes ride the all-to-all over EP)."""
    mixed = [r for r in records if r["check"] == "mixed"]
    assert {(r["model"], r["tp"], r["pp"], r["ep"]) for r in mixed} == {
        (m, *layout[:3]) for m in MOE for _, layouts in LAUNCHES.values() for layout in layouts}
    for r in mixed:
        assert r["count"] > 0 and not r["extra"], r
        assert r["grad_rel"] <= GRAD_TOL, r
        assert r.get("logits_rel", 0.0) <= REL_TOL, r
    # the experts of every layout's ranks got gradients through the routed path
    assert all(r["experts"] > 0 for r in mixed if r["pp"] == 1), mixed


def test_expert_adapter_loads_in_peft(records):
    """The all-linear adapter, one gradient step on (B ≠ 0, changing the logits by more than 0.5), saved in PEFT
    layout (per-expert names, which PEFT 0.21 maps onto transformers 5's stacked experts) from every layout:
    transformers + PEFT on the MoE model give mlora's logits."""
    peft = [r for r in records if r["check"] == "peft"]
    assert {r["model"] for r in peft} == MOE | {"qwen3"} and len(peft) == len(MOE) * 7 + 2
    for r in peft:
        assert r["rel"] < REL_TOL and r["adapter_effect"] > 0.5, r


def test_checkpoint_back_with_every_expert(records):
    """save_merged at EP 2 gathers each stage's experts from their EP ranks: the HF checkpoint comes back bit
    for bit (EP over DP ranks, over TP ranks, TP2 x EP2 with SP and DP 2, PP2 x EP2, TP2 x PP2 x EP2 with SP)."""
    back = [r for r in records if r["check"] == "roundtrip"]
    assert {(r["model"], r["tp"], r["pp"], r["ep"], r["dp"]) for r in back} == {
        (m, tp, pp, 2, dp) for m in MOE for tp, pp, dp in ((1, 1, 2), (2, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 1))}
    for r in back:
        assert r["same_names"] and r["bit_identical"], r


def test_merged_experts_equal_peft_merge(records):
    """save_merged with the adapter at EP 2: every expert's W + s·B·A, gathered over EP, equals transformers + PEFT's
    merge_and_unload saved with per-expert names."""
    merged = [r for r in records if r["check"] == "merged"]
    assert len(merged) == len(MOE) * 5
    for r in merged:
        # attention q/k/v/o + the router + 8 experts x 3 in each layer (Qwen3-MoE's dense MLP: not in the adapter);
        # Qwen2-MoE: attention, the shared expert's gate/up/down in 3 sparse layers and the dense MLP of layer 2
        # (its routed experts' B zeroed: PEFT does not load their LoRA; its router not adapted)
        # GLM-4.5: its dense layer 0 and shared experts out of the adapter, the routers adapted; one of its 24
        # experts got no token of the step's batch (group-limited routing), so its B is still 0 and its weights as were;
        # DeepSeek-V3 likewise (two of its 24 experts idle), its attention's five projections (q_a, q_b, kv_a, kv_b, o);
        # gpt-oss: q/k/v/o, the router and the two stacked expert tensors of each layer (its biases are not adapted)
        n_changed = {"qwen3_moe": 4 * 4 + 3 * 25, "qwen2_moe": 4 * 4 + 3 * 3 + 3, "mixtral": 4 * 29,
                     "olmoe": 4 * 29, "glm4_moe": 4 * 4 + 3 + 3 * 23,
                     "deepseek_v3": 4 * 5 + 3 + 3 * 22,
                     "gpt_oss": 4 * (4 + 1 + 2)}[r["model"]]  # stacked: one gate_up_proj and one down_proj a layer
        assert r["same_names"] and r["changed"] == n_changed and r["max_rel"] < MERGE_TOL, r


def test_moe_errors(tiny_models, tmp_path):
    from mlora.formats.hf_config import check_layout, load_hf_config, model_spec

    spec = model_spec(load_hf_config(tiny_models / "mixtral"))
    with pytest.raises(ValueError, match=r"ep=3 does not divide the 8 experts of MixtralForCausalLM; "
                                         r"valid ep: \[1, 2, 4, 8\]"):
        check_layout(spec, 1, 1, 3)
    with pytest.raises(ValueError, match=r"ep=2 \(expert parallelism\) on LlamaForCausalLM, which has no experts"):
        check_layout(model_spec(load_hf_config(tiny_models / "llama")), 1, 1, 2)
    with pytest.raises(ValueError, match="needs sequence parallelism"):
        mlora.from_pretrained(tiny_models / "olmoe", fake_mesh(tp=2))
    with pytest.raises(ValueError, match="fp8='torch' on OlmoeForCausalLM, a mixture of experts"):
        mlora.from_pretrained(tiny_models / "olmoe", fake_mesh(), fp8="torch")
    with pytest.raises(ValueError, match=r"ep=3 does not divide the 1 ranks of a pipeline stage"):
        mlora.init_parallel(ep=3)
    # LoRA on experts: the MLP names reach every expert; the router only when named (gate, or megatron's router)
    from mlora.lora.targets import resolve_targets

    moe = spec.moe
    modules = resolve_targets("all-linear", None, 4, moe)
    assert len(modules) == 4 * 4 + 4 * 8 * 3 and (2, "block_sparse_moe.experts.7.w2") in modules
    assert resolve_targets("w1", None, 4, moe) == resolve_targets("gate_proj", None, 4, moe) == {
        (i, f"block_sparse_moe.experts.{e}.w1") for i in range(4) for e in range(8)}
    assert resolve_targets("layers.1.block_sparse_moe.experts.3.linear_fc1", None, 4, moe) == {
        (1, "block_sparse_moe.experts.3.w1"), (1, "block_sparse_moe.experts.3.w3")}
    routers = {(i, "block_sparse_moe.gate") for i in range(4)}
    assert resolve_targets("gate", None, 4, moe) == resolve_targets("router", None, 4, moe) == routers
    assert not routers & modules  # all-linear leaves the router out, as Megatron-Bridge's and SkyRL's do
    assert resolve_targets(["all-linear", "gate"], "layers.0.block_sparse_moe.gate", 4, moe) == modules | routers - {
        (0, "block_sparse_moe.gate")}
    with pytest.raises(ValueError, match=r"unknown target module 'gate'; valid names: .*gate_proj"):
        resolve_targets("gate", None, 4, None)  # a dense model has no router
    model = mlora.from_pretrained(tiny_models / "olmoe", mlora.init_parallel(tp=1, pp=1))
    with pytest.raises(ValueError, match=r"LoRA dropout=0.1 on mixture-of-experts experts is not supported"):
        model.add_adapter("d", mlora.LoraConfig(dropout=0.1))
    with pytest.raises(ValueError, match=r"LoRA dropout=0.1 on a mixture-of-experts router is not supported"):
        model.add_adapter("d", mlora.LoraConfig(dropout=0.1, target_modules=["q_proj", "gate"]))
    model.add_adapter("d", mlora.LoraConfig(dropout=0.1, target_modules=["q_proj", "v_proj"]))  # attention: fine
    # PEFT 0.21 refuses a Qwen2-MoE adapter with router LoRA (no module type it adapts): said when saving it
    q2_model = mlora.from_pretrained(tiny_models / "qwen2_moe", mlora.init_parallel(tp=1, pp=1))
    q2_model.add_adapter("r", mlora.LoraConfig(target_modules=["q_proj", "gate"]))
    with pytest.warns(UserWarning, match=r"adapts the router of layers \[0, 1, 3\] of a Qwen2-MoE model.*refuses"):
        q2_model.save_adapter("r", tmp_path / "q2_router")
    # Qwen2-MoE's shared expert: the MLP names reach it and every routed expert; its sigmoid gate is no target
    q2 = model_spec(load_hf_config(tiny_models / "qwen2_moe")).moe
    shared = {(i, f"mlp.shared_expert.{p}") for i in (0, 1, 3) for p in ("gate_proj", "up_proj", "down_proj")}
    modules = resolve_targets("all-linear", None, 4, q2)
    assert len(modules) == 4 * 4 + 3 * (8 + 1) * 3 + 3 and shared <= modules
    assert resolve_targets("shared_expert.down_proj", None, 4, q2) == {(i, "mlp.shared_expert.down_proj")
                                                                       for i in (0, 1, 3)}
    assert resolve_targets("layers.3.mlp.shared_experts.linear_fc1", None, 4, q2) == {
        (3, "mlp.shared_expert.gate_proj"), (3, "mlp.shared_expert.up_proj")}
    assert len(resolve_targets("gate_proj", None, 4, q2)) == 3 * 9 + 1  # experts, shared expert, dense layer 2
    with pytest.raises(ValueError, match=r"'shared_expert_gate': the shared expert's sigmoid gate .* is not a LoRA"):
        resolve_targets(["q_proj", "shared_expert_gate"], None, 4, q2)
    with pytest.raises(ValueError, match="tp=2 does not divide shared_expert_intermediate_size=95"):
        check_layout(model_spec(load_hf_config(_with_config(tiny_models / "qwen2_moe", tmp_path / "q2",
                                                            shared_expert_intermediate_size=95))), 2, 1)
    # GLM-4.5: its shared experts by their name (megatron's too), no gate to target; routing megatron computes otherwise
    glm = model_spec(load_hf_config(tiny_models / "glm4_moe")).moe
    assert resolve_targets("shared_experts.down_proj", None, 4, glm) == {(i, "mlp.shared_experts.down_proj")
                                                                         for i in (1, 2, 3)}
    assert resolve_targets("layers.3.mlp.shared_experts.linear_fc1", None, 4, glm) == {
        (3, "mlp.shared_experts.gate_proj"), (3, "mlp.shared_experts.up_proj")}
    assert len(resolve_targets("all-linear", None, 4, glm)) == 4 * 4 + 3 + 3 * (8 + 1) * 3
    with pytest.raises(ValueError, match="unknown target module 'shared_expert_gate'"):
        resolve_targets(["q_proj", "shared_expert_gate"], None, 4, glm)
    for changes, message in (({"norm_topk_prob": False}, r"norm_topk_prob=False is not supported \(megatron-core's "
                                                          r"sigmoid router renormalises"),
                             ({"num_experts_per_tok": 4}, r"megatron-core ranks a group by its 4 best scores, "
                                                          r"transformers by its 2 best"),
                             ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                                   "partial_rotary_factor": 0.5}},
                              r"partial_rotary_factor=0.5 and rope_type 'linear' is not supported")):
        bad = _with_config(tiny_models / "glm4_moe", tmp_path / f"glm_{len(changes)}_{sorted(changes)[0]}", **changes)
        with pytest.raises(ValueError, match=message):
            model_spec(load_hf_config(bad))
    # MoE families that need more than mlora builds: named with what they need
    lite = _with_config(tiny_models / "qwen3_moe", tmp_path / "lite", architectures=["Glm4MoeLiteForCausalLM"])
    with pytest.raises(ValueError, match="'Glm4MoeLiteForCausalLM' .* needs multi-head latent attention"):
        mlora.from_pretrained(lite, fake_mesh())
    # gpt-oss: SwiGLU constants other than the ones megatron-core and vLLM compute, malformed layer types, and the
    # attention implementations that take one window for every layer
    for changes, message in (({"swiglu_limit": 5.0}, r"swiglu_limit=5.0 is not supported .* supported: 7.0"),
                             ({"swiglu_alpha": 1.5}, r"swiglu_alpha=1.5 is not supported"),
                             ({"layer_types": ["sliding_attention", "full_attention", "chunked_attention",
                                               "full_attention"]}, r"layer_types=.*chunked_attention.*; valid: one of"),
                             ({"sliding_window": None}, r"sliding_window=None with sliding_attention layers")):
        bad = _with_config(tiny_models / "gpt_oss", tmp_path / f"oss_{sorted(changes)[0]}", **changes)
        with pytest.raises(ValueError, match=message):
            model_spec(load_hf_config(bad))
    with pytest.raises(ValueError, match=r"GptOssForCausalLM \(attention sinks, a window per layer\) runs with "
                                         r"fp8=None and attention='sdpa' only \(got fp8=None, attention='unfused'\)"):
        mlora.from_pretrained(tiny_models / "gpt_oss", mlora.init_parallel(), attention="unfused")
    jitter = _with_config(tiny_models / "mixtral", tmp_path / "mixtral", router_jitter_noise=0.1)
    with pytest.raises(ValueError, match="router_jitter_noise=0.1 is not supported"):
        mlora.from_pretrained(jitter, fake_mesh())


def _with_config(src, dst, **changes):
    """A copy of model directory ``src`` at ``dst`` whose config.json has ``changes``."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def test_moe_spec_of_each_family(tiny_models):
    from mlora.formats.hf_config import load_hf_config, model_spec

    specs = {name: model_spec(load_hf_config(tiny_models / name)) for name in ("mixtral", "qwen3_moe", "qwen2_moe",
                                                                               "olmoe", "glm4_moe")}
    assert (specs["mixtral"].moe.normalize_topk, specs["qwen3_moe"].moe.normalize_topk,
            specs["olmoe"].moe.normalize_topk) == (True, True, False)
    assert specs["qwen3_moe"].moe.sparse_layers == (0, 2, 3) and specs["mixtral"].moe.sparse_layers == (0, 1, 2, 3)
    assert specs["mixtral"].moe.projections == ("w1", "w3", "w2") and specs["mixtral"].moe.block == "block_sparse_moe"
    assert (specs["qwen3_moe"].qk_norm, specs["olmoe"].qk_norm, specs["mixtral"].qk_norm) == ("head", "full", None)
    assert specs["qwen3_moe"].moe.ffn_size == 64 and specs["qwen3_moe"].intermediate_size == 192
    # Qwen2-MoE: a gated shared expert beside 8 routed ones, q/k/v bias, no q/k norm, top-k weights as the softmax gave
    q2 = specs["qwen2_moe"]
    assert (q2.moe.shared_ffn_size, q2.moe.ffn_size, q2.moe.sparse_layers, q2.moe.normalize_topk) == (
        96, 64, (0, 1, 3), False)
    assert q2.qkv_bias and q2.qk_norm is None and specs["qwen3_moe"].moe.shared_ffn_size is None
    # GLM-4.5: sigmoid routing with the correction bias, 2 groups (the best 1 kept), x2.5; 2 shared experts as one
    # ungated MLP of 2 x 64; layer 0 dense; q/k/v bias; RoPE on 16 of each head's 32 dims
    glm = specs["glm4_moe"]
    assert (glm.moe.score, glm.moe.expert_bias, glm.moe.groups, glm.moe.scaling, glm.moe.normalize_topk) == (
        "sigmoid", True, (2, 1), 2.5, True)
    assert (glm.moe.shared_ffn_size, glm.moe.shared_name, glm.moe.shared_gate, glm.moe.sparse_layers) == (
        128, "shared_experts", False, (1, 2, 3))
    assert glm.qkv_bias and glm.qk_norm is None and (glm.rotary_percent, glm.rotary_dim) == (0.5, 16)
    assert all(s.moe.score == "softmax" and not s.moe.expert_bias for n, s in specs.items() if n != "glm4_moe")


def test_deepseek_v3_spec_and_refusals(tiny_models, tmp_path):
    """DeepSeek-V3: multi-head latent attention's ranks and head dims, YaRN, GLM-4.5's routing with one shared
    expert; refused: rope_interleave=False (megatron's MLA rotates interleaved pairs), megatron's unfused attention
    (not wired into its MLA)."""
    from mlora.formats.hf_config import MLASpec, load_hf_config, model_spec

    spec = model_spec(load_hf_config(tiny_models / "deepseek_v3"))
    assert spec.mla == MLASpec(q_lora_rank=48, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
                               v_head_dim=24) and spec.mla.qk_head_dim == 96
    assert (spec.moe.score, spec.moe.expert_bias, spec.moe.groups, spec.moe.scaling, spec.moe.shared_ffn_size,
            spec.moe.shared_gate, spec.moe.sparse_layers) == ("sigmoid", True, (2, 1), 2.5, 64, False, (1, 2, 3))
    bad = _with_config(tiny_models / "deepseek_v3", tmp_path / "interleave", rope_interleave=False)
    with pytest.raises(ValueError, match="rope_interleave=False is not supported"):
        model_spec(load_hf_config(bad))
    with pytest.raises(ValueError, match="multi-latent attention.*fp8=None and attention='sdpa' only"):
        mlora.from_pretrained(tiny_models / "deepseek_v3", mlora.init_parallel(), attention="unfused")
    # dropout on the duplicated down projections would depend on the mesh at TP > 1
    from mlora.facade.adapters import _check_duplicated_dropout

    down = {(1, "q_a_proj"), (1, "kv_b_proj")}
    _check_duplicated_dropout(mlora.LoraConfig(dropout=0.1), down, 1)
    with pytest.raises(ValueError, match=r"dropout=0.1 on multi-latent attention's down projections \['q_a_proj'\] at "
                                         "tp=2"):
        _check_duplicated_dropout(mlora.LoraConfig(dropout=0.1), down, 2)
