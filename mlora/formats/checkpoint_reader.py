"""Per-rank reading of HF safetensors checkpoints: only the tensors and slices a rank holds.

Reads with ``os.pread`` on byte ranges computed from the safetensors header, so a rank
touches exactly the bytes of its slices (and ``bytes_read`` is what it asked the OS for).
Handles single files and sharded checkpoints with ``model.safetensors.index.json``.
FP8 tensors (``F8_E4M3`` / ``F8_E5M2``) are read raw, as float8 (one byte per element); block-quantized
Hub FP8 weights are dequantized by :func:`mlora.formats.fp8_checkpoint.read_dequantized`.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from mlora.formats.dtypes import SAFETENSORS_DTYPES

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Files of an HF checkpoint directory besides its weights, copied verbatim by merged exports.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
              "chat_template.jinja")


class CheckpointError(ValueError):
    """A checkpoint directory or file that cannot be read as asked."""


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in the file
    nbytes: int


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Parse one safetensors file's header; checks that the file holds all the bytes it promises."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is truncated: {size} bytes, not even a safetensors header")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise CheckpointError(
                f"{path} is truncated: its header needs {8 + header_len} bytes, the file has {size}")
        try:
            header = json.loads(f.read(header_len))
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path} is not a safetensors file: bad header ({exc})") from exc
    metadata = header.pop("__metadata__", None) or {}
    entries = {}
    data_start = 8 + header_len
    data_end = data_start
    for name, info in header.items():
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        entries[name] = TensorEntry(path, SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]),
                                    data_start + begin, end - begin)
        data_end = max(data_end, data_start + end)
    if data_end > size:
        raise CheckpointError(
            f"{path} is truncated: its header describes {data_end} bytes of tensors, the file has {size}; "
            "re-download or re-save the checkpoint")
    return entries, metadata


class CheckpointReader:
    """Random access to the tensors of an HF checkpoint directory, by name and by slice."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.entries: dict[str, TensorEntry] = {}
        self.bytes_read = 0
        self._fds: dict[Path, int] = {}
        self._derived: dict[str, Callable[[], torch.Tensor]] = {}  # name -> its whole tensor, computed (derive)
        for file in self._files():
            entries, _ = read_safetensors_header(file)
            self.entries.update(entries)

    def _files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({self.directory / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise CheckpointError(
                    f"{index} lists files that are missing from {self.directory}: {', '.join(missing)}")
            return files
        if (self.directory / SINGLE_FILE).exists():
            return [self.directory / SINGLE_FILE]
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            others = sorted(p.name for p in self.directory.glob("*.bin"))
            hint = f" (found {', '.join(others)}: save it with safe_serialization=True)" if others else ""
            raise CheckpointError(f"no *.safetensors files in {self.directory}{hint}")
        return files

    @property
    def total_bytes(self) -> int:
        """Size of all tensor data in the checkpoint."""
        return sum(e.nbytes for n, e in self.entries.items() if n not in self._derived)

    def is_derived(self, name: str) -> bool:
        """Whether tensor ``name`` is computed from others (:meth:`derive`) rather than stored."""
        return name in self._derived

    def derive(self, name: str, like: TensorEntry, shape: tuple[int, ...], make: Callable[[], torch.Tensor]) -> None:
        """Add tensor ``name`` of ``shape`` (``like``'s dtype and file), computed whole by ``make`` from the
        file's tensors when read: a layout the file holds in another arrangement (gpt-oss's interleaved,
        transposed experts, :mod:`mlora.formats.fused_experts`)."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=like.dtype).element_size()
        self.entries[name] = TensorEntry(like.file, like.dtype, tuple(shape), -1, nbytes)
        self._derived[name] = make

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.directory}") from None

    def _pread(self, entry: TensorEntry, offset: int, nbytes: int) -> bytes:
        fd = self._fds.get(entry.file)
        if fd is None:
            fd = self._fds[entry.file] = os.open(entry.file, os.O_RDONLY)
        data = os.pread(fd, nbytes, entry.offset + offset)
        if len(data) != nbytes:
            raise CheckpointError(f"{entry.file} is truncated: short read at byte {entry.offset + offset}")
        self.bytes_read += nbytes
        return data

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The tensor ``name``, or its ``[start:stop]`` slice along ``dim``, reading only those bytes."""
        entry = self.entry(name)
        if name in self._derived:
            whole = self._derived[name]()
            if dim is None:
                return whole
            stop = whole.shape[dim] if stop is None else stop
            return whole.narrow(dim, start, stop - start).contiguous()
        shape = list(entry.shape)
        if dim is None:
            dim, start, stop = 0, 0, (shape[0] if shape else 1)
        stop = shape[dim] if stop is None else stop
        if not 0 <= start <= stop <= shape[dim]:
            raise CheckpointError(f"slice [{start}:{stop}] of dim {dim} is outside {name} of shape {tuple(shape)}")
        item = torch.empty((), dtype=entry.dtype).element_size()
        outer = 1
        for s in shape[:dim]:
            outer *= s
        inner = item
        for s in shape[dim + 1:]:
            inner *= s
        row, chunk = shape[dim] * inner if shape else item, (stop - start) * inner if shape else item
        if outer == 1 or chunk == row:
            raw = self._pread(entry, start * inner, outer * chunk if chunk == row else chunk)
        else:
            raw = b"".join(self._pread(entry, o * row + start * inner, chunk) for o in range(outer))
        out_shape = shape[:dim] + [stop - start] + shape[dim + 1:] if shape else []
        if not raw:
            return torch.empty(out_shape, dtype=entry.dtype)
        return torch.frombuffer(bytearray(raw), dtype=entry.dtype).reshape(out_shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
