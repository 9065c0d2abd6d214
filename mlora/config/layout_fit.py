"""Whether a run's mesh holds its PPO step on the job's GPUs, asked of the memory planner before any
weight loads (:mod:`mlora.plan`), for runs whose mesh the user did not choose: SkyRL's
``trainer.strategy=fsdp|fsdp2``, run as TP1 x PP1 x DP=world. A base too large to replicate on every GPU
stops the run with the megatron layout of the same GPUs that fits, as keys to set.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mlora.config.dtypes import engine_dtype, trainer_dtype
from mlora.config.errors import ConfigError
from mlora.config.schema import TrainConfig, lora_max_rank

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
        seq=t.max_prompt_length + cfg.generator.sampling_params.max_generate_length, rank=lora.rank, expert_rank=lora.expert_rank,
        target_modules=targets, exclude_modules=(exclude,) if isinstance(exclude, str) else
        (tuple(exclude) if exclude else None), critic=t.algorithm.advantage_estimator == "gae",
        dtype=getattr(torch, trainer_dtype(t.dtype, torch.cuda.is_available())),
        fp8=t.fp8 if t.fp8 == "torch" else None,
        attention="sdpa" if t.flash_attn else "unfused", recompute=t.recompute or "none",
        lora_compute_dtype=None if t.lora_compute_dtype is None else getattr(torch, t.lora_compute_dtype),
        experiments=len(cfg.experiments) if cfg.experiments else 1, **recompute)


def _spec(cfg: TrainConfig):
    """The policy model's ModelSpec, or None when its ``config.json`` cannot be read (a missing model is reported
    when it loads)."""
    from mlora.formats.hf_config import load_hf_config, model_spec

    path = Path(str(cfg.trainer.policy.model.path)).expanduser()
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return model_spec(load_hf_config(path))


def _layout(cfg: TrainConfig, world_size: int):
    from mlora.plan import Layout

    mc = cfg.trainer.policy.megatron_config
    tp, pp = mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size
    return Layout(tp=tp, pp=pp, dp=world_size // (tp * pp), sp=bool(mc.sequence_parallel),
                  ep=mc.expert_model_parallel_size or 1)


def _context(cfg: TrainConfig) -> int:
    """The engines' context without reading the model: the longest input and the longest response (the
    model's own limit may shorten it at start-up, :func:`mlora.train.rollouts.engine_max_model_len`)."""
    g = cfg.generator
    explicit = g.engine_init_kwargs.get("max_model_len")
    if explicit is not None:
        return int(explicit)
    return (g.max_input_length or cfg.trainer.max_prompt_length) + max(
        g.sampling_params.max_generate_length, g.eval_sampling_params.max_generate_length or 0)


def planner_engine(cfg: TrainConfig, spec, cuda: bool = True):
    """The planner's :class:`~mlora.plan.workload.Engine` of a run's colocated engines on CUDA
    (``trainer.placement.colocate_all``; they sleep while the trainer works), holding the KV cache of one
    sequence of the engines' context: the least an engine starts with (:mod:`mlora.plan.engines` gives it more
    when there is room). None for engines on GPUs of their own."""
    from mlora.plan import Engine
    from mlora.plan.engines import BLOCK_TOKENS, vllm_torch_dtype

    if not cfg.trainer.placement.colocate_all:
        return None
    return Engine(tp=cfg.generator.inference_engine.tensor_parallel_size,
                  kv_tokens=-(-_context(cfg) // BLOCK_TOKENS) * BLOCK_TOKENS,
                  dtype=vllm_torch_dtype(engine_dtype(cfg, cuda)), sleeps=True)


def trainer_resident_bytes(cfg: TrainConfig, world_size: int) -> int:
    """The planner's bytes that stay on a trainer rank's GPU between updates (frozen base, adapters, heads,
    AdamW state), the largest over ranks: what a colocated engine generates beside. 0 when the model's
    ``config.json`` cannot be read."""
    from mlora.plan import plan_memory

    spec = _spec(cfg)
    if spec is None:
        return 0
    plan = plan_memory(spec, _layout(cfg, world_size), planner_workload(cfg))
    return max(r.base + r.adapters + r.heads + r.optimizer for r in plan.ranks)


def check_layout_fits(cfg: TrainConfig, world_size: int, gpu_memory_bytes: int) -> None:
    """:class:`~mlora.config.errors.ConfigError` when the run's TP x PP x DP mesh needs more than
    ``gpu_memory_bytes`` per GPU at its peak; the message names the layout of ``world_size`` GPUs that
    fits, as the keys that choose it. Nothing happens when the model's ``config.json`` cannot be read
    (a missing model is reported when it loads)."""
    from mlora.plan import fit_layouts, plan_memory

    spec = _spec(cfg)
    if spec is None:
        return
    workload = planner_workload(cfg)
    layout = _layout(cfg, world_size)
    engine = planner_engine(cfg, spec)  # colocated engines: their weights and one sequence's KV cache
    peak = plan_memory(spec, layout, workload, engine).peak
    if peak <= gpu_memory_bytes:
        return
    fits = fit_layouts(spec, workload, world_size, gpu_memory_bytes, engine=engine, ep=layout.ep)
    head = (f"trainer.strategy={cfg.trainer.strategy}: the {layout} mesh needs {peak / GIB:.1f} GiB per GPU at the "
            f"peak of a PPO step" + (" with its colocated vLLM engines" if engine else "") + " (the memory planner, "
            f"before any weight loads), the GPUs have {gpu_memory_bytes / GIB:.1f} GiB")
    if fits and fits[0].fits:
        best = fits[0].plan.layout
        raise ConfigError(
            f"{head}. The {world_size} GPUs hold it as {best} ({fits[0].need / GIB:.1f} GiB): use "
            f"trainer.strategy=megatron trainer.policy.megatron_config.tensor_model_parallel_size={best.tp} "
            f"trainer.policy.megatron_config.pipeline_model_parallel_size={best.pp}"
            + (f" trainer.policy.megatron_config.expert_model_parallel_size={best.ep} "
               f"trainer.policy.megatron_config.sequence_parallel={str(best.sp).lower()}" if spec.moe else ""))
    raise ConfigError(
        f"{head}. No layout of {world_size} GPUs holds it (closest: {fits[0].plan.layout}, "
        f"{fits[0].need / GIB:.1f} GiB): use more GPUs, trainer.fp8=torch, recompute (trainer.recompute=full) or "
        "shorter sequences")


def check_engines_fit(cfg: TrainConfig, world_size: int, gpu_memory_bytes: int) -> None:
    """:class:`~mlora.config.errors.ConfigError` when one of the run's vLLM engines cannot hold its weights and the
    KV cache of one sequence of its context on its GPUs (:func:`mlora.plan.engines.size_engine`): colocated beside
    a trainer rank's resident bytes, else on GPUs of its own. Checked before any weight loads; nothing happens
    when the model's ``config.json`` cannot be read."""
    from mlora.plan.engines import DeviceMemory, size_engine, vllm_torch_dtype

    spec = _spec(cfg)
    if spec is None:
        return
    colocated = cfg.trainer.placement.colocate_all
    try:
        size_engine(spec, DeviceMemory(total=gpu_memory_bytes, free=gpu_memory_bytes, cuda=True),
                    tp=cfg.generator.inference_engine.tensor_parallel_size,
                    dtype=vllm_torch_dtype(engine_dtype(cfg, True)), lora_rank=lora_max_rank(cfg.trainer.policy.model.lora),
                    max_model_len=_context(cfg), sequences=1,
                    trainer_bytes=trainer_resident_bytes(cfg, world_size) if colocated else 0)
    except ValueError as exc:
        raise ConfigError(f"{'colocated (trainer.placement.colocate_all=true)' if colocated else 'on its own GPUs'}, "
                          f"{exc}") from None
