"""Every mixture-of-experts architecture of transformers 5.19 that mlora does not build, with what it would need.

mlora builds (``hf_config.MOE_ARCHITECTURES``: Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, GLM-4.5, DeepSeek-V3) a pre-norm
RMSNorm decoder with grouped-query attention and RoPE (GLM-4.5's partial; q/k/v bias and q/k RMSNorm where those families
have them) or DeepSeek-V3's multi-head latent attention (YaRN RoPE on its decoupled dims), SwiGLU experts without biases, a linear router with softmax then top-k (the k weights optionally
renormalised) or GLM-4.5's sigmoid routing (e_score_correction_bias, group-limited top-k, routed_scaling_factor),
Qwen2-MoE's sigmoid-gated shared expert or GLM-4.5's ungated shared experts, and dense layers where
``mlp_only_layers`` / ``decoder_sparse_step`` / ``first_k_dense_replace`` put them. Each
entry says what the family has beyond that; ``load_hf_config`` refuses a checkpoint whose first architecture is
listed here with ``needs <entry>``. ``tests/test_moe_refusals.py`` finds transformers' MoE architectures from their
configs and fails when one is neither built nor listed here, so a transformers upgrade that adds a family must add
its line.
"""

from __future__ import annotations

_DEEPSEEK_V3 = "the DeepSeek-V3 decoder (which mlora builds: DeepseekV3ForCausalLM)"
_GLM45 = "GLM-4.5's MoE decoder (which mlora builds: Glm4MoeForCausalLM)"
_QWEN3_NEXT = ("linear-attention (gated delta net) layers, which megatron-core 0.16 has no local layer for, beside "
               "output-gated full attention with partial rotary and a sigmoid-gated shared expert")
_DSA = ("multi-head latent attention with DeepSeek sparse attention (a lightning indexer choosing the top "
        "index_topk keys), sigmoid routing with e_score_correction_bias and group-limited top-k, a shared expert "
        "and dense first layers")
_GRANITE = ("muP scalings (embedding_multiplier, residual_multiplier, attention_multiplier as the softmax scale, "
            "logits_scaling) around a Mixtral-style top-k-then-softmax router")

MOE_REFUSALS: dict[str, str] = {
    # DeepSeek family and its derivatives
    "Kimi_K25ForConditionalGeneration": "a vision tower and projector in front of " + _DEEPSEEK_V3,
    "AXK1ForCausalLM": "its own architecture name for " + _DEEPSEEK_V3,
    "DeepseekV2ForCausalLM": "multi-head latent attention, softmax top-k routing (greedy or group-limited) scaled by "
                             "routed_scaling_factor, shared experts and first_k_dense_replace dense layers",
    "DeepseekV32ForCausalLM": "DeepSeek-V3.2: " + _DSA,
    "AXK2ForCausalLM": _DSA,
    "GlmMoeDsaForCausalLM": "GLM-5's layers: " + _DSA,
    "DeepseekV4ForCausalLM": "compressed sparse attention layers (with attention sinks, an indexer and a sliding "
                             "window), hash-routed MoE layers, sqrt-softplus routing with a correction bias, a shared "
                             "expert, a clamped SwiGLU, hyper-connections and multi-token prediction",
    "DeepseekOcr2ForConditionalGeneration": "vision encoders in front of a DeepSeek-V2-style MoE decoder (softmax "
                                            "top-k with routed_scaling_factor, shared experts)",
    "Mistral4ForCausalLM": "multi-head latent attention, softmax top-k routing (group-limited, routed_scaling_factor), "
                           "a shared expert and first_k_dense_replace dense layers",
    "HYV4ForCausalLM": "multi-head latent attention with an indexed sparse attention, sigmoid routing with "
                       "e_score_correction_bias, a shared expert, dense first layers and a clamped SwiGLU "
                       "(swiglu_limit)",
    "LongcatFlashForCausalLM": "multi-head latent attention, two attention and two MLP sublayers per layer around a "
                               "shortcut-connected MoE, zero-computation experts and softmax routing with "
                               "e_score_correction_bias",
    "KimiLinearForCausalLM": "Kimi delta attention (linear-attention) layers, which megatron-core 0.16 has no local "
                             "layer for, between multi-head latent attention layers without RoPE, sigmoid routing "
                             "with a correction bias, a shared expert and dense first layers",
    # GLM
    "Glm4MoeLiteForCausalLM": "multi-head latent attention (q/kv low-rank projections, decoupled RoPE head) in "
                              + _GLM45,
    "Glm4vMoeForConditionalGeneration": "a vision tower and 3D (multimodal) RoPE in front of " + _GLM45,
    "Glm5NextForConditionalGeneration": "linear-attention layers, which megatron-core 0.16 has no local layer for, "
                                        "between indexed multi-head latent attention layers, sigmoid routing with a "
                                        "correction bias, a shared expert and a clamped SwiGLU",
    # Qwen
    "Qwen3NextForCausalLM": _QWEN3_NEXT,
    "Qwen3_5MoeForCausalLM": _QWEN3_NEXT + " (Qwen3.5/3.6-MoE)",
    "Qwen3_5MoeForConditionalGeneration": _QWEN3_NEXT + ", and a vision tower with 3D (multimodal) RoPE",
    "Qwen4ExpForCausalLM": "linear-attention (gated delta net) layers, which megatron-core 0.16 has no local layer "
                           "for, beside indexed sparse attention layers and a gated shared expert",
    "Qwen4ExpForConditionalGeneration": "linear-attention (gated delta net) layers, which megatron-core 0.16 has no "
                                        "local layer for, indexed sparse attention, a gated shared expert and a vision "
                                        "tower",
    "Qwen3VLMoeForConditionalGeneration": "a vision tower with DeepStack feature injection and interleaved 3D "
                                          "(multimodal) RoPE in front of a Qwen3-MoE decoder",
    "Qwen3OmniMoeForConditionalGeneration": "audio and vision encoders, 3D (multimodal) RoPE and a talker model "
                                            "around a Qwen3-MoE thinker",
    "Qwen3OmniMoeThinkerForConditionalGeneration": "audio and vision encoders and 3D (multimodal) RoPE in front of "
                                                   "a Qwen3-MoE decoder",
    # Meta
    "Llama4ForCausalLM": "chunked local attention interleaved with NoPE global layers, L2 q/k norm and attention "
                         "temperature tuning, sigmoid top-k routing applied to the expert input, a shared expert and "
                         "MoE on interleaved layers",
    "Llama4ForConditionalGeneration": "a vision tower in front of a Llama-4 decoder: chunked local attention with NoPE "
                                      "global layers, L2 q/k norm, sigmoid top-k routing and a shared expert",
    # MiniMax
    "MiniMaxForCausalLM": "lightning (linear) attention layers, which megatron-core 0.16 has no local layer for, "
                          "between softmax attention layers",
    "MiniMaxM2ForCausalLM": "sigmoid routing with e_score_correction_bias, q/k RMSNorm over all heads' width and "
                            "partial rotary (rotary_dim)",
    "MiniMaxM3VLForCausalLM": "block-indexed sparse attention, sigmoid routing with a correction bias, a shared "
                              "expert, a clamped SwiGLU and partial rotary",
    "MiniMaxM3SparseForConditionalGeneration": "a vision tower in front of a MiniMax-M3 decoder: block-indexed sparse "
                                               "attention, sigmoid routing with a correction bias, a shared expert, "
                                               "a clamped SwiGLU",
    # Baidu
    "Ernie4_5_MoeForCausalLM": "softmax routing that selects with e_score_correction_bias (moe_statics), shared "
                               "experts, MoE only between moe_layer_start_index and moe_layer_end_index every "
                               "moe_layer_interval, and optional linear biases (use_bias)",
    "Ernie4_5_VLMoeForConditionalGeneration": "a vision tower, 3D (multimodal) RoPE and separate text and vision "
                                              "expert groups of different widths, with ERNIE-4.5's bias-corrected "
                                              "softmax routing and shared experts",
    # Tencent
    "HunYuanMoEV1ForCausalLM": "q/k RMSNorm applied after RoPE, an always-on ungated shared MLP and a per-layer "
                               "top-k (moe_topk)",
    "HYV3ForCausalLM": "sigmoid routing with e_score_correction_bias and a router scaling factor, a shared expert "
                       "and dense first layers (mlp_layer_types)",
    # others, alphabetical by family
    "AfmoeForCausalLM": "sigmoid routing with an expert bias, shared experts, dense first layers, output-gated "
                        "attention, sliding-window/global layers, sandwich norms around the MLP and optional muP",
    "AriaTextForCausalLM": "ungated shared experts beside the routed ones (moe_num_shared_experts)",
    "AriaForConditionalGeneration": "a vision tower and cross-attention projector in front of an Aria decoder with "
                                    "ungated shared experts",
    "Cohere2MoeForCausalLM": "parallel attention and MLP from one LayerNorm, sliding-window layers with NoPE global "
                             "layers, sigmoid or softmax selection after top-k and averaged shared experts",
    "DbrxForCausalLM": "a fused Wqkv with clip_qkv, LayerNorm without bias instead of RMSNorm and p-norm "
                       "renormalised routing weights (moe_normalize_expert_weights)",
    "DiffusionGemmaForBlockDiffusion": "block-diffusion decoding (bidirectional attention in a block), not a causal "
                                       "LM, on Gemma's layers with an optional MoE block",
    "DogeForCausalLM": "dynamic-mask attention and, with is_moe, a cross-domain MoE of single-neuron experts "
                       "retrieved by product keys",
    "Dots1ForCausalLM": "sigmoid routing with e_score_correction_bias and group-limited top-k, a shared expert and "
                        "first_k_dense_replace dense layers",
    "ExaoneMoeForCausalLM": "sigmoid routing with e_score_correction_bias and group-limited top-k, a shared expert, "
                            "dense first layers and sliding-window layers with NoPE global layers",
    "FlexOlmoForCausalLM": "OLMo-2 post-sublayer norms (RMSNorm after attention and MLP, none before) with q/k "
                           "RMSNorm over all heads' width",
    "Gemma4ForCausalLM": "with enable_moe_block, an MoE block beside the dense MLP whose router has its own norm, "
                         "scale and per-expert scale, GELU-tanh experts, Gemma's sandwich norms, sliding-window "
                         "layers, shared KV layers and logit soft-capping",
    "Gemma4ForConditionalGeneration": "vision and audio towers in front of a Gemma-4 decoder whose MoE block sits "
                                      "beside the dense MLP with a per-expert scale, GELU-tanh experts",
    "GraniteMoeForCausalLM": _GRANITE,
    "GraniteMoeSharedForCausalLM": _GRANITE + ", and a shared MLP (shared_intermediate_size)",
    "GraniteMoeHybridForCausalLM": "Mamba-2 layers, which megatron-core 0.16 has no local layer for, and " + _GRANITE,
    "GraniteMoeSWAForCausalLM": "attention sinks with sliding-window layers and " + _GRANITE,
    "InklingForCausalLM": "attention with a learned relative-position logit bias, short convolutions, sliding-window "
                          "layers, sigmoid routing with e_score_correction_bias whose weights also scale the shared "
                          "experts (shared_expert_sink), muP logits and multi-token prediction",
    "InklingForConditionalGeneration": "audio and vision encoders in front of an Inkling decoder (relative-position "
                                       "logit bias, short convolutions, sigmoid routing with a correction bias that "
                                       "also weights the shared experts)",
    "JambaForCausalLM": "Mamba layers, which megatron-core 0.16 has no local layer for, with attention every "
                        "attn_layer_period layers and MoE every expert_layer_period layers",
    "JetMoeForCausalLM": "mixture-of-attention-heads (routed query and output projections) and experts with an "
                         "output bias, routed by top-k then softmax",
    "LagunaForCausalLM": "sigmoid routing with e_score_correction_bias and router logit soft-capping, a shared "
                         "expert, per-layer head counts, sliding-window layers and dense first layers",
    "Lfm2MoeForCausalLM": "short-convolution layers between attention layers, sigmoid routing with an expert bias "
                          "and dense first layers",
    "MellumForCausalLM": "per-layer sliding-window attention with per-layer-type RoPE parameters (partial rotary) "
                         "and dense layers set by mlp_layer_types",
    "MiMoV2FlashForCausalLM": "alternating sliding-window attention with attention sinks, a value head dim unlike "
                              "the q/k one, partial rotary, sigmoid routing with e_score_correction_bias and "
                              "group-limited top-k, and dense first layers",
    "NemotronHForCausalLM": "Mamba-2 layers, which megatron-core 0.16 has no local layer for, squared-ReLU "
                            "(non-gated) experts, sigmoid routing with a correction bias and a shared expert",
    "NemotronH_Omni_Reasoning_V3": "vision and audio encoders in front of a Nemotron-H decoder: Mamba-2 layers, "
                                   "squared-ReLU experts, sigmoid routing with a correction bias, a shared expert",
    "PhimoeForCausalLM": "sparsemixer top-2 routing, LayerNorm with bias instead of RMSNorm and a biased lm_head",
    "SolarOpenForCausalLM": "sigmoid routing with e_score_correction_bias and group-limited top-k scaled by "
                            "routed_scaling_factor, and a shared expert",
    "Step3p7ForConditionalGeneration": "a vision tower in front of a decoder with output-gated attention, "
                                       "sliding-window layers, sigmoid routing with e_score_correction_bias, a "
                                       "shared expert, a clamped SwiGLU and partial rotary",
    "ZayaForCausalLM": "compressed convolutional attention, an MLP router with bias balancing and learned residual "
                       "scaling",
    # encoder-decoder MoE translation/T5 models
    "NllbMoeForConditionalGeneration": "an encoder-decoder (not a decoder-only causal LM) with top-2 capacity-limited "
                                       "routing",
    "SwitchTransformersForConditionalGeneration": "an encoder-decoder T5 (not a decoder-only causal LM) with top-1 "
                                                  "capacity-limited routing",
}
