"""Durable, atomic file writes: fsync of files and directories, text files replaced atomically, and the
switch that makes collective writes durable (checkpoints) or merely visible (the per-step hand-off)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

_durable = False  # set by durable_writes(); the same on every rank when entered collectively


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to stable storage (the writer's own pages: every rank syncs what it wrote)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (new names, renames) durable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # some filesystems do not open directories; their renames are durable on their own
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """``path`` holds either its old content or ``text``, never a mix: temp file, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


@contextlib.contextmanager
def durable_writes() -> Iterator[None]:
    """Inside the block, collective writes fsync their data and directories (checkpoints); enter it
    on every rank (:func:`mlora.checkpoint.dirs.save_checkpoint` does)."""
    global _durable
    previous, _durable = _durable, True
    try:
        yield
    finally:
        _durable = previous


def is_durable(durable: bool | None = None) -> bool:
    """``durable`` if given, else whether a :func:`durable_writes` block is active."""
    return _durable if durable is None else durable
