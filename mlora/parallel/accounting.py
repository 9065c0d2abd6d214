"""Collective accounting: record every torch.distributed call (and its bytes) in a block.

Used to prove communication claims, e.g. that LoRA adds no collective to a micro-batch.
Patches the ``torch.distributed`` functions and any alias of them that a loaded megatron
module captured at import, and restores them on exit.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
               "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "all_to_all_single",
               "send", "recv", "batch_isend_irecv", "barrier", "gather", "scatter", "all_gather_object",
               "gather_object")
# isend/irecv stay unpatched: P2POp checks its op against the originals; batched p2p is counted per op.


@dataclass(frozen=True)
class CollectiveCall:
    op: str
    nbytes: int
    group_size: int


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dist.P2POp):
        return _nbytes(value.tensor)
    return 0


@contextlib.contextmanager
def count_collectives() -> Iterator[list[CollectiveCall]]:
    """``with count_collectives() as calls: ...`` fills ``calls`` with every collective issued."""
    calls: list[CollectiveCall] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    by_id = {id(fn): name for name, fn in originals.items()}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            group = kwargs.get("group")
            if name == "batch_isend_irecv":
                for op in args[0]:
                    calls.append(CollectiveCall(f"p2p_{op.op.__name__}", _nbytes(op.tensor),
                                                dist.get_world_size(op.group)))
            else:
                first = args[0] if args else next(iter(kwargs.values()), None)
                calls.append(CollectiveCall(name, _nbytes(first),
                                            2 if name in ("send", "recv") else dist.get_world_size(group)))
            return fn(*args, **kwargs)

        return counted

    wrapped = {name: wrap(name, fn) for name, fn in originals.items()}
    patched: list[tuple[object, str, object]] = []
    for name, fn in wrapped.items():
        patched.append((dist, name, originals[name]))
        setattr(dist, name, fn)
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith("megatron") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if callable(value) and id(value) in by_id:
                patched.append((module, attr, value))
                setattr(module, attr, wrapped[by_id[id(value)]])
    try:
        yield calls
    finally:
        for owner, attr, value in reversed(patched):
            setattr(owner, attr, value)


def summarize(calls: list[CollectiveCall]) -> dict[str, tuple[int, int]]:
    """``{op: (count, total bytes)}``."""
    out: dict[str, tuple[int, int]] = {}
    for c in calls:
        n, b = out.get(c.op, (0, 0))
        out[c.op] = (n + 1, b + c.nbytes)
    return dict(sorted(out.items()))
