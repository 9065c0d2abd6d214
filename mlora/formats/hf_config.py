"""HF config -> what mlora needs to build the Megatron model, with the checks that guard it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlora.formats.moe_refusals import MOE_REFUSALS

# mixture-of-experts architectures: experts, router and their HF names (see MoESpec)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "OlmoeForCausalLM",
                     "Glm4MoeForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM")
# multi-head latent attention (MLASpec) in place of grouped-query attention
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
                           *MOE_ARCHITECTURES)
# q/k/v bias on (their config's qkv_bias, Qwen2-MoE's; True when absent), no bias on o_proj
QKV_BIAS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
# attention_bias puts a bias on q/k/v only, never on o_proj (GLM-4.5)
ATTENTION_BIAS_ON_QKV = ("Glm4MoeForCausalLM",)
# q/k RMSNorm before RoPE: over each head's head_dim (Qwen3) or over all heads at once (OLMoE)
QK_NORM = {"Qwen3ForCausalLM": "head", "Qwen3MoeForCausalLM": "head", "OlmoeForCausalLM": "full"}
# RoPE on part of each head (partial_rotary_factor in rope_parameters)
PARTIAL_ROTARY = ("Glm4MoeForCausalLM",)
# gpt-oss: attention sinks, biases on q/k/v/o, the router and the experts, a clamped SwiGLU, alternating windows
GPT_OSS = "GptOssForCausalLM"
# the SwiGLU constants megatron-core's quick_gelu and vLLM's CPU kernel hard-code (transformers reads the config's)
GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
# every other mixture-of-experts architecture transformers has, with what it would need (mlora/formats/moe_refusals.py)
MOE_NOT_YET = MOE_REFUSALS


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts facts of a model: ``num_experts`` experts of FFN width ``ffn_size`` per sparse
    layer, each token sent to ``top_k`` of them by a linear router (softmax over all experts, then top-k;
    ``normalize_topk``: the k weights rescaled to sum to 1, which is Mixtral's top-k-then-softmax), and
    the HF names of one expert's projections and of the block that holds them. ``shared_ffn_size``: the FFN
    width of a shared expert every token goes through beside the routed ones, its output scaled by
    ``sigmoid(x · shared_expert_gate)`` (Qwen2-MoE: ``{block}.shared_expert`` and ``{block}.shared_expert_gate``,
    projections named gate_proj/up_proj/down_proj); None: no shared expert. ``shared_name``: the shared expert's
    HF module below the block (GLM-4.5's ``shared_experts``: ``n_shared_experts`` experts as one MLP);
    ``shared_gate``: whether its output has the sigmoid gate (GLM-4.5's has none).

    ``score``: the router's score function, ``"softmax"`` or ``"sigmoid"`` (GLM-4.5, DeepSeek-V3: sigmoid scores,
    the top-k chosen on the scores plus a fixed per-expert ``e_score_correction_bias`` when ``expert_bias``, the
    k weights the unbiased scores renormalised, then times ``scaling``, HF's ``routed_scaling_factor``).
    ``groups``: ``(n_group, topk_group)`` when the top-k is group-limited (the experts split into n_group
    groups, each ranked by the sum of its two best scores, the top-k taken within the topk_group best).
    ``router_fp32``: the router's GEMM runs in float32 (GLM-4.5, as transformers and vLLM run it), else in the
    model's dtype, as transformers and vLLM run Qwen-MoE's, Mixtral's and OLMoE's: in bf16 the trainer then
    picks the engine's experts for the same router input (``bench/moe_bf16_routing.py``)."""

    num_experts: int
    top_k: int
    ffn_size: int
    normalize_topk: bool
    sparse_layers: tuple[int, ...]  # the others are dense MLPs of the model's intermediate_size
    block: str  # HF module holding router and experts: "mlp" or Mixtral's "block_sparse_moe"
    projections: tuple[str, str, str]  # HF names of an expert's gate, up and down projections
    shared_ffn_size: int | None = None
    shared_name: str = "shared_expert"
    shared_gate: bool = True
    score: str = "softmax"
    expert_bias: bool = False
    scaling: float | None = None
    groups: tuple[int, int] | None = None
    router_fp32: bool = False
    router_name: str = "gate"  # the router's HF module below the block (gpt-oss: router)
    # gpt-oss: the experts held stacked as transformers holds them (gate_up_proj [E, hidden, 2·ffn], gate and up
    # columns interleaved, down_proj [E, ffn, hidden], biases), a SwiGLU clamped at ``GPT_OSS_SWIGLU``'s limit with
    # ``(up + 1)``, biases on the router and the experts (mlora.formats.fused_experts)
    gpt_oss: bool = False
# rope types whose inverse frequencies are static and whose cos/sin are not rescaled.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# with multi-head latent attention also YaRN, whose cos/sin scale (attention_factor) MLA's rotary embedding applies
MLA_ROPE_TYPES = (*SUPPORTED_ROPE_TYPES, "yarn")


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V3): queries through a ``q_lora_rank`` bottleneck (``q_a_proj``, its
    RMSNorm, ``q_b_proj``; None: one ``q_proj``), keys and values through a ``kv_lora_rank`` one
    (``kv_a_proj_with_mqa``, which also gives the ``qk_rope_head_dim`` RoPE dims shared by every head, its RMSNorm,
    ``kv_b_proj``); per head ``qk_nope_head_dim`` + ``qk_rope_head_dim`` query/key dims and ``v_head_dim`` value
    dims; RoPE on the decoupled dims in transformers' interleaved layout (``rope_interleave``), YaRN allowed."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts of a decoder-only HF model, independent of the mesh."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    tied_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    sliding_window: int | None
    hf_config: Any  # the transformers PretrainedConfig
    qk_norm: str | None = None  # None, "head" (RMSNorm over head_dim) or "full" (over all heads' width)
    moe: MoESpec | None = None
    rotary_percent: float = 1.0  # RoPE on the first rotary_percent of each head's dims (GLM-4.5: 0.5), the rest as is
    mla: MLASpec | None = None  # multi-head latent attention (DeepSeek-V3) in place of grouped-query attention
    # gpt-oss: a learned sink logit per head joins each softmax; biases on o_proj (and router, experts); a sliding
    # window per layer (None: full attention), where ``sliding_window`` (None then) would give every layer one
    attention_sinks: bool = False
    linear_bias: bool = False
    layer_windows: tuple[int | None, ...] | None = None

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dims RoPE rotates (transformers' ``int(head_dim * partial_rotary_factor)``)."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """Global indices of the mixture-of-experts layers (none for a dense model)."""
        return self.moe.sparse_layers if self.moe is not None else ()

    def is_sparse(self, layer: int) -> bool:
        """True when decoder layer ``layer`` (global index) is a mixture of experts."""
        return layer in self.sparse_layers

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rounded up so that TP divides it; the padding never reaches callers."""
        return -(-self.vocab_size // tp) * tp


def is_moe_checkpoint(hf_dir: str | os.PathLike | None) -> bool:
    """Whether the HF directory ``hf_dir`` holds a mixture of experts mlora builds, from its ``config.json``'s
    ``architectures`` alone (False when it cannot be read: the loader says what is wrong with it)."""
    try:
        config = json.loads((Path(str(hf_dir)).expanduser() / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False
    return any(a in MOE_ARCHITECTURES for a in config.get("architectures") or ())


def load_hf_config(hf_dir: str | os.PathLike) -> Any:
    """The transformers config of ``hf_dir``, with clear errors for a missing or foreign directory."""
    path = Path(hf_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{str(path)!r} has no config.json: expected a Hugging Face model directory "
            "(config.json and *.safetensors, as written by save_pretrained)")
    raw = json.loads((path / "config.json").read_text())
    archs = raw.get("architectures") or []
    if archs and archs[0] in MOE_NOT_YET:
        raise ValueError(f"architecture {archs[0]!r} in {path / 'config.json'} needs {MOE_NOT_YET[archs[0]]}, "
                         f"which mlora does not build; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {archs[0] if archs else None!r} in {path / 'config.json'}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def rope_parameters(cfg: Any) -> dict:
    """The config's RoPE parameters (transformers 5's ``rope_parameters``; older configs' ``rope_scaling`` and
    ``rope_theta``), with ``rope_type`` set."""
    params = getattr(cfg, "rope_parameters", None)
    if params is None:  # transformers < 5 keeps them apart
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def model_spec(cfg: Any) -> ModelSpec:
    """Read the architecture facts of an HF config, rejecting what mlora cannot reproduce exactly."""
    arch = (cfg.architectures or [None])[0]
    if arch in MOE_NOT_YET:
        raise ValueError(f"architecture {arch!r} needs {MOE_NOT_YET[arch]}, which mlora does not build; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; supported: 'silu'")
    if getattr(cfg, "attention_bias", False) and arch not in QKV_BIAS + ATTENTION_BIAS_ON_QKV + (GPT_OSS,):
        raise ValueError(f"{arch} with attention_bias=True (bias on o_proj) is not supported; supported: False")
    if getattr(cfg, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported; supported: False")
    rope = rope_parameters(cfg)
    rope_types = MLA_ROPE_TYPES if arch in MLA_ARCHITECTURES + (GPT_OSS,) else SUPPORTED_ROPE_TYPES
    if rope["rope_type"] not in rope_types:
        raise ValueError(f"unsupported rope_type {rope['rope_type']!r} for {arch}; supported: {', '.join(rope_types)}")
    partial = float(rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0 and (rope["rope_type"] != "default" or arch not in PARTIAL_ROTARY):
        raise ValueError(f"{arch} with partial_rotary_factor={partial} and rope_type {rope['rope_type']!r} is not "
                         "supported; supported: partial rotary with rope_type 'default' on "
                         f"{', '.join(PARTIAL_ROTARY)}, full rotary (1.0) otherwise")
    sliding = getattr(cfg, "sliding_window", None)
    if arch == "Qwen2ForCausalLM" and not getattr(cfg, "use_sliding_window", False):
        sliding = None
    num_heads = cfg.num_attention_heads
    num_kv = getattr(cfg, "num_key_value_heads", None) or num_heads
    if num_heads % num_kv:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError(f"{arch} with use_sliding_window=True is not supported; supported: False")
        sliding = None
    qk_norm = QK_NORM.get(arch)
    if arch == "Glm4MoeForCausalLM":
        qk_norm = "head" if getattr(cfg, "use_qk_norm", False) else None
    if arch == "OlmoeForCausalLM" and getattr(cfg, "clip_qkv", None) is not None:
        raise ValueError(f"OlmoeForCausalLM with clip_qkv={cfg.clip_qkv} is not supported; supported: None")
    windows = _gpt_oss_windows(cfg) if arch == GPT_OSS else None
    if windows is not None:
        sliding = None
    return ModelSpec(
        architecture=arch,
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        norm_eps=cfg.rms_norm_eps,
        rope_theta=float(rope["rope_theta"]),
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=(bool(getattr(cfg, "qkv_bias", True)) if arch in QKV_BIAS
                  else bool(getattr(cfg, "attention_bias", False))),
        max_position_embeddings=cfg.max_position_embeddings,
        sliding_window=sliding,
        hf_config=cfg,
        qk_norm=qk_norm,
        moe=_moe_spec(arch, cfg) if arch in MOE_ARCHITECTURES else None,
        rotary_percent=partial,
        mla=_mla_spec(arch, cfg) if arch in MLA_ARCHITECTURES else None,
        attention_sinks=arch == GPT_OSS,
        linear_bias=arch == GPT_OSS,
        layer_windows=windows,
    )


def _gpt_oss_windows(cfg: Any) -> tuple[int | None, ...]:
    """gpt-oss's window per layer (``layer_types``: sliding_attention or full_attention), refusing the SwiGLU
    constants megatron-core and vLLM do not take from the config."""
    for key, value in GPT_OSS_SWIGLU.items():
        if float(getattr(cfg, key, value)) != value:
            raise ValueError(f"{GPT_OSS} with {key}={getattr(cfg, key)} is not supported (megatron-core's quick_gelu "
                             f"and vLLM's CPU kernel compute {', '.join(f'{k}={v}' for k, v in GPT_OSS_SWIGLU.items())}"
                             f"); supported: {value}")
    types = list(cfg.layer_types or ())
    kinds = {"sliding_attention", "full_attention"}
    if len(types) != cfg.num_hidden_layers or not set(types) <= kinds:
        raise ValueError(f"{GPT_OSS}: layer_types={types}; valid: one of {sorted(kinds)} per layer "
                         f"({cfg.num_hidden_layers})")
    window = cfg.sliding_window
    if "sliding_attention" in types and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{GPT_OSS}: sliding_window={window!r} with sliding_attention layers; valid: an int >= 1")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _mla_spec(arch: str, cfg: Any) -> MLASpec:
    """DeepSeek-V3's attention facts, refusing what megatron-core's MLA computes otherwise."""
    if not getattr(cfg, "rope_interleave", True):
        # megatron's MLA reads the decoupled RoPE dims interleaved (pairs 2i, 2i+1), as transformers does with
        # rope_interleave=True, DeepSeek-V3's checkpoints' setting
        raise ValueError(f"{arch} with rope_interleave=False is not supported (megatron-core's multi-latent attention "
                         "rotates interleaved pairs); supported: True")
    q_lora = getattr(cfg, "q_lora_rank", None)
    return MLASpec(q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(cfg.kv_lora_rank),
                   qk_nope_head_dim=int(cfg.qk_nope_head_dim), qk_rope_head_dim=int(cfg.qk_rope_head_dim),
                   v_head_dim=int(cfg.v_head_dim))


def _moe_spec(arch: str, cfg: Any) -> MoESpec:
    """The MoE facts of an HF MoE config (transformers 5 names; older ones where they differ)."""
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    top_k = cfg.num_experts_per_tok
    if not experts or not 1 <= top_k <= experts:
        raise ValueError(f"{arch}: num_experts_per_tok={top_k} with {experts} experts; valid: 1..{experts}")
    layers = range(cfg.num_hidden_layers)
    if arch == "MixtralForCausalLM":
        if getattr(cfg, "router_jitter_noise", 0.0):
            raise ValueError(f"MixtralForCausalLM with router_jitter_noise={cfg.router_jitter_noise} is not supported "
                             "(training-time noise on a frozen router); supported: 0.0")
        return MoESpec(experts, top_k, cfg.intermediate_size, True, tuple(layers), "block_sparse_moe",
                       ("w1", "w3", "w2"))
    if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):  # dense MLPs where mlp_only_layers or
        # decoder_sparse_step say so; Qwen2-MoE adds a gated shared expert to each sparse layer
        step, dense = getattr(cfg, "decoder_sparse_step", 1) or 1, set(getattr(cfg, "mlp_only_layers", None) or ())
        sparse = tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
        shared = cfg.shared_expert_intermediate_size if arch == "Qwen2MoeForCausalLM" else None
        if shared is not None and shared <= 0:
            raise ValueError(f"{arch}: shared_expert_intermediate_size={shared}; valid: > 0")
        return MoESpec(experts, top_k, cfg.moe_intermediate_size, bool(cfg.norm_topk_prob), sparse, "mlp",
                       ("gate_proj", "up_proj", "down_proj"), shared)
    if arch in ("Glm4MoeForCausalLM", "DeepseekV3ForCausalLM"):
        return _sigmoid_moe_spec(arch, cfg, experts, top_k)
    if arch == GPT_OSS:  # every layer sparse; top-k of the router's logits, then softmax over those k
        return MoESpec(experts, top_k, cfg.intermediate_size, True, tuple(layers), "mlp",
                       ("gate_proj", "up_proj", "down_proj"), router_name="router", gpt_oss=True)
    return MoESpec(experts, top_k, cfg.intermediate_size, bool(getattr(cfg, "norm_topk_prob", False)), tuple(layers),
                   "mlp", ("gate_proj", "up_proj", "down_proj"))


def _sigmoid_moe_spec(arch: str, cfg: Any, experts: int, top_k: int) -> MoESpec:
    """GLM-4.5's (and DeepSeek-V3's) MoE: the first ``first_k_dense_replace`` layers dense, then sigmoid routing
    with the correction bias, group-limited top-k, renormalised weights times ``routed_scaling_factor``, and
    ``n_shared_experts`` ungated shared experts as one MLP of ``n_shared_experts × moe_intermediate_size``."""
    for key, value in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        # DeepSeek-V3 checkpoints say how vLLM routes them; transformers always routes as these values say
        if getattr(cfg, key, value) != value:
            raise ValueError(f"{arch} with {key}={getattr(cfg, key)!r} is not supported (transformers routes every "
                             f"{arch} as {key}={value!r}, vLLM as the config says); supported: {value!r}")
    if not cfg.norm_topk_prob:
        # megatron's sigmoid router always renormalises the k weights (top_k > 1)
        raise ValueError(f"{arch} with norm_topk_prob=False is not supported (megatron-core's sigmoid router "
                         "renormalises the top-k weights); supported: True")
    groups = None
    n_group, topk_group = int(cfg.n_group or 1), int(cfg.topk_group or 1)
    if n_group > 1:
        if experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"{arch}: n_group={n_group}, topk_group={topk_group} with {experts} experts; valid: "
                             "n_group dividing the experts and 1 <= topk_group <= n_group")
        if top_k // topk_group != 2:
            # transformers ranks a group by its two best scores; megatron-core by its top_k // topk_group best
            raise ValueError(f"{arch} with num_experts_per_tok={top_k} and topk_group={topk_group}: megatron-core "
                             f"ranks a group by its {top_k // topk_group} best scores, transformers by its 2 best; "
                             "supported: num_experts_per_tok // topk_group == 2, or n_group=1")
        groups = (n_group, topk_group)
    dense = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
    shared = int(getattr(cfg, "n_shared_experts", 0) or 0) * cfg.moe_intermediate_size
    scaling = float(cfg.routed_scaling_factor)
    return MoESpec(experts, top_k, cfg.moe_intermediate_size, True, tuple(range(dense, cfg.num_hidden_layers)), "mlp",
                   ("gate_proj", "up_proj", "down_proj"), shared or None, shared_name="shared_experts",
                   shared_gate=False, score="sigmoid", expert_bias=True,
                   scaling=None if scaling == 1.0 else scaling, groups=groups, router_fp32=True)


def check_layout(spec: ModelSpec, tp: int, pp: int, ep: int = 1) -> None:
    """Raise a clear error when the model cannot be split ``tp`` × ``pp`` (× ``ep`` over its experts) ways."""
    if ep != 1 and spec.moe is None:
        raise ValueError(f"ep={ep} (expert parallelism) on {spec.architecture}, which has no experts; valid: ep=1")
    if spec.moe is not None and spec.moe.num_experts % ep:
        raise ValueError(f"ep={ep} does not divide the {spec.moe.num_experts} experts of {spec.architecture}; "
                         f"valid ep: {[d for d in range(1, spec.moe.num_experts + 1) if spec.moe.num_experts % d == 0]}")
    if spec.num_heads % tp:
        raise ValueError(
            f"tp={tp} does not divide num_attention_heads={spec.num_heads}; "
            f"valid tp: {_divisors(spec.num_heads, spec.num_kv_heads)}")
    if spec.num_kv_heads % tp:
        raise ValueError(
            f"tp={tp} does not divide num_key_value_heads={spec.num_kv_heads}; "
            f"valid tp: {_divisors(spec.num_heads, spec.num_kv_heads)}")
    dense_mlp = spec.moe is None or len(spec.moe.sparse_layers) < spec.num_layers  # experts are not TP-split
    if dense_mlp and spec.intermediate_size % tp:
        raise ValueError(f"tp={tp} does not divide intermediate_size={spec.intermediate_size}")
    shared = spec.moe.shared_ffn_size if spec.moe is not None else None  # a shared expert is TP-split
    if shared is not None and shared % tp:
        raise ValueError(f"tp={tp} does not divide shared_expert_intermediate_size={shared}")
    if spec.num_layers % pp:
        raise ValueError(
            f"pp={pp} does not divide num_hidden_layers={spec.num_layers}; "
            f"valid pp: {_divisors(spec.num_layers)}")


def _divisors(*values: int) -> list[int]:
    return [d for d in range(1, min(values) + 1) if all(v % d == 0 for v in values)]


def hf_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """RoPE inverse frequencies exactly as transformers computes them for this config."""
    inv_freq, scaling = hf_rope(spec)
    if scaling != 1.0:
        raise ValueError(f"rope_type {rope_parameters(spec.hf_config)['rope_type']!r} rescales attention ({scaling}); "
                         "not supported")
    return inv_freq


def hf_rope(spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and the factor cos and sin are scaled by (YaRN's ``attention_factor``; 1.0 for the
    others), exactly as transformers computes them for this config (over ``spec.rotary_dim`` dims)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = rope_parameters(spec.hf_config)
    if rope["rope_type"] == "default":
        dim = spec.rotary_dim
        return 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](spec.hf_config, "cpu")
    return inv_freq.float(), float(factor)
