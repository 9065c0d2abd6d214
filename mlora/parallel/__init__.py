"""Mesh setup over torchrun and megatron-core's CPU shims."""

from mlora.parallel.mesh import Mesh, init_parallel, reset_parallel

__all__ = ["Mesh", "init_parallel", "reset_parallel"]
