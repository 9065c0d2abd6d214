"""Small control-plane collectives without pickle: agreeing on failure, gathering JSON metadata.

``torch.distributed``'s ``*_object`` collectives pickle their payloads (arbitrary code on unpickling,
and a hidden copy of every tensor they carry). The file writers of adapters, checkpoints and merged
models exchange only small metadata, so these helpers send it as bytes in plain tensor collectives.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from pathlib import Path

import torch
import torch.distributed as dist


def collective_device(group=None) -> torch.device:
    """Where a control tensor must live for ``group``'s backend (NCCL only moves CUDA tensors)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def raise_if_any_failed(error: BaseException | None, what: str, group=None) -> None:
    """Collective over ``group``: every rank learns whether any rank failed ``what``.

    A rank passes the exception it caught (or None). The failing rank re-raises its own; the others
    raise a RuntimeError naming the lowest failing rank, so no rank waits forever in a later
    collective for a peer that gave up. One 8-byte all-reduce.
    """
    rank = dist.get_rank()
    world = dist.get_world_size()
    # MAX of (world - rank) names the lowest failing rank; 0 means nobody failed
    flag = torch.tensor([0 if error is None else world - rank], dtype=torch.int64, device=collective_device(group))
    if dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if int(flag.item()):
        raise RuntimeError(f"{what} failed on rank {world - int(flag.item())}; its log has the error")


def gather_json(obj, dst: int = 0) -> list | None:
    """Every rank's JSON-serialisable ``obj``, in rank order, on global rank ``dst`` (None elsewhere).

    Collective over the default group: the lengths are all-gathered (8 bytes a rank), then the
    UTF-8 JSON texts, padded to the longest, are gathered to ``dst``. Meant for small metadata
    (file names and sizes, layouts); it is not a tensor transport.
    """
    data = json.dumps(obj, sort_keys=True).encode()
    world, device = dist.get_world_size(), collective_device()
    if world == 1:
        return [json.loads(data)]
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(max(lengths), 1), dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(device)
    parts = [torch.empty_like(buf) for _ in range(world)] if dist.get_rank() == dst else None
    dist.gather(buf, parts, dst=dst)
    if parts is None:
        return None
    return [json.loads(bytes(p[:n].cpu().numpy().tobytes())) for p, n in zip(parts, lengths)]


def broadcast_json(obj, src: int = 0):
    """Global rank ``src``'s JSON-serialisable ``obj`` on every rank (``obj`` is ignored elsewhere)."""
    device = collective_device()
    data = json.dumps(obj).encode() if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8)
    if data:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(device)
    dist.broadcast(buf, src=src)
    return json.loads(bytes(buf.cpu().numpy().tobytes()))


def all_flags(flag: bool) -> list[bool]:
    """Every rank's ``flag``, in rank order, on every rank (one int64 per rank)."""
    device = collective_device()
    flags = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, torch.tensor([int(flag)], dtype=torch.int64, device=device))
    return [bool(int(f.item())) for f in flags]


def ranks_seeing(create, probe, what: str) -> tuple[str, list[bool]]:
    """Collective: which ranks see what global rank 0 made; returns ``(token, seen by rank)``. Rank 0 calls ``create()`` (it returns a fresh
    random token, e.g. the name or content of a file or shared-memory segment it made), every other rank
    ``probe(token)`` (True when it finds that token). A failure of ``create`` is every rank's error
    (``what`` names it). Token checks, not host names: containers of one host may not share a file
    system or ``/dev/shm``, and nodes of a cluster may share one."""
    error, token = None, None
    if dist.get_rank() == 0:
        try:
            token = create()
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            error = exc
    raise_if_any_failed(error, what)
    token = broadcast_json(token)
    return token, all_flags(dist.get_rank() == 0 or bool(probe(token)))


def ranks_seeing_folder(folder: Path, what: str) -> list[bool]:
    """Collective: which ranks see the files global rank 0 writes in ``folder`` (a token file there, removed
    again once every rank looked, and ``folder`` itself when the check made it and it is still empty)."""
    made: list[Path] = []
    existed = folder.is_dir()

    def create() -> str:
        folder.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(16)
        made.append(folder / f".mlora-shared-{token}")
        made[0].write_text(token)
        return token

    def probe(token: str) -> bool:
        try:
            return (folder / f".mlora-shared-{token}").read_text() == token
        except OSError:
            return False

    _, seen = ranks_seeing(create, probe, what)
    for f in made:  # rank 0
        f.unlink(missing_ok=True)
        if not existed:
            with contextlib.suppress(OSError):  # not empty: something else writes there now
                folder.rmdir()
    return seen
