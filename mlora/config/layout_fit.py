"""Whether a run's mesh holds its PPO step on the job's GPUs, asked of the memory planner before any
weight loads (:mod:`mlora.plan`), for runs whose mesh the user did not choose: SkyRL's
``trainer.strategy=fsdp|fsdp2``, run as TP1 x PP1 x DP=world. A base too large to replicate on every GPU
stops the run with the megatron layout of the same GPUs that fits, as keys to set.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mlora.config.errors import ConfigError
from mlora.config.schema import TrainConfig

GIB = 1 << 30


def planner_workload(cfg: TrainConfig):
    """The planner's :class:`~mlora.plan.workload.Workload` for one PPO step of this run (the trainer's
    micro-batches, the longest prompt + response, the adapters and precision it trains with; with K
    experiments, K sets of the run's adapters)."""
    from mlora.plan import Workload

    t, lora = cfg.trainer, cfg.trainer.policy.model.lora
    targets = lora.target_modules if isinstance(lora.target_modules, str) else tuple(lora.target_modules)
    exclude = lora.exclude_modules
    # the recompute keys left null take the planner's own defaults (megatron's, as the model does)
    recompute = {k: v for k, v in (("recompute_method", t.recompute_method),
                                   ("recompute_num_layers", t.recompute_num_layers),
                                   ("recompute_modules", tuple(t.recompute_modules) if t.recompute_modules else None))
                 if v is not None}
    return Workload(
        micro_batch=t.micro_train_batch_size_per_gpu, forward_micro_batch=t.micro_forward_batch_size_per_gpu,
        seq=t.max_prompt_length + cfg.generator.sampling_params.max_generate_length, rank=lora.rank,
        target_modules=targets, exclude_modules=(exclude,) if isinstance(exclude, str) else
        (tuple(exclude) if exclude else None), critic=t.algorithm.advantage_estimator == "gae",
        dtype=getattr(torch, t.dtype), fp8=t.fp8 if t.fp8 == "torch" else None,
        attention="sdpa" if t.flash_attn else "unfused", recompute=t.recompute or "none",
        lora_compute_dtype=None if t.lora_compute_dtype is None else getattr(torch, t.lora_compute_dtype),
        experiments=len(cfg.experiments) if cfg.experiments else 1, **recompute)


def check_layout_fits(cfg: TrainConfig, world_size: int, gpu_memory_bytes: int) -> None:
    """:class:`~mlora.config.errors.ConfigError` when the run's TP x PP x DP mesh needs more than
    ``gpu_memory_bytes`` per GPU at its peak; the message names the layout of ``world_size`` GPUs that
    fits, as the keys that choose it. Nothing happens when the model's ``config.json`` cannot be read
    (a missing model is reported when it loads)."""
    from mlora.formats.hf_config import load_hf_config, model_spec
    from mlora.plan import Layout, fit_layouts, plan_memory

    path = Path(str(cfg.trainer.policy.model.path)).expanduser()
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return
    spec = model_spec(load_hf_config(path))
    mc = cfg.trainer.policy.megatron_config
    tp, pp = mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size
    workload = planner_workload(cfg)
    layout = Layout(tp=tp, pp=pp, dp=world_size // (tp * pp), sp=bool(mc.sequence_parallel))
    peak = plan_memory(spec, layout, workload).peak
    if peak <= gpu_memory_bytes:
        return
    fits = fit_layouts(spec, workload, world_size, gpu_memory_bytes)
    head = (f"trainer.strategy={cfg.trainer.strategy}: the {layout} mesh needs {peak / GIB:.1f} GiB per GPU at the "
            f"peak of a PPO step (the memory planner, before any weight loads), the GPUs have "
            f"{gpu_memory_bytes / GIB:.1f} GiB")
    if fits and fits[0].fits:
        best = fits[0].plan.layout
        raise ConfigError(
            f"{head}. The {world_size} GPUs hold it as {best} ({fits[0].need / GIB:.1f} GiB): use "
            f"trainer.strategy=megatron trainer.policy.megatron_config.tensor_model_parallel_size={best.tp} "
            f"trainer.policy.megatron_config.pipeline_model_parallel_size={best.pp}")
    raise ConfigError(
        f"{head}. No layout of {world_size} GPUs holds it (closest: {fits[0].plan.layout}, "
        f"{fits[0].need / GIB:.1f} GiB): use more GPUs, trainer.fp8=torch, recompute (trainer.recompute=full) or "
        "shorter sequences")
