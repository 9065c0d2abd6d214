"""Helpers shared by the torchrun workers."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist


def parse_layouts(spec: str) -> list[tuple[int, int, bool]]:
    """``"tp,pp[,sp];..."`` -> ``[(tp, pp, sp), ...]``; a third field ``sp`` turns on sequence parallel."""
    out = []
    for layout in spec.split(";"):
        fields = layout.split(",")
        out.append((int(fields[0]), int(fields[1]), fields[2:] == ["sp"]))
    return out


def masked_sum_loss(model, mask, scale: float = 1.0):
    """``loss_fn`` for ``forward_backward``: scale · Σ of this TP rank's real-vocabulary logits at
    unmasked positions (summed over TP ranks, that is the summed-logits loss of the whole model)."""
    lo, hi = model.vocab_shard_range()

    def loss_fn(logits, mb):
        return (logits[..., : hi - lo] * mask.to(logits.device, logits.dtype)[..., None]).sum() * scale, {}

    return loss_fn


def merged_from_all_ranks(mine: dict) -> dict:
    """The union of every rank's dict (e.g. each pipeline stage's adapter tensors)."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out: dict = {}
    for part in parts:
        out.update(part)
    return out


def adapter_grads(model, adapter: str, head: str | None = None, head_key: str = "head.weight") -> dict:
    """Every rank's reduced gradients of ``adapter`` (PEFT names, DP rank 0's) and of value/score head ``head``
    (as ``head_key``), merged over the ranks (collective)."""
    mesh = model.mesh
    tensors = model.adapter_tensors(adapter, grads=True)  # collective over TP (and EP, for experts' factors)
    mine = {k: v.clone() for k, v in tensors.items()} if mesh.dp_rank == 0 else {}
    if head is not None and head in model.heads and mesh.tp_rank == 0 and mesh.dp_rank == 0:
        mine[head_key] = model.heads[head].weight.grad.detach().cpu().clone()
    return merged_from_all_ranks(mine)


def clear_adapters(model) -> None:
    """Remove every adapter and head: the next case starts from the bare base."""
    for name in list(model.adapters):
        model.delete_adapter(name)
    for name in list(model.heads):
        del model.heads[name]


def write_records_and_exit(records: list[dict], out: Path) -> None:
    """Gather every rank's records to rank 0, write them as JSON, shut the process group down."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if dist.get_rank() == 0:
        out.write_text(json.dumps([r for rs in gathered for r in rs], indent=1))
    dist.barrier()
    dist.destroy_process_group()


def convert_tool():
    """``tools/convert_checkpoint.py`` loaded as a module (its ``main`` runs a conversion in this process)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "tools" / "convert_checkpoint.py"
    spec = importlib.util.spec_from_file_location("convert_checkpoint_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool
