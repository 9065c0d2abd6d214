"""megatron-core's CPU gaps, closed in one place.

megatron-core 0.16.1 assumes CUDA in a handful of modules: it allocates buffers on
``torch.cuda.current_device()``, builds token counters with ``device="cuda"``,
synchronises CUDA after p2p calls and keeps its RNG tracker in CUDA generator states (and
activation recompute saves and restores the CUDA generator). Without CUDA we give exactly those
modules a view of ``torch`` whose ``cuda`` namespace answers with the CPU, install a CPU RNG
tracker, and make the CUDA generator's state empty. Nothing outside these megatron
modules sees a change, and nothing is patched when CUDA is present.

``PATCHED_SITES`` lists every module we touch together with the CUDA call it is known to
make; ``tests/test_cpu_shims.py`` fails loudly if megatron moves or drops one of them.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from typing import Any

import torch

MEGATRON_CORE_VERSION = "0.16.1"

# module -> source fragments it must still contain for the shim to be meaningful.
PATCHED_SITES: dict[str, tuple[str, ...]] = {
    "megatron.core.tensor_parallel.mappings": ("torch.cuda.current_device()",),
    "megatron.core.tensor_parallel.layers": ("torch.cuda.current_device()",),
    "megatron.core.tensor_parallel.utils": ("torch.cuda.current_device()",),
    "megatron.core.utils": ("torch.cuda.current_device()",),
    "megatron.core.models.common.embeddings.rotary_pos_embedding": ("torch.cuda.current_device()",),
    "megatron.core.pipeline_parallel.schedules": ('device="cuda"',),
    "megatron.core.pipeline_parallel.p2p_communication": (
        "torch.cuda.current_device()",
        "torch.cuda.synchronize()",
    ),
    # dist_checkpointing.save (torch_dist): the D2H preload syncs CUDA, the failure flag is a CUDA tensor.
    "megatron.core.dist_checkpointing.strategies.filesystem_async": ("torch.cuda.synchronize()",),
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": ("torch.cuda.current_device()",),
    # MoE: the router allocates on the current device; the all-to-all dispatcher copies
    # its split sizes to the host on a side stream (a no-op stream here: they already are on the host)
    "megatron.core.transformer.moe.router": ("torch.cuda.current_device()",),
    "megatron.core.transformer.moe.token_dispatcher": ("torch.cuda.Stream()", "torch.cuda.current_stream()",
                                                       "torch.cuda.stream(", ".record_event()"),
}
# module -> (function name it imported, source fragment): the function wrapped for CPU tensors. The
# all-to-all dispatcher turns its split sizes into host lists through ``maybe_move_tensor_to_cpu``,
# which converts only CUDA tensors: on the CPU they would stay tensors, which ``all_to_all_single`` refuses.
FUNCTION_SITES: dict[str, tuple[str, str]] = {
    "megatron.core.transformer.moe.token_dispatcher": ("maybe_move_tensor_to_cpu",
                                                       "self.input_splits, as_numpy=True"),
}
# Names a module uses but only defines when Transformer Engine imports: set to None (what the module's own
# code tests for) so that its pure-torch path runs. moe_utils' router GEMM reads ``te_general_gemm``.
TE_ONLY_NAMES: dict[str, tuple[str, ...]] = {"megatron.core.transformer.moe.moe_utils": ("te_general_gemm",)}
# Methods that move a tensor with ``Tensor.cuda()``: run with that call as the identity.
TENSOR_CUDA_SITES: dict[str, tuple[str, str, str]] = {
    "megatron.core.models.common.language_module.language_module": (
        "LanguageModule", "setup_embeddings_and_output_layer", "weight.data = weight.data.cuda()"),
}
RNG_MODULE = "megatron.core.tensor_parallel.random"
# The last two: activation recompute (``CheckpointFunction``, ``CheckpointWithoutOutput``) saves and
# restores the CUDA generator's state through them; without CUDA there is no such generator.
RNG_SYMBOLS = ("CudaRNGStatesTracker", "_CUDA_RNG_STATE_TRACKER", "_CUDA_RNG_STATE_TRACKER_INITIALIZED",
               "_get_cuda_rng_state", "_set_cuda_rng_state")

_applied = False


def _cpu_device(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as megatron sees it on a CPU-only machine."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    class Event:
        """An event that is always complete: CPU work is already in program order."""

        def record(self, stream: Any = None) -> None:
            return None

        def synchronize(self) -> None:
            return None

        def wait(self, stream: Any = None) -> None:
            return None

        def query(self) -> bool:
            return True

    class Stream:
        """A stream that orders nothing; there is one (never a side stream)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def wait_stream(self, stream: Any) -> None:
            return None

        def wait_event(self, event: Any) -> None:
            return None

        def record_event(self, event: Any = None) -> Any:
            return _CpuCuda.Event()

        def synchronize(self) -> None:
            return None

        def __eq__(self, other: Any) -> bool:
            return isinstance(other, _CpuCuda.Stream)

        __hash__ = object.__hash__

    _default_stream = Stream()

    @classmethod
    def current_stream(cls, device: Any = None) -> Any:
        return cls._default_stream

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def is_available() -> bool:
        return False


def _with_cpu_device(fn):
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    wrapped.__name__ = fn.__name__
    return wrapped


class _CpuTorch(types.ModuleType):
    """``torch`` with a CPU ``cuda`` namespace and factories that map ``device="cuda"`` to CPU."""

    _factories = ("zeros", "ones", "empty", "full", "tensor", "arange")

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in self._factories:
            setattr(self, name, _with_cpu_device(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class CpuRNGStatesTracker:
    """megatron's RNG-states tracker, kept in CPU generator states.

    Same contract as ``CudaRNGStatesTracker``: named states seeded once, ``fork(name)``
    runs a block under that state and restores the default one afterwards.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self.seeds_.add(seed)
        gen = torch.Generator()
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was never added; known: {sorted(self.states_)}")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _cpu_get_cuda_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    """No CUDA generator: an empty state (the CPU generator is saved separately by megatron)."""
    return torch.empty(0, dtype=torch.uint8)


def _cpu_set_cuda_rng_state(*args: Any, **kwargs: Any) -> None:
    """No CUDA generator to restore."""
    return None


def _without_tensor_cuda(fn):
    """``fn`` run with ``Tensor.cuda`` as the identity (restored on exit)."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = original

    wrapped.__name__ = fn.__name__
    wrapped.__wrapped__ = fn
    return wrapped


def _host_split_sizes(fn):
    """``maybe_move_tensor_to_cpu`` that also gives host tensors as numpy when asked (split sizes)."""

    def wrapped(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy().copy()
        return fn(tensor, as_numpy=as_numpy, record_stream=record_stream)

    wrapped.__name__ = fn.__name__
    wrapped.__wrapped__ = fn
    return wrapped


def apply_cpu_shims() -> None:
    """Make megatron-core usable without CUDA. A no-op when CUDA is available."""
    global _applied
    if torch.cuda.is_available():
        return
    if not _applied:
        cpu_torch = _CpuTorch()
        for module_name in PATCHED_SITES:
            importlib.import_module(module_name).torch = cpu_torch
        for module_name, (fn_name, _) in FUNCTION_SITES.items():
            module = importlib.import_module(module_name)
            setattr(module, fn_name, _host_split_sizes(getattr(module, fn_name)))
        for module_name, names in TE_ONLY_NAMES.items():
            module = importlib.import_module(module_name)
            for name in names:
                if not hasattr(module, name):
                    setattr(module, name, None)
        for module_name, (cls_name, method, _) in TENSOR_CUDA_SITES.items():
            cls = getattr(importlib.import_module(module_name), cls_name)
            setattr(cls, method, _without_tensor_cuda(getattr(cls, method)))
        _applied = True
    rng = importlib.import_module(RNG_MODULE)
    rng._get_cuda_rng_state = _cpu_get_cuda_rng_state
    rng._set_cuda_rng_state = _cpu_set_cuda_rng_state
    if not isinstance(rng._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        rng._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        rng._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def check_patched_sites() -> list[str]:
    """Problems that would make the shims silently stale (empty when all is well)."""
    import inspect

    import megatron.core

    problems = []
    version = megatron.core.__version__
    if version != MEGATRON_CORE_VERSION:
        problems.append(f"megatron-core is {version}, the shims were written for {MEGATRON_CORE_VERSION}")
    for module_name, fragments in PATCHED_SITES.items():
        try:
            source = inspect.getsource(importlib.import_module(module_name))
        except (ImportError, OSError) as exc:
            problems.append(f"{module_name}: cannot be read ({exc})")
            continue
        for fragment in fragments:
            if fragment not in source:
                problems.append(f"{module_name}: no longer contains {fragment!r}")
    for module_name, (fn_name, fragment) in FUNCTION_SITES.items():
        module = importlib.import_module(module_name)
        if not hasattr(module, fn_name):
            problems.append(f"{module_name}: no longer imports {fn_name}")
        elif fragment not in inspect.getsource(module):
            problems.append(f"{module_name}: no longer contains {fragment!r}")
    for module_name, names in TE_ONLY_NAMES.items():
        source = inspect.getsource(importlib.import_module(module_name))
        problems += [f"{module_name}: no longer uses {name}" for name in names if f"{name} is not None" not in source]
    for module_name, (cls_name, method, fragment) in TENSOR_CUDA_SITES.items():
        cls = getattr(importlib.import_module(module_name), cls_name, None)
        fn = getattr(cls, method, None)
        if fn is None:
            problems.append(f"{module_name}: {cls_name}.{method} is gone")
        elif fragment not in inspect.getsource(getattr(fn, "__wrapped__", fn)):
            problems.append(f"{module_name}: {cls_name}.{method} no longer contains {fragment!r}")
    rng = importlib.import_module(RNG_MODULE)
    for symbol in RNG_SYMBOLS:
        if not hasattr(rng, symbol):
            problems.append(f"{RNG_MODULE}: symbol {symbol} is gone")
    return problems
