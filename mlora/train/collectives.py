"""What the trainer's engines do around megatron's schedule: results computed on the last pipeline stage
brought to every rank, data-parallel slices gathered, micro-batch metrics summed, and the model's mode.

Used by the RL engine (:mod:`mlora.train.engine`, :mod:`mlora.train.joint_passes`) and the preference
engine alike; each function is collective over the groups it names.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def from_last_stage(mesh, t: torch.Tensor | None, shape, dtype=torch.float32) -> torch.Tensor:
    """A tensor computed on the last pipeline stage (None elsewhere), broadcast to every stage."""
    from megatron.core import parallel_state as ps

    if mesh.pp == 1:
        return t
    buf = t.contiguous() if mesh.is_last_stage else torch.zeros(shape, dtype=dtype, device=mesh.device)
    dist.broadcast(buf, src=ps.get_pipeline_model_parallel_last_rank(), group=mesh.pp_group)
    return buf


def dp_gather(mesh, t: torch.Tensor) -> torch.Tensor:
    """Every data-parallel rank's ``t`` concatenated in DP-rank order (dim 0)."""
    if mesh.dp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(mesh.dp)]
    dist.all_gather(parts, t.contiguous(), group=mesh.dp_group)
    return torch.cat(parts)


def broadcast_keys(mesh, keys):
    """The last stage's list of metric names, on every stage."""
    if mesh.pp == 1:
        return keys
    from megatron.core import parallel_state as ps

    box = [keys]
    dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(), group=mesh.pp_group)
    return box[0]


def reduce_metrics(mesh, outs: list[dict] | None) -> dict[str, float]:
    """Micro-batch metrics summed (a name a micro-batch lacks counts as nothing there), then over DP; the same
    numbers on every rank."""
    keys = sorted({k for o in outs for k in o}) if outs else None
    keys = broadcast_keys(mesh, keys)
    if mesh.is_last_stage:
        vec = torch.stack([sum(o[k].detach().float() for o in outs if k in o) for k in keys]).to(mesh.device)
        if mesh.dp > 1:
            dist.all_reduce(vec, group=mesh.dp_group)
    else:
        vec = None
    vec = from_last_stage(mesh, vec, (len(keys),)).cpu()
    return {k: float(v) for k, v in zip(keys, vec)}


@contextlib.contextmanager
def model_mode(model: torch.nn.Module, training: bool):
    """Train mode for update passes (LoRA dropout active), eval mode for forward-only passes; every module gets
    its own previous mode back afterwards (``model.train(x)`` alone would flatten mixed modes)."""
    previous = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, mode in previous:
            m.training = mode
