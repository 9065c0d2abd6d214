"""Many ranks write one safetensors file, each its own shards, nothing gathered and nothing pickled.

Protocol (collective over the default group; ``root`` is one global rank):

1. ``root`` creates ``<path>.tmp`` at its final size with the header (every rank knows the layout,
   so every rank knows every tensor's byte range) and an identity token file next to it, then
   broadcasts the absolute path and the token (a few dozen bytes). Other ranks' own idea of the
   path does not matter: the file is where ``root`` said.
2. A rank that reads the same token at that path shares the file system with ``root`` and
   writes its shards straight into place (``pwrite``). A rank that does not (``/dev/shm`` on another
   node, a node-local disk) relays its shards to ``root`` point to point, one shard at a time,
   and ``root`` writes them: the bytes cross the network once and ``root`` holds one shard.
   ``direct=False`` relays every rank (for targets known to be local to ``root``).
3. Every writer fsyncs (when durable: inside :func:`mlora.formats.durable.durable_writes`, e.g. a checkpoint; the per-step
   hand-off to the engines needs visibility, not durability, and skips it); an 8-byte all-reduce makes any rank's failure an error on every rank;
   ``root`` renames the file into place (atomic), runs ``finish`` (e.g. the adapter config), and a
   last all-reduce keeps every rank in until the file is visible.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from mlora.formats.durable import fsync_dir, is_durable
from mlora.formats.safetensors_writer import Layout, PresizedSafetensors, TensorShard
from mlora.formats.weight_map import COLUMNS, REPLICATED, ROWS
from mlora.parallel.small_collectives import all_flags, collective_device, raise_if_any_failed

_DONE, _FAILED = -1, -2  # descriptor codes that end a relaying rank's stream
_SPLIT_DIM = {ROWS: 0, COLUMNS: 1}  # the dim a TP-sharded tensor is cut along (weight_map.shard)


def select_shards(shards: Iterable[tuple[str, torch.Tensor, str]], tp: int, tp_rank: int, dp_rank: int = 0
                  ) -> Iterator[TensorShard]:
    """What this rank writes of its ``shards`` ((tensor name, local tensor, TP kind) in an order the
    TP ranks of a stage share) when the ranks write one file together: nothing on DP ranks other than
    0 (the replicas hold the same values); a TP-sharded tensor (ROWS, COLUMNS) by every TP rank, its
    own chunk; a replicated one (or any at TP 1) by one TP rank, taken in turn so the TP ranks write alike."""
    if dp_rank != 0:
        return
    turn = 0
    for name, local, kind in shards:
        if kind == REPLICATED or tp == 1:
            turn += 1
            if (turn - 1) % tp == tp_rank:  # every TP rank of the stage walks the same order
                yield TensorShard(name, local)
        else:
            yield TensorShard(name, local, dim=_SPLIT_DIM[kind], index=tp_rank, parts=tp)
def _broadcast_target(path: Path | None, token: bytes, ok: bool, root: int) -> tuple[bool, str, bytes]:
    """``root``'s (ok, absolute path, token) on every rank, as int64/uint8 tensors."""
    device = collective_device()
    raw = str(path).encode() if path is not None else b""
    head = torch.tensor([int(ok), len(raw), len(token)], dtype=torch.int64, device=device)
    dist.broadcast(head, src=root)
    ok, n_path, n_token = (int(v) for v in head.tolist())
    body = torch.zeros(n_path + n_token, dtype=torch.uint8)
    if dist.get_rank() == root and n_path + n_token:
        body[:] = torch.frombuffer(bytearray(raw + token), dtype=torch.uint8)
    body = body.to(device)
    if n_path + n_token:
        dist.broadcast(body, src=root)
    data = bytes(body.cpu().numpy().tobytes())
    return bool(ok), data[:n_path].decode(), data[n_path:]


def _sees(token_file: Path, token: bytes) -> bool:
    try:
        return token_file.read_bytes() == token
    except OSError:
        return False


def _relay(shards: Iterable[TensorShard], file: PresizedSafetensors, names: list[str], root: int) -> None:
    """Send each shard to ``root``: a descriptor (layout index, dim or -1, index, parts, bytes), then its bytes."""
    device, index = collective_device(), {n: i for i, n in enumerate(names)}
    try:
        for shard in shards:
            file.check(shard)
            data = shard.tensor.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
            desc = [index[shard.name], -1 if shard.dim is None else shard.dim, shard.index, shard.parts, data.numel()]
            dist.send(torch.tensor(desc, dtype=torch.int64, device=device), dst=root)
            if data.numel():
                dist.send(data, dst=root)
    except Exception:
        dist.send(torch.tensor([_FAILED, 0, 0, 0, 0], dtype=torch.int64, device=device), dst=root)
        raise
    dist.send(torch.tensor([_DONE, 0, 0, 0, 0], dtype=torch.int64, device=device), dst=root)


def _receive(fd: int, file: PresizedSafetensors, names: list[str], src: int) -> BaseException | None:
    """``root``: write what rank ``src`` relays until it is done. Keeps receiving after a local error
    (the sender would otherwise block), and returns that error."""
    device, error = collective_device(), None
    desc = torch.empty(5, dtype=torch.int64, device=device)
    while True:
        dist.recv(desc, src=src)
        code, dim, index, parts, nbytes = (int(v) for v in desc.tolist())
        if code in (_DONE, _FAILED):  # a failed sender raises its own error in the next agreement
            return error
        data = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if nbytes:
            dist.recv(data, src=src)
        if error is not None:
            continue
        try:
            name = names[code]
            dtype, shape = file.layout[name]
            local = tuple(s // parts if d == dim else s for d, s in enumerate(shape))
            tensor = data.cpu().view(dtype).reshape(local)
            file.write(fd, TensorShard(name, tensor, None if dim < 0 else dim, index, parts))
        except Exception as exc:  # noqa: BLE001 - reported after the stream is drained
            error = exc
        del data


def _write_as_root(tmp: Path, file: PresizedSafetensors, shards: Iterable[TensorShard], names: list[str],
                   relaying: list[int], fsync: bool) -> BaseException | None:
    """Root writes its own shards, then drains every relaying rank, even after an error (a sender
    left waiting would hang); returns the first error."""
    error: BaseException | None = None
    fd = os.open(tmp, os.O_WRONLY)
    try:
        try:
            for shard in shards:
                file.write(fd, shard)
        except Exception as exc:  # noqa: BLE001
            error = exc
        for src in relaying:
            received = _receive(fd, file, names, src)  # always called: it drains the sender
            error = error or received
        if error is None and fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return error


def write_safetensors_collectively(path: str | os.PathLike, layout: Layout, shards: Iterable[TensorShard], *,
                                   root: int = 0, metadata: dict[str, str] | None = None, direct: bool | None = None,
                                   finish: Callable[[Path], None] | None = None, durable: bool | None = None) -> Path:
    """Collective over the default group: write the safetensors file ``path`` (as given on ``root``)
    from every rank's ``shards`` (see the module docstring). Returns the final path on every rank.

    ``layout`` (name -> (dtype, full shape), file order) must be identical on every rank; between
    them the ranks' shards must cover each tensor once. ``shards`` is consumed lazily (a generator
    keeps one shard's CPU copy in memory). ``direct``: None (each rank checks whether it sees the
    file), False (relay every shard to ``root``). ``finish(final_path)`` runs on ``root`` after the
    rename, before the last agreement (its failure is every rank's error). ``durable``: fsync data
    and directory (None: inside :func:`mlora.formats.durable.durable_writes` only).
    """
    durable = is_durable(durable)
    rank = dist.get_rank()
    file = PresizedSafetensors(layout, metadata)
    names = list(file.layout)
    error: BaseException | None = None
    target, token = None, b""
    if rank == root:
        try:
            target = Path(os.path.abspath(path))
            target.parent.mkdir(parents=True, exist_ok=True)
            file.create(target.with_name(target.name + ".tmp"), fsync=durable)
            token = secrets.token_bytes(16)
            target.with_name(target.name + ".tmp.id").write_bytes(token)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            error = exc
    ok, shared_path, token = _broadcast_target(target, token, error is None, root)
    if not ok:
        raise_if_any_failed(error, f"creating {Path(path).name}.tmp")  # root re-raises its own error
    final = Path(shared_path)
    tmp, token_file = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".tmp.id")
    sees = rank == root or (direct is not False and _sees(token_file, token))
    relaying = [r for r, seen in enumerate(all_flags(sees)) if not seen]
    try:
        if sees and rank != root:
            file.write_shards(tmp, shards, fsync=durable)
        elif not sees:
            _relay(shards, file, names, root)
        else:  # root: its own shards, then every relaying rank's, one shard at a time
            error = _write_as_root(tmp, file, shards, names, relaying, durable)
    except Exception as exc:  # noqa: BLE001
        error = error or exc
    try:
        raise_if_any_failed(error, f"writing {tmp}")
    except BaseException:
        if rank == root:
            tmp.unlink(missing_ok=True)
            token_file.unlink(missing_ok=True)
        raise
    if rank == root:
        try:
            os.replace(tmp, final)
            token_file.unlink(missing_ok=True)
            if finish is not None:
                finish(final)
            if durable:
                fsync_dir(final.parent)
        except Exception as exc:  # noqa: BLE001
            error = exc
    raise_if_any_failed(error, f"renaming {tmp} into place")  # nobody returns before the file is there
    return final

