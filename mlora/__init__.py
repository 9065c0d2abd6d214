"""mlora: LoRA-based RLHF on Megatron-style TP x PP x DP meshes."""

import warnings

# megatron-core warns at import and build time about Apex / Transformer Engine being absent and
# about its own deprecated defaults; on the CPU path these are expected and drown real messages.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
warnings.filterwarnings("ignore", message=r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)"
                                          r"` is deprecated")

from mlora.facade import MLoraModel, from_pretrained  # noqa: E402
from mlora.lora import LoraConfig  # noqa: E402
from mlora.parallel import Mesh, init_parallel  # noqa: E402

__all__ = ["LoraConfig", "Mesh", "MLoraModel", "from_pretrained", "init_parallel"]
__version__ = "0.1.0"
