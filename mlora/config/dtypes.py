"""The run's dtypes per device: the trainer's compute dtype and the vLLM engines' (16-bit on CUDA)."""

from __future__ import annotations

from mlora.config.errors import ConfigError
from mlora.config.schema import TrainConfig


def trainer_dtype(dtype: str | None, cuda: bool) -> str:
    """``trainer.dtype`` as the run computes in: the key when set, else bfloat16 on CUDA (vLLM's CUDA LoRA kernels
    take 16-bit only, and a 70B base is half the bytes) and float32 on CPU (the exact checks against HF/PEFT)."""
    return dtype or ("bfloat16" if cuda else "float32")


FLOAT32_NAMES = ("float32", "float")  # vLLM's names of float32 (vllm.config.model: _STR_DTYPE_TO_TORCH_DTYPE)


def engine_dtype(cfg: TrainConfig, cuda: bool) -> str:
    """The vLLM engines' dtype: ``generator.engine_init_kwargs.dtype`` when given, else the trainer's dtype.
    A float32 engine on CUDA is refused, naming the key that chose it: vLLM's CUDA LoRA kernels accept only
    float16/bfloat16 (``vllm/lora/ops/triton_ops/lora_shrink_op.py``), so such an engine would die at its
    first LoRA forward. (vLLM's ``auto`` downcasts a float32 checkpoint to a 16-bit dtype on CUDA.)"""
    explicit = cfg.generator.engine_init_kwargs.get("dtype")
    dtype = str(explicit) if explicit is not None else trainer_dtype(cfg.trainer.dtype, cuda)
    if cuda and dtype in FLOAT32_NAMES:
        key = ("generator.engine_init_kwargs.dtype" if explicit is not None else "trainer.dtype")
        raise ConfigError(f"{key}={dtype} would start the vLLM engines in float32 on CUDA, and vLLM's CUDA LoRA "
                          "kernels take float16/bfloat16 only (the engine would die at its first LoRA forward): "
                          + ("set generator.engine_init_kwargs.dtype=bfloat16" if explicit is not None else
                             "leave trainer.dtype unset (bfloat16 on CUDA; adapters keep float32 masters) or keep "
                             "the float32 trainer and set generator.engine_init_kwargs.dtype=bfloat16"))
    return dtype
