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
  A stack whose rowwise FP8 GEMM writes bf16 only (CUTLASS path: cuBLAS < 12.9 or sm89) gets a bf16
  output cast to the compute dtype, decided once per device by the probe and logged once.
- shapes: on CUDA ``_scaled_mm`` needs each local GEMM's K and N to be multiples of 16 (M is free), so a
  model whose TP split leaves a linear with another K or N is refused when it is built
  (:func:`fp8_shape_problems`, applied by :func:`mlora.models.megatron_build.check_fp8_shapes`:
  :class:`FP8ShapeError` naming the layer and the TP sizes that work).

This is the contract of the torch backend only. Transformer Engine (``fp8="te"``, :mod:`mlora.models.te`)
keeps its own recipes' semantics (per-tensor delayed / current scaling, MXFP8 blocks, ...), which are
computed on each rank's local GEMM operands and so are not promised to be mesh independent.
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch
import torch.distributed as dist

FP8_BACKENDS = ("torch", "te")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
EPS = 1e-12  # amax floor: an all-zero row or token gets a tiny scale, not 0/0
# The frozen linears stored in FP8 (megatron module names); embeddings, norms, output layer stay in dtype.
FP8_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# torch._scaled_mm on CUDA (torch 2.13, aten/src/ATen/native/cuda/ScaledBlas.cpp, _scaled_mm_out_cuda; Blas.cpp
# before the split, same checks):
#   TORCH_CHECK(mat1.sizes()[1] % 16 == 0, "Expected trailing dimension of mat1 to be divisible by 16 ...")
#   TORCH_CHECK(mat2.sizes()[0] % 16 == 0 && mat2.sizes()[1] % 16 == 0, "mat2 shape (...) must be divisible by 16")
# mat1 = x [M, K], mat2 = Wᵀ [K, N]: K and N must be multiples of 16. M (tokens) is not checked, and the CUTLASS
# rowwise kernel pads its [M, 1] scale to 256 rows itself (RowwiseScaledMM.cu, pytorch issue 133334), so token
# counts need no padding. CPU's _scaled_mm has no such rule: the check is applied for CUDA devices only.
SCALED_MM_MULTIPLE = 16
_LOG = logging.getLogger("mlora")
# Devices (str) whose rowwise FP8 GEMM refused a float32 output and wrote bf16: later GEMMs there ask for bf16 at
# once. ScaledBlas.cpp sends rowwise scaling on cuBLAS < 12.9 or compute capability < 9.0 to CUTLASS
# (f8f8bf16_rowwise), which older torch limits to bf16: TORCH_CHECK(_VALUE)(out.dtype() == kBFloat16, "Only bf16
# high precision output types are supported for row-wise scaling.") -- a RuntimeError, or a ValueError where
# TORCH_CHECK_VALUE is used; torch 2.13 also accepts fp16 and fp32 there.
_BF16_OUTPUT_DEVICES: set[str] = set()
_NO_ADAPTER_DTYPES = {FP8_DTYPE, getattr(torch, "float8_e5m2", None), getattr(torch, "float8_e4m3fnuz", None),
                      getattr(torch, "float8_e5m2fnuz", None)} - {None}


class FP8Unsupported(RuntimeError):
    """FP8 GEMMs are not available on this device / torch build."""


class FP8ShapeError(FP8Unsupported, ValueError):
    """The FP8 GEMMs of this model at this TP size have shapes ``torch._scaled_mm`` refuses on CUDA: FP8 is
    unavailable (an :class:`FP8Unsupported`) because of an argument value, the TP size (a ValueError)."""


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
    in ``dtype``, the model's: the probe asks for what the layers will ask for -- rowwise scales, a token count
    that is no multiple of 16, the model's output dtype -- through the layers' own :func:`_scaled_mm`, so a
    stack whose rowwise FP8 GEMM writes only bf16 (CUTLASS on sm89, cuBLAS < 12.9) is found here, at build,
    and every later GEMM on ``device`` asks for bf16 and casts (logged once). The result is checked: small
    integers, exact in float32 and bf16."""
    device = torch.device(device)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise FP8Unsupported(f"fp8='torch' needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, "
                                 f"Blackwell); {torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}. "
                                 f"Use fp8=None with dtype=torch.bfloat16")
    m, k, n = 17, 32, 48
    x = (torch.arange(m * k, device=device) % 5 - 2).float().view(m, k)  # values -2..2: e4m3-exact
    w = (torch.arange(n * k, device=device) % 3 - 1).float().view(n, k)
    out = _scaled_mm(x.to(FP8_DTYPE), torch.ones(m, 1, device=device), w.to(FP8_DTYPE), torch.ones(n, device=device),
                     dtype)
    if not torch.equal(out.float(), x @ w.t()):  # |sums| <= 64: exact in any output dtype
        raise FP8Unsupported(f"torch._scaled_mm on {device} with torch {torch.__version__} returned a wrong result "
                             f"for a small exact rowwise e4m3 GEMM; fp8='torch' cannot be trusted here: use fp8=None")


def _scaled_mm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """``(xq · sx) @ (wq · sw)ᵀ`` via ``torch._scaled_mm``: xq ``[M, K]``, sx ``[M, 1]``, wq ``[N, K]``,
    sw ``[N]``; float32 accumulation, result in ``out_dtype``.

    ``_scaled_mm`` writes ``out_dtype`` where it can (float32, bfloat16), else float32 then cast. Where a
    float32 output is refused and a bfloat16 one works (see ``_BF16_OUTPUT_DEVICES``), it writes bfloat16 and
    casts, from then on for this device, logged once: the GEMM is the same FP8 GEMM with float32
    accumulation, only its output is rounded to bf16 (relative 2^-9, far below e4m3's input rounding)."""
    device = str(xq.device)
    want = out_dtype if out_dtype in (torch.float32, torch.bfloat16) else torch.float32
    if device in _BF16_OUTPUT_DEVICES:
        want = torch.bfloat16
    try:
        out = _call_scaled_mm(xq, sx, wq, sw, want)
    except torch.OutOfMemoryError:
        raise  # memory, not a missing FP8 path
    except AttributeError as e:  # no torch._scaled_mm in this torch
        raise _unsupported(xq, e) from e
    except (ValueError, RuntimeError) as e:  # RuntimeError includes NotImplementedError (no kernel)
        if want == torch.bfloat16:
            raise _unsupported(xq, e) from e
        try:
            out = _call_scaled_mm(xq, sx, wq, sw, torch.bfloat16)
        except (ValueError, RuntimeError):
            raise _unsupported(xq, e) from e  # the first failure is the one that explains
        _BF16_OUTPUT_DEVICES.add(device)
        _LOG.warning("fp8='torch': torch._scaled_mm on %s refuses a %s output for rowwise-scaled e4m3 GEMMs (%s: %s; "
                     "older cuBLAS/CUTLASS write bf16 only): the FP8 GEMMs on %s write bf16 and cast to %s",
                     device, want, type(e).__name__, e, device, out_dtype)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def _call_scaled_mm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    out = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.view(1, -1), out_dtype=out_dtype)
    return out[0] if isinstance(out, tuple) else out  # older torch returned (out, amax)


def _unsupported(xq: torch.Tensor, e: BaseException) -> FP8Unsupported:
    return FP8Unsupported(f"torch._scaled_mm with float8_e4m3fn and rowwise scales is unavailable on "
                          f"{xq.device} with torch {torch.__version__} ({type(e).__name__}: {e}); fp8='torch' "
                          f"does not fall back to a higher-precision GEMM: use fp8=None")


def fp8_shape_problems(shapes: Mapping[str, tuple[int, int]]) -> list[str]:
    """One line per linear whose local GEMM (``{layer: (K, N)}``, as :func:`fp8_local_shapes` gives) CUDA's
    ``torch._scaled_mm`` refuses: K or N not a multiple of 16 (see ``SCALED_MM_MULTIPLE``); [] if all fit.
    The model-level check that applies it when a model is built for CUDA is
    :func:`mlora.models.megatron_build.check_fp8_shapes` (this package knows no model)."""
    problems = []
    for name, (k, n) in shapes.items():
        bad = [f"{dim}={v}" for dim, v in (("K", k), ("N", n)) if v % SCALED_MM_MULTIPLE]
        if bad:
            problems.append(f"{name} (local GEMM K={k}, N={n}): {' and '.join(bad)} not a multiple of "
                            f"{SCALED_MM_MULTIPLE}")
    return problems


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
