"""torchrun worker (2 ranks, TP 2): vocab-parallel log-probs/entropy vs the full-vocabulary computation,
and the collectives they use. Usage: torchrun --nproc_per_node 2 vocab_parallel.py OUT_JSON"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import mlora
from mlora.parallel.accounting import count_collectives, summarize
from mlora.rl.losses import entropy_from_logits
from mlora.rl.vocab_parallel import vocab_parallel_logprobs

V, PADDED = 1001, 1002  # vocabulary padded to a multiple of TP, as the model does


def main() -> None:
    mesh = mlora.init_parallel(tp=2, pp=1)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 7, PADDED, generator=g) * 3
    target = torch.randint(0, V, (3, 7), generator=g)
    target[0, 0], target[1, 1] = 0, V - 1  # first and last real ids, one in each shard
    w_lp, w_ent = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    per = PADDED // 2
    lo = mesh.tp_rank * per
    local = full[..., lo:lo + per].clone().requires_grad_(True)
    valid = min(per, V - lo)
    with count_collectives() as calls:
        lp, ent = vocab_parallel_logprobs(local, target, lo, valid, mesh.tp_group, with_entropy=True)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    ref_logits = full[..., :V].clone().requires_grad_(True)
    ref_lp = torch.log_softmax(ref_logits, -1).gather(-1, target[..., None])[..., 0]
    ref_ent = entropy_from_logits(ref_logits)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    ref_grad = torch.cat([ref_logits.grad, torch.zeros(3, 7, PADDED - V)], -1)[..., lo:lo + per]
    record = {"rank": mesh.rank, "lp": (lp - ref_lp).abs().max().item(), "ent": (ent - ref_ent).abs().max().item(),
              "grad": (local.grad - ref_grad).abs().max().item(),
              "collectives": {k: list(v) for k, v in summarize(calls).items()},
              "vocab_bytes": full[..., :per].numel() * 4}
    parts: list = [None] * 2
    dist.all_gather_object(parts, record)
    if mesh.rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(parts, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
