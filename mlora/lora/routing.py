"""Routing: LoRA adapters restricted to some rows of a micro-batch (mixed-adapter micro-batches).

A micro-batch may hold rows of several experiments, each trained with its own adapter: the frozen base
GEMM runs once over all tokens, each routed adapter's A and B GEMMs only over its rows' tokens (the
training-side counterpart of punica / S-LoRA batching).

The LoRA linears see megatron's sequence-first hidden states ``[s, b, h]`` flattened to ``[s·b, h]``: the
column-parallel input after the sequence-parallel all-gather, the row-parallel input with its features
sharded, both the whole sequence. So row ``i`` of a padded ``[b, s]`` micro-batch is the tokens
``slice(i, None, b)`` of that view (a strided 2-D view whose row stride BLAS takes as it is: no copy), and a
sequence of a packed micro-batch (``[1, width]``) is a contiguous range of it. A *route* is a tuple of such
slices over the flattened tokens; :data:`ROUTES` holds the routes of the micro-batch being computed. An
active adapter absent from it applies to every token, one with an empty route to none. The facade sets it
around each micro-batch's model call (:func:`routed`); activation recompute saves it before a forward and
restores it for the recompute, with the dropout counters (:mod:`mlora.models.recompute`), because under
the 1F1B schedule another micro-batch's routes are set by then.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import Iterator, Mapping, Sequence

import torch

Route = tuple[slice, ...]

# adapter name -> its route in the current forward (see the module docstring); mutated in place, never rebound
ROUTES: dict[str, Route] = {}


def set_routes(routes: Mapping[str, Route]) -> None:
    """Make ``routes`` the current routes (replacing all of them)."""
    ROUTES.clear()
    ROUTES.update(routes)


@contextlib.contextmanager
def routed(routes: Mapping[str, Route] | None) -> Iterator[None]:
    """``routes`` in force inside the block, none after it; None leaves the routes untouched (empty)."""
    if routes is None:
        yield
        return
    set_routes(routes)
    try:
        yield
    finally:
        ROUTES.clear()


def check_rows(rows: Sequence[int], count: int, what: str) -> list[int]:
    """``rows`` sorted, as ints, after checking that they are distinct integers in ``[0, count)``
    (ValueError naming ``what`` otherwise)."""
    try:
        out = sorted(operator.index(r) for r in rows)
    except TypeError:
        raise ValueError(f"{what}: row indices must be integers, got {list(rows)!r}") from None
    bad = [r for r in out if not 0 <= r < count]
    if bad:
        raise ValueError(f"{what}: row indices {bad} are out of range; this micro-batch has {count} rows "
                         f"(valid: 0 to {count - 1})")
    if len(set(out)) != len(out):
        raise ValueError(f"{what}: row indices repeat: {out}")
    return out


def row_route(rows: Sequence[int], batch: int) -> Route | None:
    """The route of distinct sorted ``rows`` of a padded micro-batch of ``batch`` rows; None for all rows.

    Rows forming one residue class modulo a divisor ``d`` of ``batch`` (e.g. rows 0 and 2 of 4) are one slice
    of step ``d``; otherwise each row is a slice of step ``batch``: rows that are adjacent in the batch are
    not adjacent in the sequence-first layout.
    """
    if len(rows) == batch:
        return None
    if not rows:
        return ()
    step = rows[1] - rows[0] if len(rows) > 1 else batch
    if batch % step == 0 and list(rows) == list(range(rows[0], batch, step)) and rows[0] < step:
        return (slice(rows[0], None, step),)
    return tuple(slice(r, None, batch) for r in rows)


def sequence_route(rows: Sequence[int], starts: Sequence[int], lengths: Sequence[int]) -> Route | None:
    """The route of distinct sorted ``rows`` of a packed micro-batch (row ``i`` at packed tokens
    ``[starts[i], starts[i] + lengths[i])``); None for all rows. Adjacent sequences merge into one slice."""
    if len(rows) == len(lengths):
        return None
    out: list[slice] = []
    for i in rows:
        start, stop = starts[i], starts[i] + lengths[i]
        if out and out[-1].stop == start:
            out[-1] = slice(out[-1].start, stop)
        else:
            out.append(slice(start, stop))
    return tuple(out)


def _key(route: Route) -> tuple[tuple, ...]:
    return tuple((seg.start, seg.stop, seg.step) for seg in route)  # slices are unhashable before Python 3.12


def route_parts(route: Route, tokens: int) -> tuple[tuple[slice, int, int], ...]:
    """``(slice, start, stop)`` per slice of ``route`` over ``tokens`` flattened tokens: the slice's tokens are
    rows ``[start, stop)`` of the route's tokens gathered in order (a routed branch's hidden ``x Aᵀ``)."""
    return _parts(_key(route), tokens)


@functools.lru_cache(maxsize=1024)
def _parts(key: tuple[tuple, ...], tokens: int) -> tuple[tuple[slice, int, int], ...]:
    out, at = [], 0
    for seg in (slice(*k) for k in key):
        n = len(range(tokens)[seg])
        out.append((seg, at, at + n))
        at += n
    return tuple(out)


def route_index(route: Route, tokens: int, device: torch.device) -> torch.Tensor:
    """The flattened token indices of ``route`` in order (int64 on ``device``), for gathers and ``index_add``."""
    return _index(_key(route), tokens, device)


@functools.lru_cache(maxsize=256)
def _index(key: tuple[tuple, ...], tokens: int, device: torch.device) -> torch.Tensor:
    every = torch.arange(tokens, device=device)
    return torch.cat([every[slice(*k)] for k in key])


def sequence_slice(local: int, group, sequence_parallel: bool) -> tuple[int, int]:
    """``(tokens, lo)``: the flattened tokens of the whole sequence and where this rank's ``local`` of them start,
    for a module that reads its TP rank's slice of the sequence under SP (``group``: the TP group), the whole
    sequence otherwise."""
    if not sequence_parallel or group.size() == 1:
        return local, 0
    return local * group.size(), group.rank() * local


def local_route(name: str, tokens: int, lo: int, hi: int, device: torch.device) -> torch.Tensor | Route | None:
    """Adapter ``name``'s current route restricted to flattened tokens ``[lo, hi)`` of ``tokens`` (a rank's slice
    of the sequence under SP, e.g. a MoE router's input), as indices into that slice: None for every token, ``()``
    for none, else int64 indices (ascending)."""
    route = ROUTES.get(name)
    if not route:  # None: every token; (): none
        return route
    index = route_index(route, tokens, device)
    index = index[(index >= lo) & (index < hi)] - lo
    return () if not len(index) else None if len(index) == hi - lo else index


# Routes through a MoE layer's experts. The dispatcher permutes tokens and sends them to other EP ranks, so a
# slice route no longer indexes an expert's input. Instead the MoE layer (:mod:`mlora.models.moe_routes`) sends
# one 0/1 column per adapter of :data:`EXPERT_ADAPTERS` along with the hidden states, and while its experts run,
# :data:`EXPERT_TOKENS` holds those columns for the dispatched tokens; an expert's linear reads its adapters'
# token indices from them (:func:`expert_route`). EXPERT_ADAPTERS is set for a whole forward_backward call
# (recomputes included) and must be the same on every rank of an EP group: their all-to-alls exchange the columns.
EXPERT_ADAPTERS: list[str] = []
EXPERT_TOKENS: dict = {}


@contextlib.contextmanager
def expert_routing(names: Sequence[str]) -> Iterator[None]:
    """Adapters ``names`` routed through the experts inside the block (none: the experts see no columns)."""
    EXPERT_ADAPTERS[:] = names
    try:
        yield
    finally:
        EXPERT_ADAPTERS.clear()


def token_masks(names: Sequence[str], tokens: int, lo: int, hi: int, like: torch.Tensor) -> torch.Tensor:
    """``[hi - lo, len(names)]`` in ``like``'s dtype and device: 1 where flattened token ``lo + i`` belongs to
    adapter ``names[k]``'s current route (an adapter without a route: every token) out of ``tokens``."""
    out = like.new_zeros(hi - lo, len(names))
    for k, name in enumerate(names):
        route = local_route(name, tokens, lo, hi, out.device)
        if route is None:
            out[:, k] = 1
        elif len(route):
            out[route, k] = 1
    return out


@contextlib.contextmanager
def dispatched_tokens(masks: torch.Tensor, tokens_per_expert: Sequence[int], first_expert: int) -> Iterator[None]:
    """While a MoE layer's local experts run: ``masks`` (``[tokens, len(EXPERT_ADAPTERS)]``) of the dispatched
    tokens, of which local expert ``first_expert + j`` gets the ``tokens_per_expert[j]`` after the previous ones'."""
    bounds, at = {}, 0
    for j, n in enumerate(tokens_per_expert):
        bounds[first_expert + j] = (at, at + int(n))
        at += int(n)
    EXPERT_TOKENS.update(names=tuple(EXPERT_ADAPTERS), masks=masks.bool(), bounds=bounds, cache={})
    try:
        yield
    finally:
        EXPERT_TOKENS.clear()


def expert_route(name: str, expert: int) -> torch.Tensor | Route | None:
    """The tokens of ``expert``'s input that adapter ``name`` applies to, while :func:`dispatched_tokens` is in
    force: None for every token, ``()`` for none, else their indices (int64, ascending)."""
    cache = EXPERT_TOKENS["cache"]
    if (name, expert) not in cache:
        names = EXPERT_TOKENS["names"]
        if name not in names:
            route = None
        else:
            start, stop = EXPERT_TOKENS["bounds"][expert]
            rows = EXPERT_TOKENS["masks"][start:stop, names.index(name)].nonzero().squeeze(1)
            route = None if len(rows) == stop - start else () if not len(rows) else rows
        cache[(name, expert)] = route
    return cache[(name, expert)]
