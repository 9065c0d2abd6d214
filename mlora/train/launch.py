"""``mlora-train --nproc_per_node N ...``: torchrun's launcher, with one report when the run fails.

torchrun's options (``--nproc_per_node``, ``--nnodes``, ``--rdzv_*``, ``--node_rank``, ...) are passed to
``torch.distributed.run`` unchanged; everything else goes to every rank's ``python -m mlora.train``. When
a rank fails, torchrun raises ``ChildFailedError`` and would print its traceback and a block per rank;
this launcher prints one block instead: the first failure's line from its error file
(:mod:`mlora.train.failure`), its rank, where its traceback is, and how many other ranks stopped; it
exits with the first failure's status (2 for a config error).
"""

from __future__ import annotations

import logging
import os
import sys


def _launcher_options() -> tuple[set[str], set[str]]:
    """torchrun's long options: (those that take a value, flags)."""
    from torch.distributed.run import get_args_parser

    valued, flags = set(), set()
    for action in get_args_parser()._actions:
        for opt in action.option_strings:
            if opt.startswith("--") and opt not in ("--help", "--module", "--no-python", "--no_python",
                                                    "--run-path", "--run_path"):
                (flags if action.nargs == 0 else valued).add(opt)
    return valued, flags


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's options, mlora.train's arguments) of ``argv``; torchrun's ``--module``/``--no-python``/
    ``--run-path`` are not accepted (the script is always ``-m mlora.train``)."""
    valued, flags = _launcher_options()
    launcher, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in flags:
            launcher.append(arg)
        elif name in valued:
            if "=" in arg:
                launcher.append(arg)
            elif i + 1 < len(argv):
                launcher += [arg, argv[i + 1]]
                i += 1
            else:
                raise SystemExit(f"mlora-train: {arg} needs a value")
        else:
            rest.append(arg)
        i += 1
    return launcher, rest


def wants_launcher(argv: list[str]) -> bool:
    """Whether ``argv`` asks mlora-train to start the ranks itself (a torchrun option is given) and this
    process is not already one of them."""
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        return False
    return any(a.split("=", 1)[0] in ("--nproc_per_node", "--nproc-per-node", "--nnodes") for a in argv)


def launch(argv: list[str]) -> int:
    """Run ``python -m mlora.train`` on the ranks torchrun's options in ``argv`` describe; the exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from mlora.train.failure import DETAIL_KEY, LAUNCHED_BY_MLORA

    launcher, rest = split_argv(argv)
    # torchrun's own logging (OMP_NUM_THREADS advice, per-worker SIGTERM lines, the failure table) is
    # replaced by the report below; mlora chooses threads itself (mlora.rollout.cpu_threads)
    for name in ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ[LAUNCHED_BY_MLORA] = "1"
    try:
        run(parse_args([*launcher, "--module", "mlora.train", *rest]))
    except ChildFailedError as failed:
        rank, first = failed.get_first_failure()
        message = first.message if isinstance(first.message, str) else first.message.get("message", "")
        data = first.error_file_data.get("message") if isinstance(first.error_file_data, dict) else None
        detail = data.get("extraInfo", {}).get(DETAIL_KEY) if isinstance(data, dict) else None
        others = sorted(r for r in failed.failures if r != rank)
        print(f"mlora-train failed: {message or f'exit {first.exitcode}'}\n"
              f"  ({detail or f'rank {rank}, exit {first.exitcode}'})"
              + (f"\n  {len(others)} other rank(s) stopped with it" if others else ""), file=sys.stderr, flush=True)
        return first.exitcode if first.exitcode > 0 else 1
    return 0
