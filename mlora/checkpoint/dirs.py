"""Checkpoint directories: atomic visibility, the ``latest`` pointer, pruning, completeness checks,
which checkpoint to resume from, and the identity of the base model a checkpoint belongs to.

Layout (SkyRL's names where SkyRL has them; what goes inside is :mod:`mlora.checkpoint.run_state`)::

    <ckpt_path>/latest_ckpt_global_step.txt   the step of the newest complete checkpoint
    <ckpt_path>/global_step_<k>/              one complete checkpoint
        manifest.json                         written last: every file with its size, the base model
    <ckpt_path>/.global_step_<k>.tmp/         a checkpoint being written: invisible to resume

A checkpoint is written into the hidden temporary directory, every file fsynced by the rank that
wrote it, then rank 0 writes the manifest, renames the directory to ``global_step_<k>`` (atomic on
POSIX filesystems) and only then moves the pointer. A run killed at any moment leaves either the
previous checkpoint or the new one visible, never half of one. Old checkpoints are pruned after
the pointer moved (``trainer.max_ckpts_to_keep``).

This module does file-system work only; :func:`save_checkpoint` is the one collective entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable

# one error class for every unusable checkpoint (incomplete, truncated, not a checkpoint, another
# base), the reader's short reads included
from mlora.formats.checkpoint_reader import CheckpointError
from mlora.formats.durable import durable_writes, fsync_dir, write_text_atomic

log = logging.getLogger("mlora")

STEP_PREFIX = "global_step_"
LATEST_FILE = "latest_ckpt_global_step.txt"  # SkyRL's pointer file
MANIFEST = "manifest.json"
FORMAT = "mlora-train-state/1"
RESUME_MODES = ("none", "latest", "from_path")


# ------------------------------------------------------------------ base model identity
def base_model_identity(model_path: str | os.PathLike) -> dict:
    """Where the base lives and a content hash of what defines it, cheap enough for 70B.

    The hash covers ``config.json``, ``model.safetensors.index.json`` (when there is one) and the
    names of the ``*.safetensors`` files. It does not read the weights, so two checkpoints that
    differ only inside identically named shards hash the same.
    """
    path = Path(model_path).expanduser().resolve()
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        file = path / name
        h.update(name.encode() + b"\0")
        h.update(file.read_bytes() if file.is_file() else b"<absent>")
    for shard in sorted(p.name for p in path.glob("*.safetensors")):
        h.update(shard.encode() + b"\0")
    return {"path": str(path), "sha256": h.hexdigest()}


def check_base_model(manifest: dict, model_path: str | os.PathLike, where: Path) -> None:
    """Refuse a checkpoint made on another base model (path or content hash)."""
    saved, now = manifest.get("base_model", {}), base_model_identity(model_path)
    if saved.get("path") != now["path"]:
        raise CheckpointError(f"checkpoint {where} was trained on the base model {saved.get('path')!r}, this run's "
                              f"trainer.policy.model.path is {now['path']!r}: adapters and optimizer state belong "
                              "to their base; resume with the same model (or start fresh with trainer.resume_mode=none)")
    if saved.get("sha256") != now["sha256"]:
        raise CheckpointError(f"checkpoint {where}: the base model at {now['path']} changed since the checkpoint was "
                              f"written (hash of config.json + safetensors index + shard names {now['sha256'][:12]}… "
                              f"!= {str(saved.get('sha256'))[:12]}…): refusing to put its adapters on another base")


# ------------------------------------------------------------------ finding checkpoints
def step_of(directory: Path) -> int | None:
    """``k`` for a directory named ``global_step_<k>``, else None."""
    name = Path(directory).name
    if not name.startswith(STEP_PREFIX) or not name[len(STEP_PREFIX):].isdigit():
        return None
    return int(name[len(STEP_PREFIX):])


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Visible checkpoint directories under ``root`` (complete or not), oldest first."""
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found)


def check_complete(directory: Path) -> dict:
    """The manifest of a complete checkpoint; :class:`CheckpointError` saying what is wrong otherwise."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} does not exist")
    file = directory / MANIFEST
    if not file.is_file():
        raise CheckpointError(f"{directory} is not a complete mlora checkpoint: it has no {MANIFEST} (a checkpoint "
                              f"directory is <trainer.ckpt_path>/{STEP_PREFIX}<k>, written by mlora-train)")
    try:
        manifest = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file} is unreadable ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file}: format {manifest.get('format')!r}, this mlora reads {FORMAT!r}")
    problems = []
    for rel, size in sorted(manifest.get("files", {}).items()):
        f = directory / rel
        if not f.is_file():
            problems.append(f"{rel} is missing")
        elif f.stat().st_size != size:
            problems.append(f"{rel} has {f.stat().st_size} bytes, {size} were written (truncated or modified)")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(f"checkpoint {directory} is damaged: {shown}")
    return manifest


def _pointer_step(root: Path) -> int | None:
    file = root / LATEST_FILE
    try:
        return int(file.read_text().strip())
    except (OSError, ValueError):
        return None


def find_latest(root: Path) -> Path | None:
    """The checkpoint ``trainer.resume_mode=latest`` resumes from: the pointer's, else (damaged or
    missing files) the newest complete one before it, saying why; None when there is none.

    Checkpoints newer than the pointer are ignored: they were made by a run that branched from an
    older checkpoint (``from_path``) and then moved the pointer back, or they were being renamed
    when the run died.
    """
    pointer = _pointer_step(root)
    candidates = [(s, p) for s, p in list_checkpoints(root) if pointer is None or s <= pointer]
    if pointer is not None and not any(s == pointer for s, _ in candidates):
        log.warning("%s names step %d, but %s%d is missing", root / LATEST_FILE, pointer, STEP_PREFIX, pointer)
    for step, path in reversed(candidates):
        try:
            check_complete(path)
        except CheckpointError as exc:
            log.warning("not resuming from %s: %s; trying the previous checkpoint", path, exc)
            continue
        if pointer is not None and step != pointer:
            log.warning("resuming from %s, the newest complete checkpoint before the latest (step %d)", path, pointer)
        return path
    return None


def resolve_resume(mode: str | None, root: Path, resume_path: str | None) -> Path | None:
    """The checkpoint to resume from under ``trainer.resume_mode`` (None: start fresh)."""
    mode = "none" if mode in (None, "none", "null") else mode
    if mode == "none":
        return None
    if mode == "latest":
        found = find_latest(root)
        if found is None:
            log.info("trainer.resume_mode=latest: no complete checkpoint in %s yet, starting from step 0", root)
        return found
    if mode != "from_path":
        raise CheckpointError(f"trainer.resume_mode={mode!r} is not valid; valid: {', '.join(RESUME_MODES)}")
    if not resume_path:
        raise CheckpointError("trainer.resume_mode=from_path needs trainer.resume_path=<ckpt_path>/global_step_<k>")
    path = Path(resume_path).expanduser()
    check_complete(path)
    return path


# ------------------------------------------------------------------ writing
def check_shared_root(root: Path, key: str = "trainer.ckpt_path") -> None:
    """Collective, before anything is written: every rank sees the files rank 0 makes under ``root``.

    Every rank writes its own part of a checkpoint into one directory and rank 0 commits it; on a
    node-local path rank 0 would commit a manifest naming files that exist only on other nodes, and
    every later resume would reject the checkpoint. A token file proves the directory is shared."""
    from mlora.parallel.small_collectives import ranks_seeing_folder

    seen = ranks_seeing_folder(root, f"creating {key}={root}")
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        raise CheckpointError(f"{key}={root} is not shared by all ranks: rank(s) {blind} do not see the file "
                              f"rank 0 wrote there. Every rank writes its part of a checkpoint into that directory, so "
                              f"it must be on a file system every node mounts (Lustre, GPFS, NFS ...); set {key} to "
                              "such a path")


def temp_dir(root: Path, step: int) -> Path:
    return root / f".{STEP_PREFIX}{step}.tmp"


def begin(root: Path, step: int) -> Path:
    """Rank 0: an empty temporary directory for step ``step`` (a stale one from a killed save is removed)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(root, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def commit(root: Path, step: int, files: dict[str, int], meta: dict) -> Path:
    """Rank 0, after every rank fsynced its files: manifest, rename into place, move the pointer."""
    tmp, final = temp_dir(root, step), root / f"{STEP_PREFIX}{step}"
    manifest = {"format": FORMAT, "step": step, "time": time.time(), "files": files, **meta}
    write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    for d in sorted({(tmp / rel).parent for rel in files} | {tmp}, key=lambda p: -len(p.parts)):
        fsync_dir(d)
    stale = None
    if final.exists():  # e.g. a run resumed from an older checkpoint reaches this step again
        stale = root / f".{STEP_PREFIX}{step}.replaced-{os.getpid()}"
        os.replace(final, stale)
    os.replace(tmp, final)
    fsync_dir(root)
    write_text_atomic(root / LATEST_FILE, f"{step}\n")
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def prune(root: Path, keep: int, current: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints up to step ``current`` (keep <= 0: keep all,
    SkyRL's -1). Later ones (another branch of the run) are left alone."""
    if keep <= 0:
        return []
    mine = [p for s, p in list_checkpoints(root) if s <= current]
    removed = mine[:-keep] if len(mine) > keep else []
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    if removed:
        log.info("trainer.max_ckpts_to_keep=%d: removed %s", keep, ", ".join(p.name for p in removed))
    return removed


def save_checkpoint(root: Path, step: int, mesh, write: Callable[[Path], list[Path]], meta: dict,
                    keep: int = -1) -> Path:
    """Collective: every rank's ``write(temp_dir)`` writes and fsyncs the files it owns and returns
    them; rank 0 commits. Returns the final directory (on every rank).

    Each rank writes its own files (no tensor goes through another rank); the manifest's
    ``{file: size}`` lists reach rank 0 as JSON bytes in a tensor gather (no pickle)."""
    import torch.distributed as dist

    from mlora.parallel.small_collectives import gather_json, raise_if_any_failed

    t0 = time.perf_counter()
    if mesh.rank == 0:
        begin(root, step)
    dist.barrier()
    tmp = temp_dir(root, step)
    error, mine = None, {}
    try:
        with durable_writes():  # files written by several ranks (adapters) are fsynced by each writer
            mine = {str(p.relative_to(tmp)): p.stat().st_size for p in write(tmp)}
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it (no hang), then it is re-raised
        error = exc
    raise_if_any_failed(error, f"writing checkpoint {tmp}")  # the temporary directory stays invisible
    parts = gather_json(mine, dst=0)
    final = root / f"{STEP_PREFIX}{step}"
    if mesh.rank == 0:
        files: dict[str, int] = {}
        for part in parts:
            files.update(part)
        commit(root, step, files, meta)
        prune(root, keep, step)
        log.info("checkpoint %s: %d files, %.1f MB, %.2fs", final, len(files), sum(files.values()) / 1e6,
                 time.perf_counter() - t0)
    dist.barrier()  # nobody moves on (or exits) before the checkpoint is visible
    return final
