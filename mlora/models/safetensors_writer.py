"""Streaming safetensors writer: header first, then tensors one at a time.

Lets a rank write a multi-GB shard while holding one tensor in memory. Files appear
atomically: data goes to ``<name>.tmp`` and is renamed when complete.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


class SafetensorsWriter:
    """Write tensors named in ``layout`` (name -> (dtype, shape)), in that order."""

    def __init__(self, path: str | os.PathLike, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._order = list(layout)
        self._layout = layout
        header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        for name, (dtype, shape) in layout.items():
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned, as safetensors does
        self._file = open(self._tmp, "wb")
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)
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
