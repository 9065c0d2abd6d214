"""FP8 storage and GEMMs for the frozen base (DESIGN principle 7).

``fp8="torch"``: the frozen linears (``linear_qkv``, ``linear_proj``, ``linear_fc1``,
``linear_fc2``) hold ``torch.float8_e4m3fn`` weights with one float32 scale per output row
(amax/448 over the whole unsharded row) and multiply inputs quantized per token through
``torch._scaled_mm`` (:mod:`mlora.fp8.quant`); on CUDA the model is checked at build for GEMM shapes
``_scaled_mm`` refuses (:func:`fp8_shape_problems`, applied by
:func:`mlora.models.megatron_build.check_fp8_shapes`). ``fp8="te"``: Transformer Engine (:mod:`mlora.models.te`,
imported lazily: TE is optional and a broken TE install breaks ``import megatron.core``).
"""

from mlora.fp8.quant import (
                             FP8_BACKENDS,
                             FP8_DTYPE,
                             FP8_LINEARS,
                             FP8_MAX,
                             FP8ShapeError,
                             FP8Unsupported,
                             check_adapter_dtype,
                             check_fp8_arg,
                             dequantize_rows,
                             fp8_linear,
                             fp8_shape_problems,
                             quantize_tokens,
                             quantize_weight,
                             require_scaled_mm,
)

__all__ = ["FP8_BACKENDS", "FP8_DTYPE", "FP8_LINEARS", "FP8_MAX", "FP8ShapeError", "FP8Unsupported",
           "check_adapter_dtype", "check_fp8_arg", "dequantize_rows", "fp8_linear", "fp8_shape_problems",
           "quantize_tokens", "quantize_weight", "require_scaled_mm"]
