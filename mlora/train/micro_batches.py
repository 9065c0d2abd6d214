"""Micro-batches of the trainer's engines: padded by count, or packed by a token budget.

A *unit* is what must travel in one micro-batch: a sequence (PPO, GRPO, SFT) or a chosen/rejected
pair (RM, DPO). Padded, a micro-batch is ``size`` consecutive units, right-padded to the batch's
width ``S``. Packed (``trainer.use_sample_packing``), the units are grouped first-fit decreasing
under a token budget (``trainer.max_tokens_per_microbatch``; -1: ``size`` units × ``S``, the padded
micro-batch's tokens, so a packed micro-batch never holds more tokens than a padded one) and their
rows concatenated into one row with no padding (:mod:`mlora.models.packing`). Every loss is
normalised by counts of the whole mini-batch, so the grouping leaves the gradient unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlora.export.reward_adapter import last_token_scores as padded_last_token_scores
from mlora.models.packing import PackedRows, pack_bins


@dataclass(frozen=True)
class Packing:
    """``trainer.use_sample_packing`` and its token budget."""

    enabled: bool = False
    max_tokens: int = 0  # per micro-batch; 0: the padded micro-batch's tokens (units per micro-batch × S)

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 0 (0: the padded micro-batch's token count)")
        if self.max_tokens and not self.enabled:
            raise ValueError(f"max_tokens={self.max_tokens} sizes packed micro-batches: it needs enabled=True")


def group_units(unit_tokens: list[int], size: int, packing: Packing, unit_width: int) -> list[list[int]]:
    """Unit indices per micro-batch: ``size`` consecutive ones padded; packed, first-fit-decreasing
    groups of at most the budget's tokens (``unit_width``: the padded tokens of one unit)."""
    if not packing.enabled:
        return [list(range(s, min(s + size, len(unit_tokens)))) for s in range(0, len(unit_tokens), size)]
    return pack_bins(unit_tokens, packing.max_tokens or size * unit_width)


def micro_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor, per_row: dict,
                packed: bool, device: torch.device) -> dict:
    """The micro-batch of ``rows``: per-row tensors (``per_row`` and, padded, ids and mask) on ``device``;
    packed, ``input_ids`` is the ``[1, width]`` packed row and ``packed`` its
    :class:`~mlora.models.packing.PackedRows` (per-token results come back with ``packed.unpack``)."""
    mb = {k: v[rows].to(device) for k, v in per_row.items()}
    if packed:
        layout = PackedRows.of(attention_mask[rows])
        mb.update(input_ids=layout.pack(input_ids[rows]).to(device), packed=layout)
    else:
        mb.update(input_ids=input_ids[rows].to(device), attention_mask=attention_mask[rows].to(device))
    return mb


def in_row_order(outs: list[dict] | None, mbs: list[dict]) -> torch.Tensor | None:
    """The micro-batches' ``out`` rows (float32) put back in the order of the slice (packing regroups rows;
    each micro-batch holds ``rows``, its rows' places in the slice); None off the last pipeline stage."""
    if outs is None:
        return None
    local = torch.cat([o["out"].float() for o in outs])
    return local[torch.argsort(torch.cat([mb["rows"] for mb in mbs])).to(local.device)]


def unpack_tokens(values: torch.Tensor, mb: dict, shift: int) -> torch.Tensor:
    """Per-position ``values`` of a micro-batch in the padded ``[rows, S - shift, ...]`` layout (a packed
    micro-batch's come back from its packed row; a padded one's are already there)."""
    packed = mb.get("packed")
    return values if packed is None else packed.unpack(values, shift)


def last_token_scores(head: torch.nn.Module, hidden: torch.Tensor, mb: dict) -> torch.Tensor:
    """``[rows]`` float32: ``head`` on the final hidden state of each row's last token (HF's sequence
    classifier; :func:`mlora.export.reward_adapter.last_token_scores` for padded micro-batches)."""
    packed = mb.get("packed")
    if packed is None:
        return padded_last_token_scores(head, hidden, mb["attention_mask"])
    return head(hidden[0, packed.last_positions(hidden.device)])[:, 0].float()
