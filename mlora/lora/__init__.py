"""LoRA on column- and row-parallel linears: config, layers, sites, target resolution, TP-partial gradients."""

from mlora.lora.config import LoraConfig
from mlora.lora.layers import LoraColumnParallelLinear, LoraRowParallelLinear

__all__ = ["LoraColumnParallelLinear", "LoraConfig", "LoraRowParallelLinear"]
