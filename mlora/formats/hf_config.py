"""HF config -> what mlora needs to build the Megatron model, with the checks that guard it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
# rope types whose inverse frequencies are static and whose cos/sin are not rescaled.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rounded up so that TP divides it; the padding never reaches callers."""
        return -(-self.vocab_size // tp) * tp


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
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {archs[0] if archs else None!r} in {path / 'config.json'}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def _rope_parameters(cfg: Any) -> dict:
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
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; supported: 'silu'")
    if getattr(cfg, "attention_bias", False) and arch != "Qwen2ForCausalLM":
        raise ValueError(f"{arch} with attention_bias=True (bias on o_proj) is not supported; supported: False")
    if getattr(cfg, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported; supported: False")
    rope = _rope_parameters(cfg)
    if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope['rope_type']!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    sliding = getattr(cfg, "sliding_window", None)
    if arch == "Qwen2ForCausalLM" and not getattr(cfg, "use_sliding_window", False):
        sliding = None
    num_heads = cfg.num_attention_heads
    num_kv = getattr(cfg, "num_key_value_heads", None) or num_heads
    if num_heads % num_kv:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
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
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(getattr(cfg, "attention_bias", False)),
        max_position_embeddings=cfg.max_position_embeddings,
        sliding_window=sliding,
        hf_config=cfg,
    )


def check_layout(spec: ModelSpec, tp: int, pp: int) -> None:
    """Raise a clear error when the model cannot be split ``tp`` × ``pp`` ways."""
    if spec.num_heads % tp:
        raise ValueError(
            f"tp={tp} does not divide num_attention_heads={spec.num_heads}; "
            f"valid tp: {_divisors(spec.num_heads, spec.num_kv_heads)}")
    if spec.num_kv_heads % tp:
        raise ValueError(
            f"tp={tp} does not divide num_key_value_heads={spec.num_kv_heads}; "
            f"valid tp: {_divisors(spec.num_heads, spec.num_kv_heads)}")
    if spec.intermediate_size % tp:
        raise ValueError(f"tp={tp} does not divide intermediate_size={spec.intermediate_size}")
    if spec.num_layers % pp:
        raise ValueError(
            f"pp={pp} does not divide num_hidden_layers={spec.num_layers}; "
            f"valid pp: {_divisors(spec.num_layers)}")


def _divisors(*values: int) -> list[int]:
    return [d for d in range(1, min(values) + 1) if all(v % d == 0 for v in values)]


def hf_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """RoPE inverse frequencies exactly as transformers computes them for this config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = _rope_parameters(spec.hf_config)
    if rope["rope_type"] == "default":
        dim = spec.head_dim
        return 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](spec.hf_config, "cpu")
    if scaling != 1.0:
        raise ValueError(f"rope_type {rope['rope_type']!r} rescales attention ({scaling}); not supported")
    return inv_freq.float()
