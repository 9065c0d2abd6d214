"""HF model facts + mesh -> megatron-core TransformerConfig, layer spec and GPTModel for this rank."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from mlora.formats.hf_config import ModelSpec, hf_inv_freq
from mlora.lora.sites import attach_lora_sites
from mlora.models.attention import ATTENTION_CONFIG_ATTR, WINDOW_CONFIG_ATTR, SDPAttention, check_attention_arg
from mlora.models.norm import RMSNorm
from mlora.models.recompute import Recompute, prepare_for_recompute
from mlora.parallel.mesh import Mesh


def transformer_config(spec: ModelSpec, mesh: Mesh, dtype: torch.dtype, recompute: Recompute | None = None):
    """The megatron TransformerConfig that reproduces ``spec`` on ``mesh`` (no fusions on CPU), with
    megatron's activation recompute as ``recompute`` says (default: none; see :mod:`mlora.models.recompute`)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = mesh.device.type == "cuda"
    recompute = recompute or Recompute()
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
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
        **recompute.config_kwargs(),
    )



def gpt_model(spec: ModelSpec, mesh, config, layer_spec, vocab_size: int):
    """This rank's megatron ``GPTModel`` (its pipeline stage, vocab-parallel output) for ``spec`` with
    ``layer_spec``, on the mesh's device, RoPE with transformers' own inverse frequencies (they cover
    linear and llama3 scaling exactly; RoPE is not a parameter, so no checkpoint carries it)."""
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
        parallel_output=True,
    )
    model.rotary_pos_emb.inv_freq = hf_inv_freq(spec).to(mesh.device)
    return model.to(mesh.device)

def block_spec(config):
    """megatron's local GPT layer spec with three swaps: mlora's RMSNorm (SP-capable) in every norm
    slot, LoRA-capable parallel linears in every linear slot and, unless the config's
    ``mlora_attention`` (set by :func:`build_gpt_model`) says ``"unfused"``, :class:`SDPAttention`
    (torch's fused scaled_dot_product_attention) in the core-attention slot."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from mlora.lora.layers import LoraColumnParallelLinear, LoraRowParallelLinear

    layer = get_gpt_layer_local_spec(normalization="RMSNorm")
    sub = layer.submodules
    attention = {"linear_qkv": LoraColumnParallelLinear, "linear_proj": LoraRowParallelLinear}
    if getattr(config, ATTENTION_CONFIG_ATTR, "sdpa") == "sdpa":  # "unfused" keeps megatron's DotProductAttention
        attention["core_attention"] = SDPAttention
    sub.self_attention.submodules = dataclasses.replace(sub.self_attention.submodules, **attention)
    sub.mlp.submodules = dataclasses.replace(
        sub.mlp.submodules, linear_fc1=LoraColumnParallelLinear, linear_fc2=LoraRowParallelLinear)
    layer.submodules = dataclasses.replace(sub, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm)
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=RMSNorm)


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
    config = transformer_config(spec, mesh, dtype, recompute)
    setattr(config, FP8_CONFIG_ATTR, fp8)
    setattr(config, ATTENTION_CONFIG_ATTR, check_attention_arg(attention))
    setattr(config, WINDOW_CONFIG_ATTR, spec.sliding_window)
    layer_spec = block_spec
    if fp8 == "te":
        from mlora.models.te import megatron_fp8_settings, te_block_spec

        for key, value in megatron_fp8_settings(fp8_recipe).items():
            setattr(config, key, value)
        layer_spec = te_block_spec
    model = gpt_model(spec, mesh, config, layer_spec(config), spec.padded_vocab_size(mesh.tp))
    for p in model.parameters():
        p.requires_grad_(False)
    attach_lora_sites(model, spec, mesh.tp)
    prepare_for_recompute(model, recompute)
    return model
