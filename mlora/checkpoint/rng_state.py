"""Every random generator of a trainer rank, captured and restored: torch (CPU, and CUDA on the rank's
own device), megatron's model-parallel tracker, Python's ``random`` and NumPy.

mlora's own draws do not depend on these streams (LoRA init, dropout masks and the value head are
keyed by seed, adapter, layer and call; the data order by seed and epoch; the engines' sampling
by seed and step), but megatron layers and user code (reward functions) may use them, so a resumed
run puts them back exactly when it runs on the same mesh. The states are per rank: on another mesh
there is no rank to take them from, and the run says so.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from mlora.formats.checkpoint_reader import read_safetensors_header
from mlora.formats.safetensors_writer import SafetensorsWriter


def _megatron_tracker():
    try:
        from megatron.core import tensor_parallel

        return tensor_parallel.get_cuda_rng_tracker()
    except Exception:  # megatron not initialised (unit tests): nothing to carry
        return None


def capture() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(byte tensors, JSON metadata) of this process's generators."""
    import numpy as np

    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # the rank's own device only: a node may show another number of GPUs on resume
        tensors["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    tracker = _megatron_tracker()
    if tracker is not None:
        for name, state in tracker.get_states().items():
            if state.numel():
                tensors[f"megatron/{name}"] = state.cpu()
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    meta = {"python": json.dumps([version, list(internal), gauss]),
            "numpy": json.dumps([kind, keys.tolist(), int(pos), int(has_gauss), float(cached)])}
    return {k: v.to(torch.uint8).contiguous() for k, v in tensors.items()}, meta


def save(path: Path, mesh_coords: dict) -> Path:
    """Write this rank's generator states to ``path`` (safetensors; scalars in its metadata)."""
    tensors, meta = capture()
    meta = {"format": "pt", **meta, "mesh": json.dumps(mesh_coords, sort_keys=True)}
    path.parent.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    writer = SafetensorsWriter(path, {n: (torch.uint8, tuple(tensors[n].shape)) for n in names}, metadata=meta)
    for n in names:
        writer.write(n, tensors[n])
    writer.close()
    return path


def restore(path: Path) -> None:
    """Put back the generator states saved in ``path`` (this rank's, same mesh)."""
    import numpy as np

    entries, meta = read_safetensors_header(path)
    with open(path, "rb") as f:
        raw = f.read()
    tensors = {name: torch.frombuffer(bytearray(raw[e.offset:e.offset + e.nbytes]), dtype=torch.uint8)
               for name, e in entries.items()}
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available() and "cuda" in tensors:
        torch.cuda.set_rng_state(tensors["cuda"], torch.cuda.current_device())
    tracker = _megatron_tracker()
    megatron = {k[len("megatron/"):]: v for k, v in tensors.items() if k.startswith("megatron/")}
    if tracker is not None and megatron:
        tracker.set_states({**tracker.get_states(), **megatron})
    version, internal, gauss = json.loads(meta["python"])
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = json.loads(meta["numpy"])
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
