"""Cases for tests/test_rank_pool.py, run on the rank pool (and once under torchrun).

Usage: pool_cases.py MODE OUT_DIR. Modes:
- ``poison``: every rank damages what a next case in the same process would inherit (an environment
  variable, ``torch.distributed.all_reduce``, torch's seed, the working directory, a module attribute),
  then rank 1 raises while the others wait in a barrier for it.
- ``fresh``: an all-reduce over the ranks, and a record of what the rank inherited (written by rank 0).
- ``hang``: rank 0 sleeps past any timeout while the others wait for it.
- ``orphan``: each rank starts a long ``sleep`` child and writes its pid, then rank 0 fails.
- ``env``: each rank writes the torchrun variables it sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

TORCHRUN_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME",
                 "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS")


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "poison":
        os.environ["MLORA_POOL_POISON"] = "1"
        dist.all_reduce = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("poisoned all_reduce"))
        torch.manual_seed(0)
        torch.set_default_dtype(torch.float64)
        os.chdir("/")
        import mlora.testing.rank_pool as pool

        pool.TERM_GRACE_S = -1.0
        if rank == 1:
            raise ValueError("deliberate failure in rank 1")
        dist.barrier()  # never returns: rank 1 is gone
    elif mode == "fresh":
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        import mlora.testing.rank_pool as pool

        record = {"sum": t.item(), "poison": os.environ.get("MLORA_POOL_POISON"), "seed": torch.initial_seed(),
                  "dtype": str(torch.get_default_dtype()), "cwd": os.getcwd(), "grace": pool.TERM_GRACE_S,
                  "world": dist.get_world_size(), "pid": os.getpid()}
        records = [None] * dist.get_world_size()
        dist.all_gather_object(records, record)
        if rank == 0:
            (out / "fresh.json").write_text(json.dumps(records))
    elif mode == "hang":
        if rank == 0:
            time.sleep(3600)
        dist.barrier()
    elif mode == "orphan":
        child = subprocess.Popen(["sleep", "1000"])
        (out / f"orphan{rank}.pid").write_text(str(child.pid))
        dist.barrier()
        if rank == 0:
            raise RuntimeError("rank 0 fails with a child running")
        dist.barrier()
    elif mode == "env":
        (out / f"env{rank}.json").write_text(json.dumps({k: os.environ.get(k) for k in TORCHRUN_KEYS}))
    else:
        raise ValueError(f"unknown mode {mode!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
