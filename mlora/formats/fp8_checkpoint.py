"""Hub FP8 checkpoints (block-quantized e4m3, DeepSeek-V3 / Qwen "-FP8" style): validate and dequantize.

Such a checkpoint says so in ``config.json``::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}

Each quantized linear ``X.weight`` is stored as ``float8_e4m3fn`` ``[out, in]`` next to
``X.weight_scale_inv``, float32 ``[ceil(out / 128), ceil(in / 128)]``: the real weight is the fp8 value
times the scale of its 128 x 128 block (the last blocks of a row or column may be partial). Everything
else (embeddings, norms, ``lm_head``) is stored in bf16 as usual.

What mlora does with them: it does **not** keep the 128 x 128 block scales. Every frozen linear is read
slice by slice with :func:`read_dequantized` (only the fp8 bytes of the slice and the block scales that
cover it), giving float32 values that are exactly ``fp8 * block scale``. Then

- with ``fp8="torch"`` the slice is requantized to mlora's own format, e4m3 with one float32 scale per
  output row (amax / 448 over the whole unsharded row), the same path as a bf16 checkpoint takes;
- with a float32 / bf16 base (``fp8=None``) the dequantized slice is cast to ``dtype``.

Requantizing a block-quantized weight to rows is a second rounding (block scales and row scales differ),
so an FP8 base loaded from a Hub FP8 checkpoint is close to, not bit-equal to, the published weights.
``activation_scheme`` must be ``dynamic``: mlora always quantizes inputs per token at run time.
"""

from __future__ import annotations

import math

import torch

from mlora.formats.checkpoint_reader import CheckpointError, CheckpointReader

SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv"
SUPPORTED = ('quant_method "fp8" with fmt "e4m3", activation_scheme "dynamic" and '
             'weight_block_size [rows, cols] (e.g. [128, 128], the Qwen "-FP8" / DeepSeek-V3 format)')


def fp8_quantization_config(hf_config: dict) -> dict | None:
    """The normalized ``quantization_config`` of an FP8 block-quantized checkpoint, or None when unquantized.

    Returns ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
    "weight_block_size": (rows, cols)}``; raises ValueError naming the field for anything else.
    """
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be a mapping, got {type(qc).__name__}; mlora supports "
                         + SUPPORTED)
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method is {method!r}: mlora loads only {SUPPORTED}; "
                         "dequantize the checkpoint (or use its bf16 release) for other methods")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt is {fmt!r}: mlora supports only 'e4m3' weights ({SUPPORTED})")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme is {scheme!r}: mlora supports only 'dynamic' "
                         f"(inputs quantized per token at run time; {SUPPORTED})")
    block = qc.get("weight_block_size")
    if block is None:
        raise ValueError("quantization_config.weight_block_size is missing: mlora supports only block-quantized "
                         f"FP8 checkpoints with weight_scale_inv per block ({SUPPORTED}); per-tensor or "
                         "per-channel FP8 checkpoints are not supported")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size is {block!r}: it must be a pair of positive "
                         f"integers [rows, cols] ({SUPPORTED})")
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": (block[0], block[1])}


def is_block_quantized(reader: CheckpointReader, name: str) -> bool:
    """Whether ``name`` is stored as float8 with a ``<name>_scale_inv`` next to it."""
    return reader.entry(name).dtype == torch.float8_e4m3fn and (name + SCALE_SUFFIX) in reader


def _blocks(start: int, stop: int, size: int) -> tuple[int, int]:
    """The block range ``[b0, b1)`` that covers elements ``[start, stop)``."""
    return start // size, (stop + size - 1) // size


def _expand(scales: torch.Tensor, dim: int, start: int, stop: int, size: int) -> torch.Tensor:
    """Repeat block scales along ``dim`` to one per element of ``[start:stop]`` (block-aligned first)."""
    b0 = start // size
    rep = scales.repeat_interleave(size, dim=dim)
    return rep.narrow(dim, start - b0 * size, stop - start)


def read_dequantized(reader: CheckpointReader, name: str, dim: int | None = None, start: int = 0,
                     stop: int | None = None, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """``reader.read(name, dim, start, stop)`` as float32, dequantized when ``name`` is block-quantized FP8.

    For a float8_e4m3fn ``[out, in]`` weight with ``<name>_scale_inv`` ``[ceil(out/br), ceil(in/bc)]``,
    reads only the fp8 bytes of the slice and the scale blocks that cover it, and returns
    ``fp8.float() * scale`` of each element's block (exact float32 products). Other tensors (bf16 norms,
    embeddings, ...) are read as they are and returned as float32.
    """
    entry = reader.entry(name)
    if entry.dtype != torch.float8_e4m3fn:
        if entry.dtype == torch.float8_e5m2:
            raise CheckpointError(f"{name} is stored as float8_e5m2: mlora reads only e4m3 FP8 checkpoints")
        return reader.read(name, dim, start, stop).float()
    scale_name = name + SCALE_SUFFIX
    if scale_name not in reader:
        raise CheckpointError(f"{name} is stored as float8_e4m3fn but {scale_name} is missing from the "
                              f"checkpoint in {reader.directory}: cannot dequantize it")
    if len(entry.shape) != 2:
        raise CheckpointError(f"{name} is float8 of shape {entry.shape}: only 2-D [out, in] weights are supported")
    br, bc = block
    out, inp = entry.shape
    want = (math.ceil(out / br), math.ceil(inp / bc))
    got = reader.entry(scale_name).shape
    if tuple(got) != want:
        raise CheckpointError(f"{scale_name} has shape {tuple(got)}; {name} {tuple(entry.shape)} with "
                              f"weight_block_size [{br}, {bc}] needs {want}")
    if reader.entry(scale_name).dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise CheckpointError(f"{scale_name} is {reader.entry(scale_name).dtype}; expected float32 block scales")
    w = reader.read(name, dim, start, stop).float()
    if dim is None:
        scales = reader.read(scale_name).float()
        return w * _expand(_expand(scales, 0, 0, out, br), 1, 0, inp, bc)
    if dim not in (0, 1):
        raise CheckpointError(f"dim {dim} is not a dimension of the 2-D weight {name}")
    stop = entry.shape[dim] if stop is None else stop
    if stop == start:
        return w
    size = (br, bc)[dim]
    b0, b1 = _blocks(start, stop, size)
    scales = reader.read(scale_name, dim, b0, b1).float()
    scales = _expand(scales, dim, start, stop, size)
    other = 1 - dim
    scales = _expand(scales, other, 0, entry.shape[other], (br, bc)[other])
    return w * scales


class DequantizingReader:
    """A :class:`CheckpointReader` whose ``read`` returns :func:`read_dequantized` slices: the loader's
    weight maps read a Hub FP8 checkpoint through it exactly as they read a bf16 one."""

    def __init__(self, reader: CheckpointReader, block: tuple[int, int]) -> None:
        self.reader, self.block = reader, tuple(block)

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return read_dequantized(self.reader, name, dim, start, stop, block=self.block)

    def __contains__(self, name: str) -> bool:
        return name in self.reader

    def __getattr__(self, attr: str):
        return getattr(self.reader, attr)
