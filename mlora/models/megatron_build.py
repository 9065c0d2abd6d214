"""HF model facts + mesh -> megatron-core TransformerConfig, layer spec and GPTModel for this rank."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from mlora.lora.adapters import attach_lora_sites
from mlora.models.hf_config import ModelSpec, hf_inv_freq
from mlora.models.norm import RMSNorm
from mlora.parallel.mesh import Mesh


def transformer_config(spec: ModelSpec, mesh: Mesh, dtype: torch.dtype):
    """The megatron TransformerConfig that reproduces ``spec`` on ``mesh`` (no fusions on CPU)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = mesh.device.type == "cuda"
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
    )


def block_spec(config):
    """megatron's local GPT layer spec with two swaps: mlora's RMSNorm (SP-capable) in every norm
    slot and LoRA-capable parallel linears in every linear slot."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from mlora.lora.layers import LoraColumnParallelLinear, LoraRowParallelLinear

    layer = get_gpt_layer_local_spec(normalization="RMSNorm")
    sub = layer.submodules
    sub.self_attention.submodules = dataclasses.replace(
        sub.self_attention.submodules, linear_qkv=LoraColumnParallelLinear, linear_proj=LoraRowParallelLinear)
    sub.mlp.submodules = dataclasses.replace(
        sub.mlp.submodules, linear_fc1=LoraColumnParallelLinear, linear_fc2=LoraRowParallelLinear)
    layer.submodules = dataclasses.replace(sub, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm)
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=RMSNorm)


def build_gpt_model(spec: ModelSpec, mesh: Mesh, dtype: torch.dtype, fp8: str | None = None,
                    fp8_recipe: str = "delayed"):
    """This rank's GPTModel shard, parameters allocated but not initialised, base frozen.

    ``fp8="torch"``: the LoRA linears allocate their weights in float8_e4m3fn with a float32
    ``weight_scale`` per output row (see :mod:`mlora.fp8`); everything else stays in ``dtype``.
    ``fp8="te"``: Transformer Engine's layer spec with the same LoRA (:func:`mlora.fp8.te.te_block_spec`)
    and megatron's own ``fp8_autocast`` around the block with ``fp8_recipe`` (UNVERIFIED: no TE run yet)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from mlora.lora.layers import FP8_CONFIG_ATTR

    config = transformer_config(spec, mesh, dtype)
    setattr(config, FP8_CONFIG_ATTR, fp8)
    layer_spec = block_spec
    if fp8 == "te":
        from mlora.fp8.te import megatron_fp8_settings, te_block_spec

        for key, value in megatron_fp8_settings(fp8_recipe).items():
            setattr(config, key, value)
        layer_spec = te_block_spec
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config),
        vocab_size=spec.padded_vocab_size(mesh.tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=mesh.is_first_stage,
        post_process=mesh.is_last_stage,
        share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
        parallel_output=True,
    )
    # transformers' own inverse frequencies (covers linear and llama3 scaling exactly).
    model.rotary_pos_emb.inv_freq = hf_inv_freq(spec).to(mesh.device)
    model.to(mesh.device)
    for p in model.parameters():
        p.requires_grad_(False)
    attach_lora_sites(model, spec, mesh.tp)
    return model
