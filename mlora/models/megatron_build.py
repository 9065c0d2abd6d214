"""HF model facts + mesh -> megatron-core TransformerConfig, layer spec and GPTModel for this rank."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from mlora.formats.hf_config import ModelSpec, check_layout, hf_inv_freq, hf_rope, rope_parameters
from mlora.fp8.quant import SCALED_MM_MULTIPLE, FP8ShapeError, fp8_shape_problems
from mlora.lora.sites import attach_lora_sites
from mlora.models.attention import (
    ATTENTION_CONFIG_ATTR,
    LAYER_WINDOWS_CONFIG_ATTR,
    WINDOW_CONFIG_ATTR,
    SDPAttention,
    check_attention_arg,
)
from mlora.models.norm import QK_NORM_CONFIG_ATTR, RMSNorm
from mlora.models.recompute import Recompute, prepare_for_recompute
from mlora.parallel.mesh import Mesh


def transformer_config(spec: ModelSpec, mesh: Mesh, dtype: torch.dtype, recompute: Recompute | None = None):
    """The megatron TransformerConfig that reproduces ``spec`` on ``mesh`` (no fusions on CPU), with
    megatron's activation recompute as ``recompute`` says (default: none; see :mod:`mlora.models.recompute`)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    on_gpu = mesh.device.type == "cuda"
    recompute = recompute or Recompute()
    config_class, mla = (TransformerConfig, {}) if spec.mla is None else (MLATransformerConfig, mla_config_kwargs(spec))
    config = config_class(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        add_bias_linear=spec.linear_bias,
        add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        apply_query_key_layer_scaling=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=mesh.tp,
        pipeline_model_parallel_size=mesh.pp,
        sequence_parallel=mesh.sp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        batch_p2p_sync=on_gpu,
        use_cpu_initialization=not on_gpu,
        perform_initialization=False,  # weights come from the checkpoint; never build full matrices
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        calculate_per_token_loss=True,  # loss functions return their micro-batch's share; no rescaling
        qk_layernorm=spec.qk_norm is not None or spec.mla is not None,
        **recompute.config_kwargs(),
        **moe_config_kwargs(spec, mesh),
        **mla,
        **gpt_oss_config_kwargs(spec),
    )
    if spec.mla is not None:
        from mlora.models.mla import MLA_ROPE_CONFIG_ATTR

        inv_freq, factor = hf_rope(spec)
        setattr(config, MLA_ROPE_CONFIG_ATTR, (inv_freq.to(mesh.device), factor))
    return config


def gpt_oss_config_kwargs(spec: ModelSpec) -> dict:
    """The activation (SiLU's SwiGLU; gpt-oss's ``(up + 1) · gate · sigmoid(1.702 · gate)``, gate clamped above and up
    on both sides at 7, megatron's quick_gelu GLU with its clamp and linear offset), attention sinks (megatron's
    learnable softmax offset, :class:`~mlora.models.attention.SDPAttention`'s) and the softmax scale (YaRN's attention
    factor scales cos and sin, so q·k by its square, as in transformers)."""
    if not (spec.moe is not None and spec.moe.gpt_oss):
        return dict(activation_func=F.silu)
    from megatron.core.activations import quick_gelu

    from mlora.formats.hf_config import GPT_OSS_SWIGLU

    _, factor = hf_rope(spec)
    return dict(activation_func=quick_gelu, activation_func_clamp_value=GPT_OSS_SWIGLU["swiglu_limit"],
                glu_linear_offset=1.0, softmax_type="learnable" if spec.attention_sinks else "vanilla",
                softmax_scale=factor * factor / spec.head_dim ** 0.5)


def mla_config_kwargs(spec: ModelSpec) -> dict:
    """megatron's multi-latent attention settings for ``spec.mla`` (DeepSeek-V3): the low ranks and head dims, and
    the YaRN factor and ``mscale_all_dim`` that scale the softmax as transformers scales it (the RoPE itself is
    transformers', :class:`mlora.models.mla.HFRotaryEmbedding`)."""
    mla, rope = spec.mla, rope_parameters(spec.hf_config)
    scaled = rope["rope_type"] != "default"
    return dict(q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_head_dim=mla.qk_nope_head_dim,
                qk_pos_emb_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim, rope_type="yarn",
                rotary_base=spec.rope_theta, rotary_scaling_factor=float(rope.get("factor", 1.0)) if scaled else 1.0,
                mscale_all_dim=float(rope.get("mscale_all_dim", 0.0) or 0.0) if scaled else 0.0)


def moe_config_kwargs(spec: ModelSpec, mesh: Mesh) -> dict:
    """megatron's MoE settings that reproduce ``spec.moe`` (none for a dense model): a frozen linear router in the dtype
    transformers computes it in (the model's, or float32: ``MoESpec.router_fp32``) with HF's routing (softmax over all
    experts then top-k, or top-k then softmax when the k weights are renormalised, Mixtral's and ``norm_topk_prob``), no
    load-balancing loss and no token drop, experts as megatron's SequentialMLP (computed grouped) split over EP ranks
    (expert TP 1), the all-to-all dispatcher; a shared expert (Qwen2-MoE, GLM-4.5) as megatron's SharedExpertMLP, TP-split like a dense
    MLP, its output scaled by ``sigmoid(x · gate_weight)`` where HF has a ``shared_expert_gate``, computed before the
    dispatch, not overlapped with it (``moe_shared_expert_overlap`` needs CUDA streams). Sigmoid routing (GLM-4.5) is
    megatron's, with its group-limited top-k and scaling factor; its correction bias is a frozen float32 parameter of
    the router (:func:`add_expert_biases`), not megatron's ``moe_router_enable_expert_bias``, which allocates on CUDA
    and updates the bias as it trains."""
    moe = spec.moe
    if moe is None:
        return {}
    shared = {} if moe.shared_ffn_size is None else dict(moe_shared_expert_intermediate_size=moe.shared_ffn_size,
                                                          moe_shared_expert_gate=moe.shared_gate,
                                                          moe_shared_expert_overlap=False)
    groups = ({} if moe.groups is None
              else dict(moe_router_num_groups=moe.groups[0], moe_router_group_topk=moe.groups[1]))
    return dict(
        **shared,
        **groups,
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.ffn_size,
        moe_router_topk=moe.top_k,
        moe_router_pre_softmax=not moe.normalize_topk,
        moe_router_score_function=moe.score,
        moe_router_topk_scaling_factor=moe.scaling,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32" if moe.router_fp32 else None,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        moe_layer_freq=[int(spec.is_sparse(i)) for i in range(spec.num_layers)],
        expert_model_parallel_size=mesh.ep,
        expert_tensor_parallel_size=1,
    )


def fp8_local_shapes(spec: ModelSpec, tp: int) -> dict[str, tuple[int, int]]:
    """``{layer: (K, N)}``: the local GEMM of each FP8 linear on one TP rank, ``x [M, K] @ Wᵀ [K, N]``.

    Column-parallel (``linear_qkv``, ``linear_fc1``) split N, row-parallel (``linear_proj``, ``linear_fc2``)
    split K, as megatron does; every rank and every layer has the same shapes. ``tp`` must divide the split
    dims' totals (:func:`mlora.formats.hf_config.check_layout` says so otherwise), else ValueError."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    h, ffn = spec.hidden_size, spec.intermediate_size
    split = {"linear_qkv": q + 2 * kv, "linear_proj": q, "linear_fc1": 2 * ffn, "linear_fc2": ffn}
    bad = {name: total for name, total in split.items() if total % tp}
    if bad:
        raise ValueError(f"tp={tp} does not divide the TP-split dims {bad}")
    return {"decoder.layers.*.self_attention.linear_qkv": (h, (q + 2 * kv) // tp),
            "decoder.layers.*.self_attention.linear_proj": (q // tp, h),
            "decoder.layers.*.mlp.linear_fc1": (h, 2 * ffn // tp),
            "decoder.layers.*.mlp.linear_fc2": (ffn // tp, h)}


def fp8_valid_tps(spec: ModelSpec) -> list[int]:
    """The TP sizes that split ``spec`` (:func:`mlora.formats.hf_config.check_layout`) into FP8 GEMMs CUDA's
    ``torch._scaled_mm`` accepts, ascending; [] when none does (e.g. a hidden size that is no multiple of 16)."""
    tps = []
    for tp in range(1, spec.num_heads + 1):  # TP must divide the head count
        try:
            check_layout(spec, tp, 1)
        except ValueError:
            continue
        if not fp8_shape_problems(fp8_local_shapes(spec, tp)):
            tps.append(tp)
    return tps


def check_fp8_shapes(spec: ModelSpec, tp: int, device: torch.device | str) -> None:
    """:class:`mlora.fp8.FP8ShapeError` when ``device`` is CUDA and some FP8 linear of ``spec`` split ``tp``
    ways has a local K or N that ``torch._scaled_mm`` refuses there (:func:`mlora.fp8.fp8_shape_problems`:
    multiples of 16); the message names each such layer, the TP sizes that work for this model, and fp8=None.
    :func:`mlora.models.loader.load_shard` calls it for ``fp8="torch"`` before reading or building anything,
    so the first forward cannot fail on it. No check on other devices: CPU's ``_scaled_mm`` takes any shape.

    Why an error and not those layers in bf16: a per-TP choice of bf16 linears would change the results
    with the mesh (FP8 logits are meant to equal TP1's) and the memory the planner counts for the base."""
    if torch.device(device).type != "cuda":
        return
    problems = fp8_shape_problems(fp8_local_shapes(spec, tp))
    if not problems:
        return
    valid = fp8_valid_tps(spec)
    works = (f"tp that work for this model with fp8='torch': {', '.join(map(str, valid))}" if valid else
             "no tp works for this model with fp8='torch'")
    raise FP8ShapeError(
        f"fp8='torch' cannot run this model at tp={tp} on CUDA: torch._scaled_mm needs the inner dim K and the "
        f"output dim N of every FP8 GEMM to be a multiple of {SCALED_MM_MULTIPLE}, and on each TP rank "
        + "; ".join(problems) + f". {works}; or use fp8=None (the base in dtype, e.g. torch.bfloat16)")


def gpt_model(spec: ModelSpec, mesh, config, layer_spec, vocab_size: int):
    """This rank's megatron ``GPTModel`` (its pipeline stage, vocab-parallel output) for ``spec`` with
    ``layer_spec``, on the mesh's device, RoPE with transformers' own inverse frequencies (they cover
    linear and llama3 scaling exactly; RoPE is not a parameter, so no checkpoint carries it), and the routers'
    correction biases where ``spec`` has them (:func:`add_expert_biases`)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=mesh.is_first_stage,
        post_process=mesh.is_last_stage,
        share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
        rotary_percent=spec.rotary_percent,
        parallel_output=True,
    )
    if spec.mla is None:  # multi-latent attention has its own, per layer (mlora.models.mla)
        # YaRN's cos/sin factor (gpt-oss) is in the softmax scale (gpt_oss_config_kwargs)
        inv_freq = hf_rope(spec)[0] if spec.moe is not None and spec.moe.gpt_oss else hf_inv_freq(spec)
        model.rotary_pos_emb.inv_freq = inv_freq.to(mesh.device)
    if spec.moe is not None and spec.moe.expert_bias:  # GLM-4.5's correction bias: no megatron option builds it here
        add_expert_biases(model)
    return model.to(mesh.device)

def block_spec(config):
    """megatron's local GPT layer spec (its MoE layer where the config's ``moe_layer_freq`` says so) with
    four swaps: mlora's RMSNorm (SP-capable; the full-width q/k norms of OLMoE) in every norm slot,
    LoRA-capable parallel linears in every linear slot, experts' and the shared expert's included (the
    latter only where the config has one), the experts as :class:`~mlora.models.grouped_experts.GroupedLoraExperts`
    (megatron's SequentialMLP computed as grouped GEMMs), and, unless the config's
    ``mlora_attention`` (set by :func:`build_gpt_model`) says ``"unfused"``, :class:`SDPAttention`
    (torch's fused scaled_dot_product_attention) in the core-attention slot. With multi-latent attention (the
    config's ``multi_latent_attention``, DeepSeek-V3) the attention is megatron's MLA layer spec with
    :class:`~mlora.models.mla.LoraMLASelfAttention`, duplicated down projections and SDPA."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from mlora.lora.layers import LoraColumnParallelLinear, LoraRowParallelLinear
    from mlora.models.grouped_experts import GroupedLoraExperts
    from mlora.models.norm import FullWidthKNorm, FullWidthQNorm

    qk_norm = bool(getattr(config, "qk_layernorm", False))
    num_experts = getattr(config, "num_moe_experts", None)
    mla = bool(getattr(config, "multi_latent_attention", False))

    def layer_spec(num_experts: int | None):
        layer = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_norm,
                                         normalization="RMSNorm", multi_latent_attention=mla)
        sub = layer.submodules
        if mla:  # DeepSeek-V3: every projection LoRA-capable, the q/kv norms mlora's (mlora.models.mla)
            from mlora.models.mla import LoraDuplicatedLinear, LoraMLASelfAttention

            attention = dict(linear_q_proj=LoraColumnParallelLinear, linear_q_down_proj=LoraDuplicatedLinear,
                             linear_q_up_proj=LoraColumnParallelLinear, linear_kv_down_proj=LoraDuplicatedLinear,
                             linear_kv_up_proj=LoraColumnParallelLinear, linear_proj=LoraRowParallelLinear,
                             q_layernorm=RMSNorm, kv_layernorm=RMSNorm, core_attention=SDPAttention)
            sub.self_attention = dataclasses.replace(sub.self_attention, module=LoraMLASelfAttention)
        else:
            attention = {"linear_qkv": LoraColumnParallelLinear, "linear_proj": LoraRowParallelLinear}
            if qk_norm:
                full = getattr(config, QK_NORM_CONFIG_ATTR, "head") == "full"
                attention.update(q_layernorm=FullWidthQNorm if full else RMSNorm,
                                 k_layernorm=FullWidthKNorm if full else RMSNorm)
            if getattr(config, ATTENTION_CONFIG_ATTR, "sdpa") == "sdpa":  # "unfused": megatron's DotProductAttention
                attention["core_attention"] = SDPAttention
        sub.self_attention.submodules = dataclasses.replace(sub.self_attention.submodules, **attention)
        mlp = sub.mlp.submodules.experts.submodules if num_experts else sub.mlp.submodules
        lora = dict(linear_fc1=LoraColumnParallelLinear, linear_fc2=LoraRowParallelLinear)
        if num_experts:  # an expert is megatron's MLP with the same LoRA-capable linears (expert TP 1), run grouped
            sub.mlp.submodules.experts = dataclasses.replace(sub.mlp.submodules.experts, module=GroupedLoraExperts,
                                                             submodules=dataclasses.replace(mlp, **lora))
            shared = sub.mlp.submodules.shared_experts  # megatron's SharedExpertMLP: a TP-split MLP
            if getattr(config, "moe_shared_expert_intermediate_size", None) is None:
                shared = None
            else:
                shared = dataclasses.replace(shared, submodules=dataclasses.replace(shared.submodules, **lora))
            sub.mlp.submodules = dataclasses.replace(sub.mlp.submodules, shared_experts=shared)
        else:
            sub.mlp.submodules = dataclasses.replace(mlp, **lora)
        layer.submodules = dataclasses.replace(sub, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm)
        return layer

    dense, count = layer_spec(None), get_num_layers_to_build(config)
    if not num_experts:
        return TransformerBlockSubmodules(layer_specs=[dense] * count, layer_norm=RMSNorm)
    sparse, offset = layer_spec(num_experts), get_transformer_layer_offset(config)
    layers = [sparse if config.moe_layer_freq[offset + j] else dense for j in range(count)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=RMSNorm)


def add_expert_biases(model: torch.nn.Module) -> None:
    """Every MoE router of ``model`` gets a frozen float32 ``expert_bias`` parameter (the checkpoint's
    ``e_score_correction_bias``, zeros until loaded), which megatron's routing adds to the scores that choose the
    top-k, as transformers and vLLM do: a parameter, not megatron's buffer, so that loading, export and checkpoints
    reach it as they reach the router's weight (its dist-checkpoint key is megatron's,
    ``decoder.layers.<i>.mlp.router.expert_bias``); float32 whatever the base's dtype, since a bf16 bias would move
    the choice."""
    from megatron.core.transformer.moe.router import TopKRouter

    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.expert_bias = torch.nn.Parameter(torch.zeros(module.config.num_moe_experts, dtype=torch.float32,
                                                                device=module.weight.device), requires_grad=False)


def route_through_experts(model: torch.nn.Module) -> None:
    """Every megatron MoE layer of ``model`` becomes an :class:`~mlora.models.moe_routes.AdapterRoutedMoELayer`
    (mixed-adapter routes reach the experts) and its router a :class:`~mlora.models.lora_router.LoraTopKRouter`
    (a LoRA target). Swapped after the build, not in the layer spec: megatron's TransformerLayer hands its process
    groups only to the MoE classes it knows by identity. The grouped experts' weights are stacked here, before
    anything is loaded into them (:meth:`~mlora.models.grouped_experts.GroupedLoraExperts.stack_weights`)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from mlora.models.grouped_experts import GroupedLoraExperts
    from mlora.models.lora_router import lora_router
    from mlora.models.moe_routes import AdapterRoutedMoELayer

    for module in list(model.modules()):
        if type(module) is MoELayer:
            module.__class__ = AdapterRoutedMoELayer
            lora_router(module.router)
        if isinstance(module, GroupedLoraExperts) and module.num_local_experts > 1:
            module.stack_weights()


def lora_output_layer(model: torch.nn.Module) -> None:
    """The last stage's output layer becomes a :class:`~mlora.lora.layers.LoraColumnParallelLinear` (the ``lm_head``
    target). Swapped after the build: GPTModel builds it itself, from no spec."""
    from mlora.lora.layers import LoraColumnParallelLinear

    if getattr(model, "post_process", False):
        layer = model.output_layer
        layer.__class__ = LoraColumnParallelLinear
        layer._init_lora()
        layer.weight_scale = None  # the output layer's weight is never FP8 (see LoraHost._init_fp8)


def build_gpt_model(spec: ModelSpec, mesh: Mesh, dtype: torch.dtype, fp8: str | None = None,
                    fp8_recipe: str = "delayed", attention: str = "sdpa", recompute: Recompute | None = None):
    """This rank's GPTModel shard, parameters allocated but not initialised, base frozen.

    ``recompute``: megatron's activation recompute (default none), with the hooks that keep it exact
    for a frozen base with LoRA (:func:`mlora.models.recompute.prepare_for_recompute`).

    ``attention``: the local spec's core attention, ``"sdpa"`` (:class:`mlora.models.attention.SDPAttention`)
    or ``"unfused"`` (megatron's ``DotProductAttention``); the TE spec always uses TE's.

    ``fp8="torch"``: the LoRA linears allocate their weights in float8_e4m3fn with a float32
    ``weight_scale`` per output row (see :mod:`mlora.fp8`); everything else stays in ``dtype``.
    ``fp8="te"``: Transformer Engine's layer spec with the same LoRA (:func:`mlora.models.te.te_block_spec`)
    and megatron's own ``fp8_autocast`` around the block with ``fp8_recipe`` (UNVERIFIED: no TE run yet)."""
    from mlora.lora.layers import FP8_CONFIG_ATTR

    recompute = recompute or Recompute()
    if spec.layer_windows is not None and (fp8 is not None or attention != "sdpa"):
        raise ValueError(f"{spec.architecture} (attention sinks, a window per layer) runs with fp8=None and "
                         f"attention='sdpa' only (got fp8={fp8!r}, attention={attention!r}): megatron's unfused "
                         "attention and Transformer Engine's take one window for every layer")
    if spec.mla is not None and (fp8 is not None or attention != "sdpa"):
        raise ValueError(f"{spec.architecture} (multi-latent attention) runs with fp8=None and attention='sdpa' only "
                         f"(got fp8={fp8!r}, attention={attention!r}): mlora's FP8 linears and megatron's unfused "
                         "attention are not wired into megatron-core's MLA")
    config = transformer_config(spec, mesh, dtype, recompute)
    setattr(config, FP8_CONFIG_ATTR, fp8)
    setattr(config, ATTENTION_CONFIG_ATTR, check_attention_arg(attention))
    setattr(config, WINDOW_CONFIG_ATTR, spec.sliding_window)
    setattr(config, LAYER_WINDOWS_CONFIG_ATTR, spec.layer_windows)
    setattr(config, QK_NORM_CONFIG_ATTR, spec.qk_norm)
    layer_spec = block_spec
    if fp8 == "te":
        from mlora.models.te import megatron_fp8_settings, te_block_spec

        for key, value in megatron_fp8_settings(fp8_recipe).items():
            setattr(config, key, value)
        layer_spec = te_block_spec
    model = gpt_model(spec, mesh, config, layer_spec(config), spec.padded_vocab_size(mesh.tp))
    for p in model.parameters():
        p.requires_grad_(False)
    route_through_experts(model)
    lora_output_layer(model)
    attach_lora_sites(model, spec, mesh.tp)
    prepare_for_recompute(model, recompute)
    return model
