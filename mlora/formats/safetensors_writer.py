"""Safetensors files written without holding them in memory.

- :class:`SafetensorsWriter`: one process streams a file, header first, then tensors one at a time
  (a rank writes a multi-GB shard while holding one tensor). The file appears atomically: data goes
  to ``<name>.tmp`` and is renamed when complete.
- :class:`PresizedSafetensors`: many processes write one file together. The header depends only on
  names, dtypes and shapes, so every rank computes the same byte range for every tensor; one rank
  creates the file at its final size with the header in place, then each rank writes (``pwrite``) the
  bytes of the tensors, or TP shards of tensors, it holds (:class:`TensorShard`) straight into
  their ranges. Nothing is gathered: a rank's extra memory is one shard's CPU copy at a time.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from mlora.formats.dtypes import SAFETENSORS_NAMES

Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]  # tensor name -> (dtype, shape), in file order


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def safetensors_header(layout: Layout, metadata: dict[str, str] | None = None
                       ) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The first bytes of a safetensors file holding ``layout`` (8-byte length, JSON header padded
    with spaces to 8 bytes, as safetensors writes it) and each tensor's ``[start, end)`` byte range
    in the file. Depends on names, dtypes, shapes and order only: every rank computes the same."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    spans: dict[str, tuple[int, int]] = {}
    for name, (dtype, shape) in layout.items():
        if dtype not in SAFETENSORS_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors name; "
                             f"supported: {', '.join(str(d) for d in SAFETENSORS_NAMES)}")
        nbytes = torch.Size(shape).numel() * _itemsize(dtype)
        header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        spans[name] = (offset, offset + nbytes)
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned, as safetensors does
    head = struct.pack("<Q", len(raw)) + raw
    return head, {name: (len(head) + a, len(head) + b) for name, (a, b) in spans.items()}


class SafetensorsWriter:
    """Write tensors named in ``layout`` (name -> (dtype, shape)), in that order."""

    def __init__(self, path: str | os.PathLike, layout: Layout, metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._order = list(layout)
        self._layout = layout
        head, _ = safetensors_header(layout, metadata)
        self._file = open(self._tmp, "wb")
        self._file.write(head)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self._order[self._next] if self._next < len(self._order) else None
        if name != expected:
            raise ValueError(f"tensor {name!r} written out of order; expected {expected!r}")
        dtype, shape = self._layout[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} is {tensor.dtype}{tuple(tensor.shape)}, "
                             f"the header promised {dtype}{tuple(shape)}")
        if tensor.numel():  # write the tensor's own bytes: no copy beyond .contiguous()/.cpu()
            self._file.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self._next += 1

    def close(self) -> None:
        """Finish the file; raises if tensors are missing (the partial file is removed)."""
        self._file.close()
        if self._next != len(self._order):
            self._tmp.unlink(missing_ok=True)
            raise ValueError(f"{self.path}: {len(self._order) - self._next} tensors were never written")
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


# ------------------------------------------------------------------ one file, many writers
@dataclass(frozen=True)
class TensorShard:
    """A rank's part of tensor ``name``: the whole tensor (``dim`` None) or chunk ``index`` of
    ``parts`` equal chunks along ``dim`` (how :func:`mlora.formats.weight_map.shard` cuts TP shards)."""

    name: str
    tensor: torch.Tensor
    dim: int | None = None
    index: int = 0
    parts: int = 1


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:  # pwrite may write less than asked (signals, some filesystems)
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class PresizedSafetensors:
    """A safetensors file with a precomputed header that several processes fill at fixed offsets.

    ``create`` (one rank) writes the header and sizes the file; then any rank writes
    :class:`TensorShard` objects into it (``write_shards``). A tensor split along ``dim`` lands as
    ``prod(shape[:dim])`` runs of contiguous bytes, one ``pwrite`` each (one run for dim 0).
    The bytes equal what :class:`SafetensorsWriter` writes for the assembled tensors.
    """

    def __init__(self, layout: Layout, metadata: dict[str, str] | None = None) -> None:
        self.layout = dict(layout)
        self.head, self.spans = safetensors_header(self.layout, metadata)
        self.size = max((b for _, b in self.spans.values()), default=len(self.head))

    def create(self, path: str | os.PathLike, fsync: bool = True) -> None:
        """Create (or truncate) ``path`` at the final size, header written, data zero (fsynced if asked)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _pwrite_all(fd, memoryview(self.head), 0)
            os.ftruncate(fd, self.size)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def check(self, shard: TensorShard) -> None:
        """Raise ValueError unless ``shard`` fits its tensor's dtype and shape."""
        if shard.name not in self.layout:
            raise ValueError(f"tensor {shard.name!r} is not in this file's layout ({len(self.layout)} tensors)")
        dtype, shape = self.layout[shard.name]
        got = tuple(shard.tensor.shape)
        if shard.tensor.dtype != dtype:
            raise ValueError(f"tensor {shard.name!r}: shard dtype {shard.tensor.dtype}, the header says {dtype}")
        if shard.dim is None:
            if got != tuple(shape):
                raise ValueError(f"tensor {shard.name!r} has shape {got}, the header says {tuple(shape)}")
            return
        if not 0 <= shard.dim < len(shape) or not 0 <= shard.index < shard.parts:
            raise ValueError(f"tensor {shard.name!r}: shard dim={shard.dim} index={shard.index} parts={shard.parts} "
                             f"is invalid for shape {tuple(shape)} (0 <= dim < {len(shape)}, 0 <= index < parts)")
        expected = tuple(s // shard.parts if d == shard.dim else s for d, s in enumerate(shape))
        if shape[shard.dim] % shard.parts or got != expected:
            raise ValueError(f"tensor {shard.name!r}: shard of shape {got} is not chunk {shard.index} of "
                             f"{shard.parts} along dim {shard.dim} of {tuple(shape)} (expected {expected})")

    def write(self, fd: int, shard: TensorShard) -> int:
        """``pwrite`` ``shard``'s bytes into its places in the open file ``fd``; returns the bytes written."""
        self.check(shard)
        start, end = self.spans[shard.name]
        local = shard.tensor.detach().to("cpu").contiguous()
        if local.numel() == 0:
            return 0
        raw = memoryview(local.reshape(-1).view(torch.uint8).numpy()).cast("B")
        if shard.dim is None or shard.dim == 0 or shard.parts == 1:
            _pwrite_all(fd, raw, start + shard.index * len(raw))
            return len(raw)
        _, shape = self.layout[shard.name]
        outer = torch.Size(shape[:shard.dim]).numel()
        run = len(raw) // outer  # bytes of this shard in one index of the leading dims
        stride = (end - start) // outer  # bytes of the full tensor in one index of the leading dims
        for o in range(outer):
            _pwrite_all(fd, raw[o * run:(o + 1) * run], start + o * stride + shard.index * run)
        return len(raw)

    def write_shards(self, path: str | os.PathLike, shards, fsync: bool = True) -> int:
        """Open the file ``create`` made, write every shard of the iterable ``shards`` (consumed lazily,
        so a generator keeps one shard in memory), fsync if asked; returns the bytes written. Without
        fsync the bytes are visible to readers after close (page cache; NFS flushes on close) but
        not crash-durable."""
        fd = os.open(path, os.O_WRONLY)
        total = 0
        try:
            for shard in shards:
                total += self.write(fd, shard)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return total
