"""Optimizer state in a layout that does not depend on TP/PP/DP: each rank writes the pieces it
owns, any mesh reads back the regions it needs.

A trainable parameter of one rank holds *pieces* of canonical tensors, the unsharded PEFT-layout
tensors an exported adapter has (``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``)
or a head's (``v_head.summary.weight``, TRL's name for a value head; ``score.weight``):

- the stacked A of a fused column-parallel layer: rows ``k·r:(k+1)·r`` are projection k's A, whole
  (replicated over TP);
- a B of a column-parallel layer: a TP chunk of the rows of the PEFT B;
- the A of a row-parallel layer: a TP chunk of the columns of the PEFT A; its B is replicated;
- a head: replicated over TP, on the last pipeline stage;
- an expert's A or B (MoE layers): whole, on the ranks holding that expert (one per expert-data-parallel
  group: its first rank writes it).

AdamW's moments have their parameter's shape and layout, so they split into the same pieces.
Writers: DP rank 0 only (DP replicas are identical), TP rank 0 only for replicated pieces, every
pipeline stage for its own layers. Each writer's file ``optim/pp<p>-tp<t>.safetensors`` records, per
tensor, its canonical name, global shape and where its slice starts; a reader on any mesh
assembles the slice it needs from whichever files hold it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from mlora.export.peft_files import peft_tensor_name
from mlora.formats.checkpoint_reader import CheckpointError, CheckpointReader, read_safetensors_header
from mlora.formats.safetensors_writer import SafetensorsWriter
from mlora.formats.weight_map import COLUMNS, REPLICATED, ROWS
from mlora.lora.sites import factor_kinds

MOMENTS = ("exp_avg", "exp_avg_sq")  # torch AdamW's per-parameter tensors (plus the scalar "step")
_DIM = {ROWS: 0, COLUMNS: 1}


@dataclass(frozen=True)
class Piece:
    """Part of a local parameter that is (a TP slice of) one canonical tensor."""

    name: str  # canonical tensor name
    kind: str  # REPLICATED, ROWS or COLUMNS: how TP splits the canonical tensor
    rows: tuple[int, int] | None = None  # rows of the local parameter that hold it (stacked A); None: all
    expert: bool = False  # an expert's factor: whole on its EP rank, written by its expert-DP group's first rank


def adapter_pieces(model, adapter: str) -> list[tuple[torch.nn.Parameter, list[Piece]]]:
    """This rank's parameters of ``adapter`` with the canonical pieces each holds."""
    out = []
    for linear in model._lora_linears():
        if adapter not in linear.lora:
            continue
        site, branch = linear.lora_site, linear.lora[adapter]
        a_kind, b_kind = factor_kinds(site)
        r, expert = branch.rank, site.expert is not None
        out.append((branch.lora_A, [Piece(peft_tensor_name(site.layer, sub, "A"), a_kind, (k * r, (k + 1) * r), expert)
                                    for k, sub in enumerate(branch.subs)]))
        for k, sub in enumerate(branch.subs):
            out.append((branch.lora_B[k], [Piece(peft_tensor_name(site.layer, sub, "B"), b_kind, expert=expert)]))
    return out


def _region(t: torch.Tensor, piece: Piece) -> torch.Tensor:
    return t if piece.rows is None else t[piece.rows[0]:piece.rows[1]]


def _owns(piece: Piece, mesh) -> bool:
    if piece.expert:
        return mesh.expert_dp_rank == 0
    return mesh.dp_rank == 0 and (piece.kind != REPLICATED or mesh.tp_rank == 0)


def write_optimizer_state(path: Path, groups: dict[str, tuple[torch.optim.Optimizer, list]], mesh) -> Path | None:
    """Write the AdamW state pieces this rank owns to ``path`` (None when it owns none).

    ``groups``: role ("actor", "critic") -> (optimizer, [(param, pieces)]). Nothing is exchanged
    with other ranks. The header is built from shapes first, then the pieces are copied to the CPU
    and written one at a time, so a GPU rank's host memory holds one piece, not its whole state.
    """
    sources: dict[str, object] = {}  # file key -> a function giving the tensor to write
    layout_of: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}  # file key -> what that tensor will be
    where: dict[str, dict] = {}
    for role, (opt, params) in groups.items():
        for param, pieces in params:
            state = opt.state.get(param)
            if not state:
                continue  # never stepped: nothing to carry
            for piece in [p for p in pieces if _owns(p, mesh)]:
                sharded = piece.kind != REPLICATED and mesh.tp > 1
                for field in MOMENTS:
                    name = f"{role}/{piece.name}/{field}"
                    local = _region(state[field], piece)  # a view: nothing copied yet
                    key, shape, dim, start = name, list(local.shape), None, 0
                    if sharded:  # this TP rank's slice of the canonical tensor
                        dim = _DIM[piece.kind]
                        start = mesh.tp_rank * shape[dim]
                        shape[dim] *= mesh.tp
                        key = f"{name}@{start}"
                    sources[key] = lambda t=local: t.detach().cpu().contiguous()
                    layout_of[key] = (local.dtype, tuple(local.shape))
                    where[key] = {"tensor": name, "shape": shape, "dim": dim, "start": start}
                # AdamW's step count (shape [1]: a count, the same on every TP rank; any copy serves)
                name = f"{role}/{piece.name}/step"
                key = f"{name}@tp{mesh.tp_rank}" if sharded else name
                sources[key] = lambda t=state["step"]: t.detach().cpu().reshape(1).to(torch.float32)
                layout_of[key] = (torch.float32, (1,))
                where[key] = {"tensor": name, "shape": [1], "dim": None, "start": 0}
    if not sources:
        return None
    names = sorted(sources)
    layout = {n: layout_of[n] for n in names}
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = SafetensorsWriter(path, layout, metadata={"format": "pt", "mlora_pieces": json.dumps(where, sort_keys=True)})
    try:
        for n in names:
            writer.write(n, sources[n]())
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return path


class OptimizerStateReader:
    """Reads canonical optimizer tensors, or their TP slices, from the files of an ``optim/`` directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.index: dict[str, list[dict]] = {}
        if not directory.is_dir():
            self.reader = None
            return
        for file in sorted(directory.glob("*.safetensors")):
            _, meta = read_safetensors_header(file)
            for key, info in json.loads(meta.get("mlora_pieces", "{}")).items():
                self.index.setdefault(info["tensor"], []).append({**info, "key": key})
        self.reader = CheckpointReader(directory) if self.index else None

    def has(self, name: str) -> bool:
        return name in self.index

    def read(self, name: str, kind: str, tp: int, tp_rank: int) -> torch.Tensor:
        """Tensor ``name`` (``role/canonical/field``), the slice of TP rank ``tp_rank`` of ``tp`` for a split
        ``kind``, assembled from the saved pieces that overlap it."""
        stored = self.index.get(name)
        if not stored:
            raise CheckpointError(f"{self.directory}: no optimizer state for {name!r}")
        shape = stored[0]["shape"]
        dim = _DIM.get(kind) if kind != REPLICATED else None
        lo, hi = 0, shape[dim if dim is not None else 0]
        if dim is not None:
            if shape[dim] % tp:
                raise CheckpointError(f"{name}: {shape[dim]} rows cannot be split over TP={tp}")
            per = shape[dim] // tp
            lo, hi = tp_rank * per, (tp_rank + 1) * per
        split = dim if dim is not None else 0
        parts = []
        for s in sorted(stored, key=lambda s: s["start"]):
            if s["dim"] is None:  # stored whole
                parts.append(self.reader.read(s["key"], dim=split, start=lo, stop=hi))
                return parts[0]
            if s["dim"] != split:
                raise CheckpointError(f"{name}: saved split on dim {s['dim']}, needed on dim {split}")
            length = self.reader.entry(s["key"]).shape[split]
            a, b = max(lo, s["start"]), min(hi, s["start"] + length)
            if a < b:
                parts.append(self.reader.read(s["key"], dim=split, start=a - s["start"], stop=b - s["start"]))
        got = sum(p.shape[split] for p in parts)
        if got != hi - lo:
            raise CheckpointError(f"{self.directory}: the saved pieces of {name!r} cover {got} of rows [{lo}, {hi}): "
                                  "files are missing")
        return torch.cat(parts, dim=split) if len(parts) > 1 else parts[0]

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


def load_optimizer_state(reader: OptimizerStateReader, role: str, opt: torch.optim.Optimizer, params: list,
                         mesh) -> int:
    """Fill ``opt.state`` for this rank's ``params`` from the checkpoint; returns how many parameters got state."""
    loaded = 0
    for param, pieces in params:
        keys = [f"{role}/{p.name}/exp_avg" for p in pieces]
        present = [reader.has(k) for k in keys]
        if not any(present):
            continue  # the saved run never stepped this parameter
        if not all(present):
            raise CheckpointError(f"{reader.directory}: optimizer state of {role} is incomplete "
                                  f"(no {keys[present.index(False)]!r})")
        state = {}
        for field in MOMENTS:
            parts = [reader.read(f"{role}/{p.name}/{field}", p.kind, mesh.tp, mesh.tp_rank) for p in pieces]
            value = torch.cat(parts) if len(parts) > 1 else parts[0]
            if tuple(value.shape) != tuple(param.shape):
                raise CheckpointError(f"{reader.directory}: {role} optimizer state {pieces[0].name} has shape "
                                      f"{tuple(value.shape)} on this mesh, the parameter {tuple(param.shape)} (another "
                                      "LoRA rank or target set?)")
            state[field] = value.to(device=param.device, dtype=param.dtype)
        step = reader.read(f"{role}/{pieces[0].name}/step", REPLICATED, 1, 0)
        state["step"] = step.reshape(()).to(torch.float32)  # torch keeps it as a 0-d float32 CPU tensor
        opt.state[param] = state
        loaded += 1
    return loaded
