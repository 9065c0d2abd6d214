"""The service's memory at start-up, from shapes (:mod:`mlora.plan`) and what the device has free: the sampling
engine's share beside the trainer, and the token budget of a ``forward_backward`` micro-batch. Both are printed;
the flags that override them are named there."""

from __future__ import annotations

from pathlib import Path

import torch

from mlora.formats.hf_config import ModelSpec, load_hf_config, model_spec
from mlora.plan.engines import (
    RESERVE_FRACTION,
    TRAINER_SHARE,
    MicrobatchSizing,
    ServiceSizing,
    device_memory,
    size_service_engine,
    size_service_microbatch,
    vllm_torch_dtype,
)
from mlora.plan.weights import base_bytes
from mlora.rollout.model_len import read_context_limit


def _facts(model_dir: str | Path, dtype: str, mesh, max_model_len: int | None
           ) -> tuple[ModelSpec, torch.dtype, bool, int, int]:
    """The model's spec, its dtype, whether the engine runs on CUDA, the trainer's base bytes on the measured device
    (the CPU build's host holds every rank's shard: all of a DP replica's, each replica's copy; on CUDA rank 0's GPU
    holds its shard), and the context length."""
    from mlora.rollout.vllm_engine import _sees_cuda

    cuda = _sees_cuda() and torch.cuda.is_available()
    spec = model_spec(load_hf_config(Path(model_dir)))
    torch_dtype = vllm_torch_dtype(dtype)
    if cuda:
        trainer = base_bytes(spec, mesh.tp, mesh.pp, 0, 0, torch_dtype)
    else:
        trainer = mesh.dp * sum(base_bytes(spec, mesh.tp, mesh.pp, stage, rank, torch_dtype)
                                for stage in range(mesh.pp) for rank in range(mesh.tp))
    context = max_model_len or read_context_limit(model_dir)
    if context is None:
        raise ValueError(f"{model_dir} has no config.json context length: give the engine's --max-model-len")
    return spec, torch_dtype, cuda, trainer, int(context)


def engine_sizing(model_dir: str | Path, dtype: str, mesh, max_lora_rank: int, max_loras: int,
                  max_model_len: int | None, kv_cache_bytes: int | None) -> ServiceSizing:
    """The sampling engine's memory (:func:`mlora.plan.engines.size_service_engine`), measured on this rank's device
    before the trainer loads."""
    spec, torch_dtype, cuda, trainer, context = _facts(model_dir, dtype, mesh, max_model_len)
    return size_service_engine(spec, device_memory(cuda), dtype=torch_dtype, trainer_base=trainer,
                               lora_rank=max_lora_rank, max_loras=max_loras, max_model_len=context,
                               kv_cache_memory_bytes=kv_cache_bytes)


def microbatch_sizing(model_dir: str | Path, dtype: str, mesh, max_lora_rank: int, max_model_len: int | None,
                      trainer_share: int | None) -> MicrobatchSizing:
    """The default token budget of a forward_backward micro-batch (:func:`mlora.plan.engines.size_service_microbatch`)
    from the trainer's share: the engine sizing's, or without an engine :data:`TRAINER_SHARE` of what is free beyond
    the base and the reserve, measured now (before the trainer loads)."""
    spec, torch_dtype, cuda, trainer, context = _facts(model_dir, dtype, mesh, max_model_len)
    if trainer_share is None:
        device = device_memory(cuda)
        trainer_share = int(TRAINER_SHARE * max(0, device.free - trainer - RESERVE_FRACTION * device.total))
    return size_service_microbatch(spec, trainer_share, dtype=torch_dtype, lora_rank=max_lora_rank, longest=context)
