"""The TP × PP × DP mesh over torchrun (with EP over the experts of MoE layers), built on megatron-core's
parallel_state."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlora.parallel.cpu_shims import apply_cpu_shims


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the mesh. Groups live in megatron's ``parallel_state``."""

    tp: int
    pp: int
    dp: int
    sp: bool
    rank: int
    world_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    backend: str
    ep: int = 1  # expert parallelism: MoE layers' experts split ep ways (expert TP 1)
    ep_rank: int = 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def tp_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_group()

    @property
    def pp_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_group()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    @property
    def ep_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state as ps

        return ps.get_expert_model_parallel_group()

    @property
    def expert_dp_group(self) -> dist.ProcessGroup:
        """The ranks holding the same experts (routing other tokens through them): expert gradients sum here."""
        from megatron.core import parallel_state as ps

        return ps.get_expert_data_parallel_group()

    @property
    def expert_dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_expert_data_parallel_rank()

    def __str__(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} (tp {self.tp_rank}/{self.tp}, pp {self.pp_rank}/{self.pp}, "
            f"dp {self.dp_rank}/{self.dp}{f', ep {self.ep_rank}/{self.ep}' if self.ep > 1 else ''}"
            f"{', sp' if self.sp else ''}, {self.backend})"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(tp: int = 1, pp: int = 1, sp: bool = False, seed: int = 1234,
                  timeout_minutes: int = 30, ep: int = 1) -> Mesh:
    """Initialise torch.distributed and megatron's TP/PP/DP groups.

    Run under torchrun (``RANK``/``WORLD_SIZE`` in the environment); without it a
    single-process group is created, so ``init_parallel()`` also works in a notebook.
    DP is ``world_size // (tp * pp)``. ``ep``: expert parallelism for MoE models (expert tensor parallelism
    1): the experts of each stage are split over ``ep`` ranks drawn from its TP × DP ranks, so ``ep`` must
    divide ``world_size // pp``; expert gradients are summed over the ``world_size // (pp * ep)`` ranks that
    hold the same experts. Uses NCCL when CUDA is available and gloo
    otherwise (with megatron's CPU gaps closed by :mod:`mlora.parallel.cpu_shims`).
    Calling it again with the same layout returns the existing mesh.
    """
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: it must be a positive integer")
    if sp and tp == 1:
        raise ValueError("sp=True needs tp > 1: sequence parallelism splits activations over TP ranks")

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if not use_cuda:
        apply_cpu_shims()

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"]) if under_torchrun else 1
    if world % (tp * pp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}; "
            f"valid world sizes are multiples of {tp * pp}"
        )
    if (world // pp) % ep:
        raise ValueError(f"ep={ep} does not divide the {world // pp} ranks of a pipeline stage (world size {world} / "
                         f"pp={pp}): experts are split over ranks of the TP x DP plane; valid ep: "
                         f"{[d for d in range(1, world // pp + 1) if (world // pp) % d == 0]}")
    if not dist.is_initialized():
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if under_torchrun:
            init_method, rank = "env://", int(os.environ["RANK"])
        else:
            init_method, rank = f"tcp://127.0.0.1:{_free_port()}", 0
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=timeout_minutes))

    if ps.model_parallel_is_initialized():
        now = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
               ps.get_expert_model_parallel_world_size())
        if now != (tp, pp, ep):
            raise RuntimeError(
                f"the mesh is already initialised with tp={now[0]}, pp={now[1]}, ep={now[2]}; cannot switch to "
                f"tp={tp}, pp={pp}, ep={ep} in the same process"
            )
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
                                     create_gloo_process_groups=use_cuda)
        # Same default stream on every rank, and megatron's per-TP-rank tracker for its own layers.
        # (LoRA dropout draws from its own keyed generators: mlora.lora.layers.dropout_mask.)
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

    return Mesh(
        tp=tp, pp=pp, dp=world // (tp * pp), sp=sp,
        rank=dist.get_rank(), world_size=world,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        device=torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu"),
        backend=backend,
        ep=ep,
        ep_rank=ps.get_expert_model_parallel_rank(),
    )


def reset_parallel() -> None:
    """Drop megatron's TP/PP/DP groups (torch.distributed stays up) so a new layout can be set."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
