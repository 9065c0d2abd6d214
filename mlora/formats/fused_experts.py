"""transformers 5's fused expert tensors, read as the per-expert tensors of the original HF layout.

``save_pretrained(..., save_original_format=False)`` writes a MoE layer's experts as two stacked tensors,
``model.layers.{i}.mlp.experts.gate_up_proj`` ``[E, 2·ffn, hidden]`` (each expert's gate rows, then its up rows)
and ``model.layers.{i}.mlp.experts.down_proj`` ``[E, hidden, ffn]``, and Mixtral's ``block_sparse_moe`` as ``mlp``.
Every expert's gate, up and down weight is one contiguous byte range of those tensors, so
:func:`expose_unfused_experts` adds them to a :class:`CheckpointReader` as entries of their own under their
original names (``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.{e}.w1``):
the loader then reads each rank's experts exactly as from an original-format checkpoint, byte for byte.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mlora.formats.checkpoint_reader import CheckpointError, CheckpointReader, TensorEntry
from mlora.formats.hf_config import ModelSpec

FUSED_BLOCK = "mlp"  # transformers 5's module name of every MoE block (Mixtral's block_sparse_moe included)
GATE_UP, DOWN = "gate_up_proj", "down_proj"  # transformers 5's stacked expert parameters


def fused_expert_name(layer: int, param: str) -> str:
    """transformers 5's name of a stacked expert parameter (``param``: gate_up_proj or down_proj)."""
    return f"model.layers.{layer}.{FUSED_BLOCK}.experts.{param}"


def _part(entry: TensorEntry, index: int, shape: tuple[int, ...]) -> TensorEntry:
    """Entry of the ``index``-th contiguous block of ``shape`` inside ``entry`` (same file, same dtype)."""
    item = torch.empty((), dtype=entry.dtype).element_size()
    nbytes = item
    for s in shape:
        nbytes *= s
    return replace(entry, shape=shape, offset=entry.offset + index * nbytes, nbytes=nbytes)


def _check_shape(reader: CheckpointReader, name: str, expected: tuple[int, ...], what: str) -> TensorEntry:
    entry = reader.entry(name)
    if tuple(entry.shape) != expected:
        raise CheckpointError(f"{reader.directory}: {name} has shape {tuple(entry.shape)}, config.json implies "
                              f"{expected} ({what}): a checkpoint of another model?")
    return entry


def expose_unfused_experts(reader: CheckpointReader, spec: ModelSpec) -> int:
    """Add the original per-expert entries of every fused expert tensor in ``reader`` (in place); returns how many
    fused tensors were found. A checkpoint in the original layout is left as it is.

    Also names Mixtral's router ``block_sparse_moe.gate.weight`` where the file holds transformers 5's
    ``mlp.gate.weight``. Entries the file holds under their original names are never replaced."""
    moe = spec.moe
    if moe is None:
        return 0
    gate, up, down = moe.projections
    e_count, ffn, hidden = moe.num_experts, moe.ffn_size, spec.hidden_size
    found = 0
    for i in moe.sparse_layers:
        block = f"model.layers.{i}.{moe.block}."
        router = f"model.layers.{i}.{FUSED_BLOCK}.gate.weight"
        if moe.block != FUSED_BLOCK and block + "gate.weight" not in reader and router in reader:
            reader.entries[block + "gate.weight"] = reader.entries[router]
        name = fused_expert_name(i, GATE_UP)
        if name in reader:
            found += 1
            entry = _check_shape(reader, name, (e_count, 2 * ffn, hidden), "experts x [gate; up] x hidden")
            for e in range(e_count):  # expert e's rows: its gate's ffn rows, then its up's
                for k, proj in enumerate((gate, up)):
                    reader.entries.setdefault(f"{block}experts.{e}.{proj}.weight", _part(entry, 2 * e + k,
                                                                                          (ffn, hidden)))
        name = fused_expert_name(i, DOWN)
        if name in reader:
            found += 1
            entry = _check_shape(reader, name, (e_count, hidden, ffn), "experts x hidden x ffn")
            for e in range(e_count):
                reader.entries.setdefault(f"{block}experts.{e}.{down}.weight", _part(entry, e, (hidden, ffn)))
    return found
