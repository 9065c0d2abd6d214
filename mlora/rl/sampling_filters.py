"""Which prompt groups carry a learning signal: SkyRL's zero-variance filter and DAPO's dynamic sampling
(``trainer.algorithm.zero_variance_filter``, ``trainer.algorithm.dynamic_sampling``). Pure functions: rewards
and group ids in, row selections out."""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

DYNAMIC_SAMPLING_TYPES = ("filter", "replace")


def zero_variance_keep(rewards: torch.Tensor, groups: Sequence[Hashable], live: torch.Tensor | None = None,
                       tol: float = 0.0) -> torch.Tensor:
    """``[B]`` bool: the rows whose group keeps a reward spread. A group is dropped only when it has more than
    one live row (``live``: the rows with a token in the loss; None: all) and their rewards lie within ``tol``
    of each other; a group with at most one live row is kept (SkyRL's ``zero_variance_filter``)."""
    live = torch.ones(len(groups), dtype=torch.bool) if live is None else live.bool()
    members: dict[Hashable, list[float]] = {}
    for g, r, alive in zip(groups, rewards.tolist(), live.tolist()):
        if alive:
            members.setdefault(g, []).append(r)
    flat = {g for g, vals in members.items() if len(vals) > 1 and max(vals) - min(vals) <= tol}
    return torch.tensor([g not in flat for g in groups], dtype=torch.bool)


def group_has_signal(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[n_groups]`` bool: groups of ``group_size`` adjacent rows whose rewards are not all equal (DAPO's
    dynamic sampling keeps those; SkyRL's ``handle_dynamic_sampling`` compares the group's standard deviation
    with 0)."""
    g = rewards.view(-1, group_size)
    return g.std(dim=1, unbiased=False) > 0 if group_size > 1 else torch.zeros(g.shape[0], dtype=torch.bool)


def replacement_rows(signal: torch.Tensor, group_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """POLARIS's replace strategy (SkyRL's ``handle_replace_sampling``): ``[n_groups · group_size]`` source row of
    every row, each group without signal taking the rows of a group with one (distinct groups while there are
    enough, else drawn with repetition), the others their own."""
    good = torch.nonzero(signal).flatten()
    bad = torch.nonzero(~signal).flatten()
    if len(good) >= len(bad):
        chosen = good[torch.randperm(len(good), generator=generator)[:len(bad)]]
    else:
        chosen = good[torch.randint(len(good), (len(bad),), generator=generator)]
    source = torch.arange(len(signal))
    source[bad] = chosen
    return (source[:, None] * group_size + torch.arange(group_size)).reshape(-1)
