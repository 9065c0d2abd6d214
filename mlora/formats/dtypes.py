"""The safetensors dtype names, declared once: every reader and writer of safetensors bytes uses these."""

from __future__ import annotations

import torch

# safetensors header name -> torch dtype (the names mlora reads and writes)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
# torch dtype -> safetensors header name (the inverse, same order)
SAFETENSORS_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
