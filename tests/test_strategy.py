"""SkyRL's ``trainer.strategy=fsdp|fsdp2`` (issue 22): run as a data-parallel megatron-core mesh with a note
saying the base is replicated; on GPUs the memory planner is asked before any weight loads, and a layout
that cannot hold the step stops the run with the megatron layout of the same GPUs that does."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.quick

GIB = 1 << 30


def _cfg(model_dir, strategy="fsdp2", **trainer):
    from mlora.config.schema import TrainConfig

    cfg = TrainConfig()
    cfg.trainer.strategy = strategy
    cfg.trainer.policy.model.path = str(model_dir)
    cfg.generator.num_inference_engines = 8  # colocated on the 8 GPUs
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    return cfg


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory):
    """Llama-3-70B's config.json, no weights: the check runs before any weight loads."""
    d = tmp_path_factory.mktemp("llama70b")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_theta": 500000.0, "torch_dtype": "bfloat16"}))
    return d


def test_fsdp2_is_a_data_parallel_mesh(tmp_path):
    from mlora.config.validate import ConfigError, finalize

    cfg = _cfg(tmp_path)
    notes = finalize(cfg, 4)
    mc = cfg.trainer.policy.megatron_config
    assert (mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size) == (1, 1)
    assert any(n.startswith("trainer.strategy=fsdp2 runs as a data-parallel megatron-core mesh (TP1 x PP1 x DP4): "
                            "the frozen base is replicated on every rank") for n in notes), notes
    cfg = _cfg(tmp_path)
    cfg.trainer.policy.megatron_config.tensor_model_parallel_size = 2
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=2.*use trainer.strategy=megatron"):
        finalize(cfg, 4)
    with pytest.raises(ConfigError, match="trainer.strategy='deepspeed'"):
        finalize(_cfg(tmp_path, "deepspeed"), 4)


def test_70b_fsdp2_on_eight_gpus_stops_with_the_layout_that_fits(llama70b):
    """Llama-3-70B, PPO with a critic, bf16: replicated on each of 8 x 80 GiB GPUs it cannot fit (140 GB of
    weights alone); the run stops before loading and names the TP x PP that holds it."""
    from mlora.config.validate import ConfigError, finalize

    cfg = _cfg(llama70b, dtype="bfloat16", max_prompt_length=1024, micro_train_batch_size_per_gpu=1,
               micro_forward_batch_size_per_gpu=1)
    cfg.trainer.algorithm.advantage_estimator = "gae"
    cfg.generator.sampling_params.max_generate_length = 1024
    # colocated engines (the default) of TP8: their shard of the base and KV cache count in every layout
    cfg.generator.inference_engine.tensor_parallel_size = 8
    cfg.generator.num_inference_engines = 1
    with pytest.raises(ConfigError) as err:
        finalize(cfg, 8, cuda=True, gpus_per_node=8, ranks_per_node=8, gpu_memory_bytes=80 * GIB)
    msg = str(err.value)
    m = re.match(r"trainer.strategy=fsdp2: the TP1xPP1xDP8 mesh needs (\d+\.\d) GiB per GPU .* the GPUs have 80.0 GiB. "
                 r"The 8 GPUs hold it as TP(\d)xPP(\d)xDP\d \((\d+\.\d) GiB\): use trainer.strategy=megatron "
                 r"trainer.policy.megatron_config.tensor_model_parallel_size=(\d) "
                 r"trainer.policy.megatron_config.pipeline_model_parallel_size=(\d)$", msg)
    assert m, msg
    assert float(m[1]) > 140 and float(m[4]) <= 80 and (m[2], m[3]) == (m[5], m[6]) and int(m[2]) * int(m[3]) > 1


def test_fitting_models_and_cpu_runs_pass(tiny_models):
    from mlora.config.validate import finalize

    finalize(_cfg(tiny_models / "llama"), 8, cuda=True, gpus_per_node=8, ranks_per_node=8, gpu_memory_bytes=80 * GIB)
    finalize(_cfg(tiny_models / "llama"), 8)  # CPU: no GPU memory to check against
