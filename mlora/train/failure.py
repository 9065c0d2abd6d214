"""One report per failed run, not one per rank.

Every rank of a torchrun job runs the same code, so a bad key fails on every rank at once, and a crash
on one rank soon fails the others (their collectives lose a peer). Left to themselves, Hydra prints its
override dump and the traceback on each rank and torchrun adds a block per rank. Here a failing rank:

- keeps the whole traceback in ``<trainer.run_dir>/errors/rank<r>.log`` (not for config errors, whose
  message is the whole story);
- writes torchrun's error file (``TORCHELASTIC_ERROR_FILE``) with the one line that matters, so any
  launcher that reads it (torchrun's "Root Cause", ``mlora-train --nproc_per_node``) shows that line;
- prints one block to stderr, only if it is the first rank of this node to fail (an exclusive lock file
  per job) and no mlora launcher will print it instead;
- exits with status 2 for a configuration error (raised before any model loads), 1 otherwise.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

CONFIG_EXIT = 2
FAILURE_EXIT = 1
LAUNCHED_BY_MLORA = "MLORA_LAUNCHER"  # set by mlora-train's launcher: it prints the report itself
DETAIL_KEY = "mlora_detail"  # in the error file's extraInfo: rank, exit status, where the traceback is


def is_config_error(exc: BaseException) -> bool:
    """A bad key or value: mlora's ConfigError, Hydra's composition and override errors, OmegaConf's
    type and key errors against the schema."""
    from omegaconf.errors import OmegaConfBaseException

    from mlora.config.validate import ConfigError

    try:
        from hydra.errors import HydraException
    except ImportError:  # pragma: no cover - hydra is a dependency
        HydraException = ()  # noqa: N806
    return isinstance(exc, (ConfigError, OmegaConfBaseException, HydraException))


def one_line(exc: BaseException) -> str:
    """``Type: message`` of ``exc``, its chained cause's message added when it has none of its own."""
    msg = str(exc).strip()
    cause = str(exc.__cause__).strip().splitlines()[0] if exc.__cause__ is not None and str(exc.__cause__).strip() else ""
    if cause and cause not in msg:  # e.g. Hydra's "Could not override 'k'." caused by "Key 'x' not in 'Section'"
        msg = f"{msg}\n{cause}" if msg else cause
    name = type(exc).__name__
    return f"{name}: {msg}" if msg else name


def _rank() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _first_on_node() -> bool:
    """Whether this is the first rank of the job on this node to report (an exclusive create)."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    if job is None:
        return True  # a single process: nobody else reports
    lock = Path(tempfile.gettempdir()) / f"mlora-failed-{job}-{os.environ.get('GROUP_RANK', '0')}"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def report(exc: BaseException, run_dir: str | os.PathLike | None = None) -> int:
    """Record and announce ``exc`` as described in the module docstring; returns the exit status."""
    rank, world = _rank()
    config = is_config_error(exc)
    code = CONFIG_EXIT if config else FAILURE_EXIT
    log_file = None
    if not config and run_dir is not None:
        try:
            log_file = Path(run_dir) / "errors" / f"rank{rank}.log"
            log_file.parent.mkdir(parents=True, exist_ok=True)
            log_file.write_text("".join(traceback.format_exception(exc)))
        except OSError:
            log_file = None
    line = one_line(exc)
    where = f" on rank {rank} of {world}" if world > 1 else ""
    detail = f"config error{where}, exit {code}" if config else (
        f"failed{where}, exit {code}; full traceback: {log_file}" if log_file else f"failed{where}, exit {code}")
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            Path(error_file).write_text(json.dumps({"message": {"message": line, "extraInfo": {
                "py_callstack": f"{line}\n({detail})", "timestamp": str(int(time.time())), DETAIL_KEY: detail}}}))
        except OSError:
            pass
    if os.environ.get(LAUNCHED_BY_MLORA) != "1" and (config and rank == 0 or not config and _first_on_node()):
        print(f"mlora-train failed: {line}\n  ({detail})", file=sys.stderr, flush=True)
    return code
