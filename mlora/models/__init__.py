"""HF config -> megatron model, per-rank sharded loading, the MLoraModel facade."""

from mlora.models.loader import from_pretrained
from mlora.models.model import MLoraModel

__all__ = ["MLoraModel", "from_pretrained"]
