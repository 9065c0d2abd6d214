"""The service on a mesh of ranks (torchrun): rank 0 serves HTTP, every rank makes the same client-model calls.

Each DP replica (a TP x PP group) runs its share of a ``forward_backward`` batch's rows; the replicas' gradients are
summed at ``optim_step`` (:meth:`mlora.service.tenants.Tenants.forward_backward`). Every call that touches the model
(:class:`mlora.service.tenants.Tenants`: create, load, delete, forward_backward, optim_step, save) is made on rank
0's one worker thread; :class:`Broadcast` sends it to the other ranks first (``broadcast_object_list`` from rank 0),
then runs it, so every rank makes the same calls in the same order and their collectives meet. The other ranks run
:func:`follow` until rank 0 sends the end. A call that fails its checks fails on every rank alike (the checks come
before any collective) and every rank goes on.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

log = logging.getLogger("mlora.service")
CALLS = ("create", "load", "delete", "forward_backward", "optim_step", "save")
END = None


class Broadcast:
    """Rank 0's :class:`Tenants`: each model call goes to every rank, then runs here."""

    def __init__(self, tenants) -> None:
        self.tenants = tenants

    def __getattr__(self, name: str):
        attr = getattr(self.tenants, name)
        if name not in CALLS:
            return attr

        def call(*args, **kwargs):
            dist.broadcast_object_list([(name, args, kwargs)], src=0)
            return attr(*args, **kwargs)
        return call

    def close(self) -> None:
        """Release the other ranks (they return from :func:`follow`)."""
        dist.broadcast_object_list([END], src=0)


def follow(tenants) -> None:
    """A rank other than 0: run rank 0's calls on ``tenants`` until it ends."""
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0)
        if message[0] is END:
            return
        name, args, kwargs = message[0]
        try:
            getattr(tenants, name)(*args, **kwargs)
        except (ValueError, KeyError, FileNotFoundError):
            pass  # rank 0 fails the same way and reports it to the client
