"""torch-native FP8 (e4m3) for the frozen base: the quantization recipe and the GEMM.

The contract (tests/test_fp8.py holds the implementation to an independent fake-quant reference):

- weights: ``torch.float8_e4m3fn`` with one float32 scale per output row,
  ``scale = max(amax, EPS) / 448`` over the *whole unsharded row*; ``q = clamp(w / scale, ±448)``
  rounded to e4m3. A row-parallel shard holds a slice of each row: each rank takes the per-row
  amax of its slice and the TP group all-reduces MAX, so no rank reads more than its slice and the
  scales do not depend on the mesh.
- inputs: quantized dynamically per token, ``scale = max(amax, EPS) / 448`` over the token's *whole*
  feature row. A column-parallel input is whole on every rank (replicated after megatron's copy or
  SP all-gather). A row-parallel input (``linear_proj``, ``linear_fc2``; with or without sequence
  parallelism) holds a slice of the features on each TP rank: each rank takes the per-token amax of
  its slice and the TP group all-reduces MAX -- M floats per linear, not the M x K input -- so every
  rank quantizes with the scale TP1 would use, and FP8 logits at any TP x PP (x SP) equal TP1's up
  to the summation order of the float32 partial products. The amax is a scale, not a function the
  backward differentiates (straight-through: see :class:`_FP8Linear`).
- GEMM: ``torch._scaled_mm(x_q, w_qᵀ, scale_a=[M, 1], scale_b=[1, N])`` with float32
  accumulation, output in the compute dtype. Where ``_scaled_mm`` is missing or fails, or on a
  CUDA device below compute capability 8.9, :class:`FP8Unsupported` — never a silent upcast.

This is the contract of the torch backend only. Transformer Engine (``fp8="te"``, :mod:`mlora.models.te`)
keeps its own recipes' semantics (per-tensor delayed / current scaling, MXFP8 blocks, ...), which are
computed on each rank's local GEMM operands and so are not promised to be mesh independent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

FP8_BACKENDS = ("torch", "te")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
EPS = 1e-12  # amax floor: an all-zero row or token gets a tiny scale, not 0/0
# The frozen linears stored in FP8 (megatron module names); embeddings, norms, output layer stay in dtype.
FP8_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
_NO_ADAPTER_DTYPES = {FP8_DTYPE, getattr(torch, "float8_e5m2", None), getattr(torch, "float8_e4m3fnuz", None),
                      getattr(torch, "float8_e5m2fnuz", None)} - {None}


class FP8Unsupported(RuntimeError):
    """FP8 GEMMs are not available on this device / torch build."""


def check_fp8_arg(fp8: str | None) -> str | None:
    """``fp8`` as given, or ValueError naming the valid values."""
    if fp8 is None or fp8 in FP8_BACKENDS:
        return fp8
    raise ValueError(f"fp8={fp8!r} is not supported; valid values: None, " + ", ".join(repr(b) for b in FP8_BACKENDS))


def check_adapter_dtype(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` if it can hold trainable adapters (a float of at least 16 bits), else ValueError."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype in _NO_ADAPTER_DTYPES \
            or dtype.itemsize < 2:
        raise ValueError(f"dtype={dtype!r} cannot hold trainable adapters and heads: use a floating-point dtype of "
                         f"16 bits or more (torch.bfloat16, torch.float16, torch.float32); FP8 storage of the frozen "
                         f"base is chosen with fp8='torch' or fp8='te', not with dtype")
    return dtype


def require_scaled_mm(device: torch.device | str, dtype: torch.dtype = torch.float32) -> None:
    """FP8Unsupported unless ``torch._scaled_mm`` runs rowwise-scaled e4m3 GEMMs on ``device`` with an output
    in ``dtype``, the model's: the probe asks for what the layers will ask for (a stack whose rowwise FP8
    GEMM writes only bf16, e.g. CUTLASS paths on sm89, serves a bf16 model although it refuses float32)."""
    device = torch.device(device)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise FP8Unsupported(f"fp8='torch' needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, "
                                 f"Blackwell); {torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}. "
                                 f"Use fp8=None with dtype=torch.bfloat16")
    a = torch.ones(16, 16, device=device).to(FP8_DTYPE)
    ones = torch.ones(16, 1, device=device)
    _scaled_mm(a, ones, a, ones.view(16), dtype)


def _scaled_mm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """``(xq · sx) @ (wq · sw)ᵀ`` via ``torch._scaled_mm``: xq ``[M, K]``, sx ``[M, 1]``, wq ``[N, K]``,
    sw ``[N]``; float32 accumulation, result in ``out_dtype``."""
    direct = out_dtype in (torch.float32, torch.bfloat16)
    try:
        out = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.view(1, -1),
                               out_dtype=out_dtype if direct else torch.float32)
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        raise FP8Unsupported(f"torch._scaled_mm with float8_e4m3fn and rowwise scales is unavailable on "
                             f"{xq.device} with torch {torch.__version__} ({type(e).__name__}: {e}); fp8='torch' "
                             f"does not fall back to a higher-precision GEMM: use fp8=None") from e
    if isinstance(out, tuple):  # older torch returned (out, amax)
        out = out[0]
    return out if direct else out.to(out_dtype)


def _scales(amax: torch.Tensor) -> torch.Tensor:
    return amax.float().clamp(min=EPS) / FP8_MAX


def _quantize(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t / scale`` (scale broadcast over the last dim) saturated to ±448, rounded to e4m3."""
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_weight(w: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_fp8 [N, K], scale [N] float32)``. ``group``: the TP group over which ``w``'s rows are
    split (a row-parallel shard): the per-row amax is all-reduced MAX over it, so the scale covers
    the whole unsharded row. None: ``w`` holds whole rows."""
    amax = w.detach().abs().amax(dim=-1).float()
    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = _scales(amax)
    return _quantize(w.detach(), scale.unsqueeze(-1)), scale


def quantize_tokens(x: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization of ``x [M, K]``: ``(x_fp8 [M, K], scale [M, 1] float32)``. ``group``: the
    TP group over which ``x``'s features are split (a row-parallel input): the per-token amax of this
    rank's slice is all-reduced MAX over it, so the scale covers the token's whole feature row and
    equals the unsharded one. None: ``x`` holds whole rows."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = _scales(amax)
    return _quantize(x.detach(), scale), scale


def dequantize_rows(wq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``wq · scale`` per row, in ``dtype``."""
    return (wq.float() * scale.float().unsqueeze(-1)).to(dtype)


class _FP8Linear(torch.autograd.Function):
    """``x Wᵀ`` with W frozen in FP8 and x quantized per token (forward only in FP8).

    Backward: no weight gradient (the base is frozen); the input gradient is
    ``grad @ dequantize(W)`` = ``(grad · diag(scale)) @ W_fp8`` in the gradient's dtype (the
    dequantized weight, not an FP8 GEMM, and not the pre-quantization weight, which no longer exists).
    The input's quantization, its per-token scale included (and that scale's all-reduce over the TP
    group of a row-parallel input), is passed straight through: neither is differentiated, so the
    backward needs no collective of its own and a row-parallel rank's input gradient is
    ``grad @ dequantize(W_i)`` of its own slice, as without FP8."""

    @staticmethod
    def forward(ctx, x, wq, sw, group):
        lead = x.shape[:-1]
        xq, sx = quantize_tokens(x.reshape(-1, x.shape[-1]), group)
        out = _scaled_mm(xq, sx, wq, sw, x.dtype)
        ctx.save_for_backward(wq, sw)
        return out.view(*lead, out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        wq, sw = ctx.saved_tensors
        gx = None
        if ctx.needs_input_grad[0]:
            # (grad · diag(sw)) @ wq == grad @ dequantize(W); e4m3 -> grad.dtype is exact, so the only
            # temporary is one copy of W in grad.dtype (dequantizing first would make a float32 one)
            gx = (grad * sw.to(grad.dtype)) @ wq.to(grad.dtype)
        return gx, None, None, None


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, group=None) -> torch.Tensor:
    """``x @ (wq · scale)ᵀ`` with ``x`` quantized per token, through ``torch._scaled_mm``; output in
    ``x.dtype``. ``group``: for a row-parallel linear, the TP group over which ``x``'s features (and
    ``wq``'s input dim) are split, so that the per-token scale is taken over the whole row (one
    all-reduce MAX of M floats); None (column-parallel, or TP 1): ``x`` holds whole rows. See
    :class:`_FP8Linear` for the backward."""
    return _FP8Linear.apply(x, wq, scale, group)
