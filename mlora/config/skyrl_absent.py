"""SkyRL's configuration keys that mlora's schema does not have, each with why: a SkyRL user's override of one is
refused by name with that reason (:func:`check_overrides`), not with Hydra's "Key ... not in ..." (issue 48).

The prefixes cover every key of SkyRL's ``SkyRLTrainConfig`` (skyrl 0.3.0) missing from :class:`~mlora.config.schema.
TrainConfig` (``tests/test_skyrl_absent_keys.py`` walks SkyRL's own dataclasses). Keys under one of mlora's dict
fields (``environment.skyrl_gym``, ``fake_int4_qat``, ``engine_init_kwargs``, ...) are mlora's to check, not these.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from mlora.config.errors import ConfigError

_ENGINE_KWARG = "a vLLM engine argument: pass it as generator.engine_init_kwargs.{name} (vLLM's own name)"
_FSDP = "mlora is megatron-core (one frozen base shared by actor, critic and reference): FSDP's settings do not apply"
_REF = ("the reference is the shared frozen base with the RL adapters off: it has no model, LoRA or parallel settings "
        "of its own (trainer.policy's apply)")
_MOE = ("the frozen base routes as its HF config says: its router does not train (no auxiliary loss, no expert "
        "bias update, no routing replay) and the token dispatcher is mlora's (mlora.models.moe)")
_SAMPLES = ("mlora logs no sample texts to the tracker; each step's batch and the evaluations are dumped with "
            "trainer.dump_data_batch and trainer.dump_eval_results")

# prefix -> why mlora does not have it (a key is refused when it equals a prefix or lies below one)
ABSENT: dict[str, str] = {
    "data.dataloader": "mlora tokenizes the prompt set once at start-up and draws batches itself (no DataLoader "
                       "workers)",
    "generator.inference_engine.data_parallel_size": "engine data parallelism: run more engines instead "
                                                     "(generator.inference_engine.num_engines)",
    "generator.inference_engine.pipeline_parallel_size": "pipeline-parallel engines are not supported: each engine "
                                                         "holds the base with tensor_parallel_size GPUs",
    "generator.inference_engine.expert_parallel_size": "expert-parallel engines are not supported (the trainer's "
                                                       "expert parallelism is trainer.policy.megatron_config."
                                                       "expert_model_parallel_size)",
    "generator.inference_engine.enable_chunked_prefill": _ENGINE_KWARG.format(name="enable_chunked_prefill"),
    "generator.inference_engine.enable_prefix_caching": _ENGINE_KWARG.format(name="enable_prefix_caching"),
    "generator.inference_engine.max_num_batched_tokens": _ENGINE_KWARG.format(name="max_num_batched_tokens"),
    "generator.inference_engine.max_num_seqs": _ENGINE_KWARG.format(name="max_num_seqs"),
    "generator.inference_engine.fully_sharded_loras": _ENGINE_KWARG.format(name="fully_sharded_loras"),
    "generator.inference_engine.speculative_config": _ENGINE_KWARG.format(name="speculative_config"),
    "generator.inference_engine.model_dtype": "the engines' dtype is mlora's (bfloat16 on CUDA, float32 on the CPU "
                                              "build); generator.engine_init_kwargs.dtype overrides it",
    "generator.inference_engine.enable_pd": "prefill/decode disaggregation is not implemented",
    "generator.inference_engine.num_prefill": "prefill/decode disaggregation is not implemented",
    "generator.inference_engine.external_proxy_url": "engines mlora did not start (remote servers) are not supported: "
                                                     "mlora hands each update's adapter to the engines it starts",
    "generator.inference_engine.external_server_urls": "engines mlora did not start (remote servers) are not "
                                                       "supported: mlora hands each update's adapter to the engines "
                                                       "it starts",
    "generator.inference_engine.router_init_kwargs": "mlora calls its engines directly (no HTTP router in front)",
    "generator.inference_engine.served_model_name": "mlora's engines are not HTTP servers: nothing is served by name",
    "generator.inference_engine.enable_ray_prometheus_stats": "vLLM's Prometheus metrics are not collected",
    "generator.inference_engine.enable_return_routed_experts": "MoE routing replay is not implemented: " + _MOE,
    "generator.inference_engine.use_expandable_segments": "mlora does not set the engines' CUDA allocator: "
                                                          "PYTORCH_CUDA_ALLOC_CONF in the environment reaches them",
    "generator.inference_engine.vllm_v1_disable_multiproc": "each engine runs in a process of its own with vLLM's "
                                                            "engine core in process (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
    "generator.inference_engine.weight_transfer_threshold_cuda_ipc_GB": "no full-weight transfer: mlora hands over "
                                                                        "the LoRA adapters only "
                                                                        "(generator.weight_sync)",
    "generator.sampling_params.additional_kwargs": "other vLLM sampling arguments would change the sampled "
                                                   "distribution unseen by the trainer, whose log-probs must be of "
                                                   "it (temperature, top_k, top_p, min_p are the ones it applies)",
    "generator.eval_sampling_params.additional_kwargs": "other vLLM sampling arguments are not passed; evaluation "
                                                        "samples with SkyRL's named ones",
    "generator.use_cache_salt": "vLLM's per-request cache salt is not set; the prefix cache is reset when an adapter "
                                "is replaced in place",
    "trainer.bf16": "the trainer's precision is mlora's: bfloat16 on CUDA, float32 on the CPU (mlora.config.dtypes), "
                    "FP8 frozen linears with trainer.fp8",
    "trainer.policy.model.lora.max_loras": "the engines' LoRA slots are sized by mlora (one per experiment); vLLM's "
                                           "max_loras goes in generator.engine_init_kwargs",
    "trainer.policy.model.lora.max_cpu_loras": "vLLM's max_cpu_loras goes in generator.engine_init_kwargs",
    "trainer.critic.model.lora.max_loras": "the critic is never served by the engines",
    "trainer.critic.model.lora.max_cpu_loras": "the critic is never served by the engines",
    "trainer.critic.model.fake_int4_qat": "INT4 fake-quant QAT is not supported; the critic shares the policy's "
                                          "frozen base",
    "trainer.policy.model_config_kwargs": "HF model-config overrides are not applied: the frozen base is loaded as "
                                          "its config.json says (megatron's settings: trainer.policy.megatron_config."
                                          "transformer_config_kwargs)",
    "trainer.critic.model_config_kwargs": "HF model-config overrides are not applied: the critic shares the policy's "
                                          "frozen base",
    "trainer.policy.megatron_config.model_config_kwargs": "use trainer.policy.megatron_config.transformer_config_kwargs "
                                                          "(megatron's TransformerConfig fields)",
    "trainer.policy.sequence_parallel_size": "Ulysses sequence parallelism is not implemented; megatron's sequence "
                                             "parallelism comes with tensor parallelism",
    "trainer.critic.sequence_parallel_size": "Ulysses sequence parallelism is not implemented",
    "trainer.sequence_parallel_backend": "Ulysses sequence parallelism is not implemented",
    "trainer.policy.fsdp_config": _FSDP,
    "trainer.critic.fsdp_config": _FSDP,
    "trainer.ref": _REF,
    "trainer.policy.torch_profiler_config": "the torch profiler is not wired into the trainer",
    "trainer.policy.use_torch_compile": "torch.compile of the trainer's model is not implemented",
    "trainer.policy.record_memory": "CUDA memory snapshots are not recorded; `mlora plan --memory` predicts the peak",
    "trainer.policy.inference_only_init": "there is no inference-only trainer: mlora's engines are vLLM's",
    "trainer.policy.megatron_config.ddp_config": "megatron's DDP wrapper is not used: mlora all-reduces the LoRA "
                                                 "gradients itself (the frozen base has none)",
    "trainer.policy.megatron_config.dist_ckpt_optim_fully_reshardable": "mlora's checkpoints resume on any mesh "
                                                                       "already (the adapters' shards and AdamW state "
                                                                       "are resharded on load)",
    "trainer.policy.megatron_config.empty_cuda_cache": "mlora frees the trainer's cached blocks itself when colocated "
                                                       "engines wake",
    "trainer.policy.megatron_config.freeze_moe_router": "the router is part of the frozen base: always frozen",
    "trainer.policy.megatron_config.hf_export_config": "the export is the adapter in PEFT layout, gathered from the "
                                                       "shards and written by rank 0",
    "trainer.policy.megatron_config.lora_config.lora_type": "mlora's LoRA is plain LoRA on each adapted linear (no "
                                                            "canonical or fused variants)",
    "trainer.policy.megatron_config.moe_aux_loss_coeff": _MOE,
    "trainer.policy.megatron_config.moe_enable_routing_replay": _MOE,
    "trainer.policy.megatron_config.moe_grouped_gemm": _MOE,
    "trainer.policy.megatron_config.moe_per_layer_logging": _MOE,
    "trainer.policy.megatron_config.moe_router_dtype": _MOE,
    "trainer.policy.megatron_config.moe_router_enable_expert_bias": _MOE,
    "trainer.policy.megatron_config.moe_router_load_balancing_type": _MOE,
    "trainer.policy.megatron_config.moe_router_score_function": _MOE,
    "trainer.policy.megatron_config.moe_token_dispatcher_type": _MOE,
    "trainer.policy.megatron_config.mtp_loss_chunk_size": "multi-token prediction is not implemented",
    "trainer.policy.megatron_config.mtp_loss_topk": "multi-token prediction is not implemented",
    "trainer.policy.megatron_config.mtp_loss_weight": "multi-token prediction is not implemented",
    "trainer.policy.megatron_config.mtp_num_layers": "multi-token prediction is not implemented",
    "trainer.mtp": "multi-token prediction is not implemented",
    "trainer.disable_fast_tokenizer": "mlora loads the model's fast tokenizer (tokenizer.json)",
    "trainer.enable_ray_gpu_monitor": "there is no Ray GPU monitor",
    "trainer.fully_async.simulate_training": "SkyRL's simulated-trainer mode (generation benchmarked without "
                                             "training) is not implemented",
    "trainer.fully_async.simulate_training_step_seconds": "SkyRL's simulated-trainer mode is not implemented",
    "trainer.fully_async.simulate_weight_sync_seconds": "SkyRL's simulated-trainer mode is not implemented",
    "trainer.fused_lm_head_logprob_backend": "the fused LM-head log-prob path is not implemented "
                                             "(trainer.fused_lm_head_logprob)",
    "trainer.logprobs_chunk_size": "log-probs are computed per micro-batch from the vocab-parallel logits "
                                   "(mlora.rl.vocab_parallel), not in chunks",
    "trainer.recompute_old_logprobs_per_minibatch": "π_old's log-probs are computed once for the whole batch, before "
                                                    "the first mini-batch's update",
    "trainer.log_example_interval": _SAMPLES,
    "trainer.print_example_interval": _SAMPLES,
    "trainer.num_logger_eval_samples": _SAMPLES,
    "trainer.num_logger_train_samples": _SAMPLES,
    "trainer.tags": "mlora's trackers (trainer.logger) take no tags",
    "trainer.use_expandable_segments": "mlora does not set the trainer's CUDA allocator: set "
                                       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the environment",
}


@lru_cache(maxsize=1)
def schema_keys() -> tuple[frozenset[str], tuple[str, ...]]:
    """mlora's leaf keys, and its dict-typed fields (any key below one is the field's to check)."""
    from mlora.config.schema import TrainConfig

    leaves, dicts = set(), []

    def walk(obj, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value, key = getattr(obj, f.name), prefix + f.name
            if dataclasses.is_dataclass(value):
                walk(value, key + ".")
            else:
                leaves.add(key)
                if isinstance(value, dict) or "dict" in str(f.type).lower():
                    dicts.append(key)

    walk(TrainConfig(), "")
    return frozenset(leaves), tuple(dicts)


def absent_reason(key: str) -> str | None:
    """Why SkyRL's ``key`` is not in mlora (None: mlora has it, or SkyRL does not)."""
    leaves, dicts = schema_keys()
    if key in leaves or any(key.startswith(d + ".") for d in dicts):
        return None
    for prefix, why in ABSENT.items():
        if key == prefix or key.startswith(prefix + "."):
            return why
    return None


def check_overrides(overrides: list[str]) -> None:
    """ConfigError for the first override that sets a SkyRL key mlora does not have, naming it and why."""
    for override in overrides:
        key, sep, value = override.partition("=")
        key = key.lstrip("+~")
        why = absent_reason(key)
        if why is not None:
            raise ConfigError(f"{key}{'=' + value if sep else ''}: a SkyRL key mlora does not have: {why}")
