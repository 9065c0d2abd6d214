"""Sequence packing: the rows of a right-padded batch concatenated into one row with no padding.

A packed micro-batch is one row of ``width`` tokens holding rows ``0..n-1`` back to back (row ``i``
at ``[start_i, start_i + length_i)``), then one padding segment up to ``width`` if the row must be
longer (a multiple of TP under sequence parallelism, one width for every micro-batch of a pipeline
schedule). Attention never crosses a segment: megatron's ``thd`` format carries the boundaries
(``PackedSeqParams.cu_seqlens``), RoPE restarts at every segment (megatron's
``_apply_rotary_pos_emb_thd``) and the core attention runs each segment alone
(:class:`mlora.models.attention.SDPAttention`; TE and flash-attention take the same
``cu_seqlens`` as varlen kernels). Per-token results come back to the padded ``[n, S]`` layout
with :meth:`PackedRows.unpack`, so every loss is computed per original sequence as before.

Rows are put into micro-batches by :func:`pack_bins` (first-fit decreasing under a token budget).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class PackedRows:
    """Where each row of a right-padded ``[n, row_width]`` batch sits in one packed row of ``width`` tokens."""

    lengths: tuple[int, ...]  # tokens of each row (its attention mask's sum), in row order
    row_width: int  # S, the padded layout's width
    width: int  # the packed row's length, >= sum(lengths)

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"packing needs rows of at least one token, got lengths {list(self.lengths)[:8]}")
        if max(self.lengths) > self.row_width:
            raise ValueError(f"a row of {max(self.lengths)} tokens is longer than the padded width {self.row_width}")
        if self.width < self.tokens:
            raise ValueError(f"packed width {self.width} < the rows' {self.tokens} tokens")

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> "PackedRows":
        """The packing of right-padded rows with HF's ``attention_mask`` ``[n, S]`` (1 = token)."""
        from mlora.models.attention import is_right_padded

        if not is_right_padded(attention_mask):
            raise ValueError("sequence packing needs right-padded rows (attention_mask 1…1 0…0)")
        lengths = tuple(int(x) for x in attention_mask.sum(-1).tolist())
        return cls(lengths, attention_mask.shape[1], sum(lengths))

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def starts(self) -> list[int]:
        out, at = [], 0
        for n in self.lengths:
            out.append(at)
            at += n
        return out

    def widened(self, width: int) -> "PackedRows":
        """The same rows in a packed row of ``width`` tokens (the rest one padding segment)."""
        return PackedRows(self.lengths, self.row_width, width)

    def segments(self) -> list[int]:
        """Segment lengths: the rows, then the padding segment if any."""
        pad = self.width - self.tokens
        return list(self.lengths) + ([pad] if pad else [])

    def pack(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[n, S]`` right-padded ids -> ``[1, width]`` (padding id 0)."""
        out = input_ids.new_zeros((1, self.width))
        for i, (start, n) in enumerate(zip(self.starts, self.lengths)):
            out[0, start:start + n] = input_ids[i, :n]
        return out

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[1, width]`` position ids restarting at 0 in every segment."""
        return torch.cat([torch.arange(n, device=device) for n in self.segments()])[None]

    def cu_seqlens(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[segments + 1]`` int32 cumulative segment lengths (megatron's and flash-attention's ``cu_seqlens``)."""
        return torch.tensor([0] + self.segments(), dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)

    def packed_seq_params(self, device: torch.device | str = "cpu"):
        """megatron's ``PackedSeqParams`` in the ``thd`` format for this packed row."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens(device)
        longest = max(self.segments())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                               max_seqlen_kv=longest)

    def _index(self, shift: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed positions ``[n, S - shift]`` of each row's positions, and which of them are valid."""
        width = self.row_width - shift
        t = torch.arange(width, device=device)[None]
        starts = torch.tensor(self.starts, device=device)[:, None]
        valid = t < (torch.tensor(self.lengths, device=device)[:, None] - shift)
        return torch.where(valid, starts + t, 0), valid

    def unpack(self, values: torch.Tensor, shift: int = 0) -> torch.Tensor:
        """``[1, w, ...]`` per-position values of the packed row -> ``[n, S - shift, ...]``, the padded layout.

        Row ``i``'s position ``t`` takes packed position ``start_i + t`` for ``t < length_i - shift``
        and 0 elsewhere. ``shift=1`` is for next-token quantities (log-probs, values at action
        positions: ``values`` then has one position less), whose last position in a segment would
        predict the next row's first token and is dropped. Differentiable (a gather)."""
        index, valid = self._index(shift, values.device)
        out = values[0][index]
        mask = valid.reshape(valid.shape + (1,) * (out.dim() - 2))
        return torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))

    def last_positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[n]`` packed position of each row's last token."""
        return torch.tensor([s + n - 1 for s, n in zip(self.starts, self.lengths)], device=device)


def pack_bins(lengths: Sequence[int], budget: int, what: str = "trainer.max_tokens_per_microbatch") -> list[list[int]]:
    """Indices of ``lengths`` grouped so that each group's total is at most ``budget`` tokens.

    First-fit decreasing (NeMo-RL's choice): the longest row first into the first group with room;
    at most 11/9 of the fewest groups plus one. Each group's indices come back sorted, and the groups
    in order of their first index, so the result depends on the lengths alone (every rank of a
    tensor- or pipeline-parallel group computes the same micro-batches)."""
    if budget < 1:
        raise ValueError(f"{what}={budget}: the token budget must be >= 1")
    longest = max(lengths, default=0)
    if longest > budget:
        raise ValueError(f"{what}={budget} is smaller than the longest sequence (or chosen + rejected pair) of "
                         f"{longest} tokens; valid budgets are >= {longest}")
    groups: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        for g, free in enumerate(room):
            if lengths[i] <= free:
                groups[g].append(i)
                room[g] -= lengths[i]
                break
        else:
            groups.append([i])
            room.append(budget - lengths[i])
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def balanced_shares(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``lengths`` split into ``parts`` shares of near-equal token sums (e.g. one per DP rank).

    Longest first to the share with the fewest tokens so far (ties: the lowest share), as
    :func:`pack_bins` does: the result depends on the lengths alone, so every rank computes the same
    shares. Each share's indices come back sorted; a share is empty when there are fewer rows than parts."""
    if parts < 1:
        raise ValueError(f"parts={parts} must be >= 1")
    shares: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        j = min(range(parts), key=lambda p: (load[p], p))
        shares[j].append(i)
        load[j] += lengths[i]
    return [sorted(s) for s in shares]
