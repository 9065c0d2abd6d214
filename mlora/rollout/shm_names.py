"""Names of what a run puts in ``/dev/shm``, and removal of what killed runs left there.

Every segment and directory mlora creates in shared memory (the tensor hand-off's segment, an engine's
own segment, the memory mode's adapter files, adapters shipped to a Ray engine) is named
``mlora_<host>_<pid>_<what>``: the host and process that made it. A run that ends normally removes
its own; one that is killed (SIGKILL, OOM, a node drained) cannot, and its adapter copies would stay
in RAM until reboot. The next run on that host removes entries whose process is gone
(:func:`remove_stale`); entries of another host (containers sharing ``/dev/shm``) are never touched.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import uuid
from pathlib import Path

SHM_DIR = Path("/dev/shm")
_PREFIX = "mlora"


def _host() -> str:
    # "_" separates the fields: a host name never contributes one
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:48] or "host"


def shm_name(what: str) -> str:
    """A fresh name for something of this process in ``/dev/shm`` (``what``: a short label; a random
    suffix makes every name unique)."""
    return f"{_PREFIX}_{_host()}_{os.getpid()}_{what}-{uuid.uuid4().hex[:12]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale(shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove the entries of ``shm_dir`` that mlora processes of this host made and that outlived them;
    returns their names."""
    if not shm_dir.is_dir():
        return []
    host, removed = _host(), []
    for entry in shm_dir.iterdir():
        parts = entry.name.split("_", 3)
        if len(parts) != 4 or parts[0] != _PREFIX or parts[1] != host or not parts[2].isdigit():
            continue
        if _alive(int(parts[2])):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except FileNotFoundError:  # removed meanwhile (another run starting on this host)
            continue
        except OSError:  # not ours to remove (another user's): leave it
            continue
        removed.append(entry.name)
    return sorted(removed)
