"""transformers 5's fused expert tensors, read as the per-expert tensors of the original HF layout.

``save_pretrained(..., save_original_format=False)`` writes a MoE layer's experts as two stacked tensors,
``model.layers.{i}.mlp.experts.gate_up_proj`` ``[E, 2·ffn, hidden]`` (each expert's gate rows, then its up rows)
and ``model.layers.{i}.mlp.experts.down_proj`` ``[E, hidden, ffn]``, and Mixtral's ``block_sparse_moe`` as ``mlp``.
Every expert's gate, up and down weight is one contiguous byte range of those tensors, so
:func:`expose_unfused_experts` adds them to a :class:`CheckpointReader` as entries of their own under their
original names (``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.{e}.w1``):
the loader then reads each rank's experts exactly as from an original-format checkpoint, byte for byte.

gpt-oss has no per-expert layout at all: its checkpoints hold ``mlp.experts.gate_up_proj`` ``[E, hidden, 2·ffn]``
(``x @ W``, expert e's gate and up columns interleaved: column 2j is gate j, 2j+1 up j) with ``gate_up_proj_bias``
``[E, 2·ffn]``, and ``down_proj`` ``[E, ffn, hidden]`` with ``down_proj_bias`` ``[E, hidden]``.
:func:`expose_gpt_oss_experts` names each expert's pieces as the other families' (``experts.{e}.gate_proj.weight``
``[ffn, hidden]``, ``.bias``, ...), computed from expert e's contiguous block when read; :func:`fuse_gpt_oss_experts`
turns such per-expert tensors back into gpt-oss's stacked ones, layer by layer, for what is written out.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Iterable, Iterator

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
    if moe.gpt_oss:
        return expose_gpt_oss_experts(reader, spec)
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


_GPT_OSS_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                             r"(weight|bias)$")


_GPT_OSS_STACKED = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")


def is_gpt_oss_stacked(name: str, spec: ModelSpec) -> bool:
    """Whether ``name`` is one of gpt-oss's stacked expert tensors (``spec`` a gpt-oss's)."""
    return spec.moe is not None and spec.moe.gpt_oss and _GPT_OSS_STACKED.match(name) is not None


def _gpt_oss_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """gpt-oss's stacked expert tensors' shapes."""
    e_count, ffn, hidden = spec.moe.num_experts, spec.moe.ffn_size, spec.hidden_size
    return {GATE_UP: (e_count, hidden, 2 * ffn), GATE_UP + "_bias": (e_count, 2 * ffn),
            DOWN: (e_count, ffn, hidden), DOWN + "_bias": (e_count, hidden)}


def expose_gpt_oss_experts(reader: CheckpointReader, spec: ModelSpec) -> int:
    """Add every gpt-oss expert's gate/up/down weight and bias to ``reader`` under the per-expert names
    (``model.layers.{i}.mlp.experts.{e}.gate_proj.weight`` ``[ffn, hidden]``, ``.bias`` ``[ffn]``, ...), each computed
    from expert e's contiguous rows of the stacked tensor when read; returns how many stacked tensors were found."""
    moe = spec.moe
    if moe is None or not moe.gpt_oss:
        return 0
    shapes, ffn, hidden = _gpt_oss_shapes(spec), moe.ffn_size, spec.hidden_size
    found = 0
    last: dict = {}  # the latest expert block read: (name, expert) and its tensor
    for i in moe.sparse_layers:
        for param, shape in shapes.items():
            name = fused_expert_name(i, param)
            if name not in reader:
                continue
            found += 1
            entry = _check_shape(reader, name, shape, "gpt-oss's stacked experts")
            for e in range(moe.num_experts):
                def block(name=name, e=e) -> torch.Tensor:  # expert e's [hidden, 2·ffn], [2·ffn], ...: one range,
                    if last.get("key") != (name, e):  # read once for its gate and its up (the loader asks in turn)
                        last.update(key=(name, e), block=reader.read(name, 0, e, e + 1)[0])
                    return last["block"]

                x = f"model.layers.{i}.mlp.experts.{e}."
                if param == GATE_UP:  # x @ W: W's columns are the outputs, gate/up interleaved
                    reader.derive(x + "gate_proj.weight", entry, (ffn, hidden), lambda b=block: b()[:, 0::2].t())
                    reader.derive(x + "up_proj.weight", entry, (ffn, hidden), lambda b=block: b()[:, 1::2].t())
                elif param == GATE_UP + "_bias":
                    reader.derive(x + "gate_proj.bias", entry, (ffn,), lambda b=block: b()[0::2])
                    reader.derive(x + "up_proj.bias", entry, (ffn,), lambda b=block: b()[1::2])
                elif param == DOWN:
                    reader.derive(x + "down_proj.weight", entry, (hidden, ffn), lambda b=block: b().t())
                else:
                    reader.derive(x + "down_proj.bias", entry, (hidden,), block)
    return found


def gpt_oss_layout(names: dict[str, tuple], spec: ModelSpec, per_expert: bool = False) -> dict[str, tuple]:
    """``names`` (HF name -> (dtype, shape)) with gpt-oss's per-expert names replaced by the stacked tensors they
    make up (:func:`fuse_gpt_oss_experts` writes exactly these), in place of the layer's first expert tensor;
    ``per_expert``: by each expert's block of them (``experts.{e}.gate_up_proj``, ...) instead."""
    if spec.moe is None or not spec.moe.gpt_oss:
        return names
    out, shapes = {}, _gpt_oss_shapes(spec)
    for name, (dtype, shape) in names.items():
        m = _GPT_OSS_EXPERT.match(name)
        if m is None:
            out[name] = (dtype, shape)
            continue
        param = _stacked_param(m.group(3), m.group(4))
        expert = f"{m.group(2)}." if per_expert else ""
        out.setdefault(fused_expert_name(int(m.group(1)), f"{expert}{param}"),
                       (dtype, shapes[param][1:] if per_expert else shapes[param]))
    return out


def _stacked_param(proj: str, kind: str) -> str:
    base = DOWN if proj == "down_proj" else GATE_UP
    return base if kind == "weight" else base + "_bias"


def fuse_gpt_oss_experts(tensors: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec, per_expert: bool = False
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` with gpt-oss's per-expert tensors stacked into its checkpoint's (the inverse of
    :func:`expose_gpt_oss_experts`): a stacked tensor is yielded once its every expert's pieces have passed (one
    layer's experts held at a time); other tensors pass through. A stacked tensor left incomplete is an error.

    ``per_expert``: each expert's block of the stacked tensors under its own name (``experts.{e}.gate_up_proj``
    ``[hidden, 2·ffn]``, ...), as soon as its pieces have passed: what vLLM's gpt-oss loads expert by expert through
    its experts' weight loader, the path its in-place reload tracks (the stacked tensors it copies in directly)."""
    if spec.moe is None or not spec.moe.gpt_oss:
        yield from tensors
        return
    e_count = spec.moe.num_experts
    pending: dict[tuple, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in tensors:
        m = _GPT_OSS_EXPERT.match(name)
        if m is None:
            yield name, tensor
            continue
        layer, expert, proj, kind = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        param = _stacked_param(proj, kind)
        key = (layer, param, expert) if per_expert else (layer, param)
        parts = pending.setdefault(key, {})
        parts[(expert, proj)] = tensor
        if len(parts) < (1 if per_expert else e_count) * (1 if proj == "down_proj" else 2):
            continue
        del pending[key]
        stacked = []
        for e in ([expert] if per_expert else range(e_count)):
            if proj == "down_proj":
                stacked.append(parts[(e, proj)].t() if kind == "weight" else parts[(e, proj)])
            else:  # rows gate 0, up 0, gate 1, ...: interleaved; a weight transposed to x @ W
                both = torch.stack([parts[(e, "gate_proj")], parts[(e, "up_proj")]], dim=1).flatten(0, 1)
                stacked.append(both.t() if kind == "weight" else both)
        if per_expert:
            yield fused_expert_name(layer, f"{expert}.{param}"), stacked[0].contiguous()
        else:
            yield fused_expert_name(layer, param), torch.stack(stacked).contiguous()
    if pending:
        key, parts = next(iter(pending.items()))
        raise RuntimeError(f"gpt-oss layer {key[0]}'s {key[1]}: {len(parts)} expert pieces, not all its experts' "
                           "gate, up and down (a partial selection of an expert block)")
