"""The passes of one RL step of K experiments on the shared base: their rows in common micro-batches.

Experiment ``e`` trains its own adapters (``e/policy``, ``e/critic`` + value head) with its own
:class:`~mlora.train.engine.ActorCriticEngine` (hyper-parameters, optimizers, KL controller, losses);
the frozen base, the reference and megatron's pipeline schedules are shared. A step
(:func:`mlora.train.engine.step_experiments`) runs every pass once for all experiments:

- the forward-only passes (old log-probs, reference log-probs, values) over every experiment's rows;
- the updates in rounds: round ``r`` holds the ``r``-th optimizer step (mini-batch) of every experiment
  that has one, one schedule for all of them, then each experiment's own gradient clipping and AdamW step.

Each data-parallel rank takes its share of every experiment's mini-batch, experiments in order, and cuts
the rows into micro-batches of the configured size (or token budget): a micro-batch may hold rows of
several experiments (so a small experiment does not leave micro-batches half empty). The model applies
each row's adapter after one base GEMM for all rows (``adapter_rows``,
:meth:`mlora.MLoraModel.forward_backward`), and each experiment's loss sees its own rows only (a view of
the logits). Its loss is normalised by its own mini-batch's counts, so the sum of the experiments' losses
gives each adapter the gradient it would get trained alone. With one experiment this is the plain
single-adapter step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from mlora.lora.grads import clip_grads, finalize_grads
from mlora.models.packing import PackedRows
from mlora.train.collectives import dp_gather, from_last_stage, model_mode, reduce_metrics
from mlora.train.micro_batches import group_units, in_row_order, micro_batch

ROUTE = "adapter_rows"  # the micro-batch key MLoraModel.forward_backward routes adapters by


@dataclass(frozen=True)
class Segment:
    """Rows ``[lo, hi)`` of a micro-batch belong to experiment ``part``."""

    part: int
    lo: int
    hi: int


@dataclass
class Trained:
    """One optimizer of one experiment: what an update round steps."""

    params: list
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    max_grad_norm: float | None


def dp_slice(mesh, start: int, count: int) -> slice:
    """This data-parallel rank's rows of the ``count`` rows from ``start``."""
    per = count // mesh.dp
    return slice(start + mesh.dp_rank * per, start + (mesh.dp_rank + 1) * per)


def _pad_width(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` ``[rows, w, ...]`` zero-padded to ``[rows, width, ...]``."""
    if t.shape[1] == width:
        return t
    pad = t.new_zeros((t.shape[0], width - t.shape[1], *t.shape[2:]))
    return torch.cat([t, pad], dim=1)


def _segments(parts: list[int]) -> list[Segment]:
    """Runs of equal experiments in a micro-batch's rows (rows come experiment by experiment)."""
    out: list[Segment] = []
    for i, p in enumerate(parts):
        if out and out[-1].part == p:
            out[-1] = Segment(p, out[-1].lo, i + 1)
        else:
            out.append(Segment(p, i, i + 1))
    return out


class JointBatch:
    """The rows of K experiments' rollout batches, right-padded to one width, and their micro-batches."""

    def __init__(self, engines: Sequence, batches: Sequence) -> None:
        first = engines[0]
        self.engines, self.batches = list(engines), list(batches)
        self.model, self.mesh, self.cfg = first.model, first.mesh, first.cfg
        for e in self.engines[1:]:
            if e.model is not self.model:
                raise ValueError("the experiments of one step must share one model (one frozen base)")
            if e.reference != first.reference:
                raise ValueError(f"the experiments of one step share the reference: {list(e.reference)} != "
                                 f"{list(first.reference)}")
            for key in ("micro_train_batch_size", "micro_forward_batch_size", "packing"):
                if getattr(e.cfg, key) != getattr(self.cfg, key):
                    raise ValueError(f"the experiments of one step share {key}: {getattr(e.cfg, key)!r} != "
                                     f"{getattr(self.cfg, key)!r}")
        self.width = max(b.input_ids.shape[1] for b in self.batches)
        self.offsets = [0]
        for b in self.batches:
            self.offsets.append(self.offsets[-1] + b.size)
        self.input_ids = torch.cat([_pad_width(b.input_ids, self.width) for b in self.batches])
        self.attention_mask = torch.cat([_pad_width(b.attention_mask, self.width) for b in self.batches])

    def per_token(self, values: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """Experiments' ``[N_p, S_p - 1, ...]`` per-action tensors as one ``[N, S - 1, ...]`` (zeros for the
        experiments not in ``values`` and past each one's width)."""
        like = next(iter(values.values()))
        out = []
        for p, b in enumerate(self.batches):
            t = values.get(p)
            if t is None:
                t = like.new_zeros((b.size, self.width - 1, *like.shape[2:]))
            out.append(_pad_width(t, self.width - 1))
        return torch.cat(out)

    def micro_batches(self, picks: Sequence[tuple[int, int, int]], size: int, per_row: dict, what: str) -> list[dict]:
        """Micro-batches of rows ``[start, start + count)`` of each ``(experiment, start, count)``, this DP
        rank's share of each, experiments in order: ``size`` rows each, or packed under the token budget.
        Each holds ``rows`` (its rows' places among this rank's rows) and ``segments``."""
        rows, parts = [], []
        for p, start, count in picks:
            s = dp_slice(self.mesh, start, count)
            rows += range(self.offsets[p] + s.start, self.offsets[p] + s.stop)
            parts += [p] * (s.stop - s.start)
        packed = self.cfg.packing.enabled
        if not packed and len(rows) % size:
            shares = ", ".join(f"{self.engines[p].policy}: {c // self.mesh.dp}" for p, _, c in picks)
            raise ValueError(f"the experiments' rows of one pass on a data-parallel rank ({shares}) add up to "
                             f"{len(rows)}, not a multiple of {what}={size}: every micro-batch of a pass has one "
                             "shape; choose batch sizes whose per-rank rows add up to a multiple of it (or use "
                             "trainer.use_sample_packing)")
        index = torch.tensor(rows)
        tokens = self.attention_mask[index].sum(-1).tolist()
        out = []
        for group in group_units(tokens, size, self.cfg.packing, self.width):
            local = torch.tensor(group)
            mb = micro_batch(self.input_ids, self.attention_mask, index[local], per_row, packed, self.mesh.device)
            mb["rows"] = local
            mb["segments"] = _segments([parts[i] for i in group])
            out.append(mb)
        return out

    def split(self, full: torch.Tensor, picks_counts: Sequence[tuple[int, int]]) -> dict[int, torch.Tensor]:
        """Per experiment, its rows of a DP-gathered ``[dp · L, ...]`` result whose per-rank blocks hold each
        ``(experiment, rows per rank)`` in turn."""
        per_rank = sum(n for _, n in picks_counts)
        blocks = full.view(self.mesh.dp, per_rank, *full.shape[1:])
        out, at = {}, 0
        for p, n in picks_counts:
            out[p] = blocks[:, at:at + n].reshape(self.mesh.dp * n, *full.shape[1:])
            at += n
        return out


def _row_keys(mb: dict) -> list[str]:
    skip = {"segments", ROUTE, "packed"} | ({"input_ids"} if "packed" in mb else set())
    return [k for k in mb if k not in skip]


def split_micro_batch(mb: dict, out: torch.Tensor, seg: Segment, keys: frozenset | None = None
                      ) -> tuple[torch.Tensor, dict]:
    """Experiment ``seg.part``'s rows of a micro-batch: a view of the output (logits or hidden states) and the
    micro-batch restricted to them (``keys``: the per-row entries the experiment has; None: all)."""
    n = len(mb["rows"])
    keep = [k for k in _row_keys(mb) if keys is None or k in keys or k in ("rows", "input_ids", "attention_mask")]
    if seg.lo == 0 and seg.hi == n:
        return out, {**{k: mb[k] for k in keep}, **({"packed": mb["packed"], "input_ids": mb["input_ids"]}
                                                     if "packed" in mb else {})}
    sub = {k: mb[k][seg.lo:seg.hi] for k in keep}
    packed = mb.get("packed")
    if packed is None:
        return out[seg.lo:seg.hi], sub
    starts = packed.starts
    t0, t1 = starts[seg.lo], starts[seg.hi - 1] + packed.lengths[seg.hi - 1]
    sub["input_ids"] = mb["input_ids"][:, t0:t1]
    sub["packed"] = PackedRows(packed.lengths[seg.lo:seg.hi], packed.row_width, t1 - t0)
    return out[:, t0:t1], sub


def _route(mbs: list[dict], routed: Mapping[int, str]) -> None:
    """Each micro-batch's ``adapter_rows``: every routed adapter applies to its experiment's rows only."""
    if len(routed) < 2:
        return
    for mb in mbs:
        rows = {name: [] for name in routed.values()}
        for seg in mb["segments"]:
            rows[routed[seg.part]] += range(seg.lo, seg.hi)
        mb[ROUTE] = rows


@torch.no_grad()
def forward(joint: JointBatch, parts: Sequence[int], adapters: Sequence[str], routed: Mapping[int, str],
            fns: Mapping[int, Callable], hidden: bool, trailing: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """A forward-only pass (eval mode) over every row of ``parts``: ``adapters`` on all rows, ``routed[p]`` on
    experiment ``p``'s rows; ``fns[p](output rows, micro-batch rows) -> [rows, *trailing]`` (float32).
    Returns each experiment's ``[N_p, *trailing]`` on every rank, on the CPU."""
    picks = [(p, 0, joint.batches[p].size) for p in parts]
    mbs = joint.micro_batches(picks, joint.cfg.micro_forward_batch_size, {}, "micro_forward_batch_size_per_gpu")
    _route(mbs, routed)

    def fn(out, mb):
        results = [fns[s.part](*split_micro_batch(mb, out, s)) for s in mb["segments"]]
        return torch.zeros(()), {"out": results[0] if len(results) == 1 else torch.cat(results)}

    model = joint.model
    with model.use_adapters(*adapters, *(routed[p] for p in parts if p in routed)), model_mode(model, False):
        outs = model.forward_backward(mbs, fn, forward_only=True, hidden_states=hidden)
    counts = [(p, joint.batches[p].size // joint.mesh.dp) for p in parts]
    local = from_last_stage(joint.mesh, in_row_order(outs, mbs), (sum(n for _, n in counts), *trailing))
    return joint.split(dp_gather(joint.mesh, local).cpu(), counts)


def update(joint: JointBatch, parts: Sequence[int], schedules: Mapping[int, list[tuple[int, int]]],
           adapters: Sequence[str], routed: Mapping[int, str], per_row: dict, keys: Mapping[int, frozenset],
           make_loss: Callable[[int, int, int], Callable], trained: Mapping[int, Trained],
           hidden: bool) -> dict[int, list[dict]]:
    """Optimizer steps in rounds (train mode): round ``r`` runs the ``r``-th ``(start, count)`` mini-batch of
    each experiment's schedule through one pipeline schedule, ``make_loss(p, start, count)`` the loss of
    experiment ``p``'s rows; then each experiment's gradients are reduced, clipped and stepped. Returns per
    experiment the metrics of each of its optimizer steps (identical on every rank)."""
    results: dict[int, list[dict]] = {p: [] for p in parts}
    model = joint.model
    for r in range(max(len(schedules[p]) for p in parts)):
        active = [p for p in parts if r < len(schedules[p])]
        picks = [(p, *schedules[p][r]) for p in active]
        mbs = joint.micro_batches(picks, joint.cfg.micro_train_batch_size, per_row, "micro_train_batch_size_per_gpu")
        _route(mbs, {p: routed[p] for p in active})
        losses = {p: make_loss(p, start, count) for p, start, count in picks}

        def loss_fn(out, mb):
            total, metrics = None, {}
            for seg in mb["segments"]:
                loss, m = losses[seg.part](*split_micro_batch(mb, out, seg, keys[seg.part]))
                total = loss if total is None else total + loss
                metrics.update({f"{seg.part}:{k}": v for k, v in m.items()})
            return total, metrics

        for p in active:
            trained[p].optimizer.zero_grad(set_to_none=True)
        with model.use_adapters(*adapters, *(routed[p] for p in active)), model_mode(model, True):
            outs = model.forward_backward(mbs, loss_fn, hidden_states=hidden)
        finalize_grads([param for p in active for param in trained[p].params])
        norms, lrs = {}, {}
        for p in active:
            t = trained[p]
            norms[p] = clip_grads(t.params, t.max_grad_norm)
            lrs[p] = t.scheduler.get_last_lr()[0]
            t.optimizer.step()
            t.scheduler.step()
            t.optimizer.zero_grad(set_to_none=True)  # gradients do not outlive the step
        reduced = reduce_metrics(joint.mesh, outs)
        for p in active:
            metrics = {k.split(":", 1)[1]: v for k, v in reduced.items() if k.split(":", 1)[0] == str(p)}
            metrics["grad_norm"] = float(norms[p])
            metrics["lr"] = lrs[p]
            results[p].append(metrics)
    return results
