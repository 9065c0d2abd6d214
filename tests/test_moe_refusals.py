"""Every mixture-of-experts architecture transformers has is either built by mlora or refused saying what it needs."""

from __future__ import annotations

import inspect
import json

import pytest

from mlora.formats.hf_config import MOE_ARCHITECTURES, MOE_NOT_YET, SUPPORTED_ARCHITECTURES, load_hf_config, model_spec
from mlora.formats.moe_refusals import MOE_REFUSALS

# config fields that only a mixture of experts has (transformers 5 names and the families' own)
MOE_FIELDS = frozenset({"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
                        "moe_intermediate_size", "num_experts_per_tok", "num_experts_per_token", "top_k_experts"})
# the generation heads of decoder models: causal LMs, their multimodal wrappers and the seq2seq ones
MAPPINGS = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
            "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES")


def _declared_fields(cls: type, seen: set) -> set:
    """MoE fields a config class (or one of its sub-config classes) declares, set or not by default: catches
    families whose experts are opt-in (Gemma-4's ``enable_moe_block``)."""
    if cls in seen:
        return set()
    seen.add(cls)
    names: set = set()
    for c in cls.__mro__:
        names |= set(getattr(c, "__annotations__", None) or ()) | set(getattr(c, "attribute_map", None) or ())
    try:
        names |= set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        pass
    found = names & MOE_FIELDS
    for sub in (getattr(cls, "sub_configs", None) or {}).values():
        if isinstance(sub, type):
            found |= _declared_fields(sub, seen)
    return found


def _set_fields(value) -> set:
    """MoE fields set (non-zero) anywhere in a default config's dict: catches text configs held as AutoConfig."""
    found: set = set()
    if isinstance(value, dict):
        for key, v in value.items():
            if key in MOE_FIELDS and v not in (None, 0, False, [], ()):
                found.add(key)
            found |= _set_fields(v)
    return found


def transformers_moe_architectures() -> dict[str, str]:
    """Architecture class -> model type, for every generation head in transformers' auto mappings whose config
    is a mixture of experts: it declares an MoE field, or its default config sets one."""
    import transformers
    from transformers.models.auto import configuration_auto, modeling_auto

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        found: dict[str, str] = {}
        for mapping in MAPPINGS:
            for model_type, classes in getattr(modeling_auto, mapping, {}).items():
                config_name = configuration_auto.CONFIG_MAPPING_NAMES.get(model_type)
                config_cls = getattr(transformers, config_name, None) if config_name else None
                if config_cls is None:
                    continue
                moe = bool(_declared_fields(config_cls, set()))
                if not moe:
                    try:
                        moe = bool(_set_fields(config_cls().to_dict()))
                    except Exception:  # noqa: BLE001 - composite configs (encoder-decoder) need sub-configs
                        moe = False
                if moe:
                    for cls in classes if isinstance(classes, (list, tuple)) else (classes,):
                        found.setdefault(cls, model_type)
        return found
    finally:
        transformers.logging.set_verbosity(verbosity)


@pytest.fixture(scope="module")
def moe_architectures() -> dict[str, str]:
    return transformers_moe_architectures()


def test_every_transformers_moe_architecture_is_built_or_refused(moe_architectures):
    # the families mlora builds are found the same way, so the search itself is checked
    assert set(MOE_ARCHITECTURES) <= set(moe_architectures)
    missing = sorted(a for a in moe_architectures if a not in MOE_ARCHITECTURES and a not in MOE_REFUSALS)
    assert not missing, f"MoE architectures in transformers with no entry in mlora/formats/moe_refusals.py: {missing}"
    assert not set(MOE_REFUSALS) & set(SUPPORTED_ARCHITECTURES)
    assert MOE_NOT_YET is MOE_REFUSALS
    for arch, need in MOE_REFUSALS.items():
        assert need and need == need.strip() and not need.endswith("."), arch


def _checkpoint(tmp_path, arch: str, **fields):
    path = tmp_path / arch
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": "x", **fields}))
    return path


@pytest.mark.parametrize(("arch", "needs"), [
    ("Kimi_K25ForConditionalGeneration", ["vision tower", "DeepSeek-V3 decoder"]),
    ("Glm4MoeLiteForCausalLM", ["multi-head latent attention", "GLM-4.5's MoE decoder"]),
    ("Qwen3_5MoeForCausalLM", ["gated delta net"]),
    ("Qwen3_5MoeForConditionalGeneration", ["gated delta net", "vision"]),
    ("Llama4ForCausalLM", ["chunked local attention", "shared expert"]),
    ("MiniMaxM2ForCausalLM", ["e_score_correction_bias"]),
])
def test_load_hf_config_names_what_a_refused_family_needs(tmp_path, arch, needs):
    path = _checkpoint(tmp_path, arch, hidden_size=64)
    with pytest.raises(ValueError) as err:
        load_hf_config(path)
    message = str(err.value)
    assert message.startswith(f"architecture {arch!r} in {path / 'config.json'} needs ")
    assert "which mlora does not build; supported: " in message and "Qwen3MoeForCausalLM" in message
    for need in needs:
        assert need in message, (need, message)


def test_model_spec_names_what_a_refused_family_needs():
    class Config:  # model_spec is reached with a config built elsewhere (AutoConfig, a tool)
        architectures = ["Glm4MoeLiteForCausalLM"]

    with pytest.raises(ValueError, match="'Glm4MoeLiteForCausalLM' needs multi-head latent attention"):
        model_spec(Config())
