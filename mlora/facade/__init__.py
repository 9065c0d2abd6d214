"""The user-facing model: :class:`MLoraModel` (this rank's frozen base shard with its adapters, heads,
forward/backward and exports) and :func:`from_pretrained`, which builds it."""

from mlora.facade.adapters import AdapterHost
from mlora.facade.model import MLoraModel, from_pretrained

__all__ = ["AdapterHost", "MLoraModel", "from_pretrained"]
