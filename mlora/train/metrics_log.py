"""Where a run's numbers go: ``metrics.jsonl`` (one JSON object per step), wandb or TensorBoard, and
rank-0-aware console logging."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path

log = logging.getLogger("mlora")


def setup_logging(rank: int) -> None:
    """INFO on global rank 0, warnings and errors only elsewhere (every rank runs the same loop)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False


WANDB_ID_FILE = "wandb_run_id"


class MetricsLogger:
    """Numeric metrics of each step to ``<run_dir>/metrics.jsonl`` and the configured backend.

    A resumed run (``resume_step`` given) continues the same record everywhere: ``metrics.jsonl`` drops
    the lines after the checkpoint (:func:`prepare_metrics_file`); W&B resumes the run whose id the
    first launch kept in ``<run_dir>/wandb_run_id`` (files under ``<run_dir>/wandb``, also offline with
    ``WANDB_MODE=offline``; W&B itself ignores steps below the last one it has, so the steps run again
    after the checkpoint keep their first values there); TensorBoard writes to ``<run_dir>/tensorboard`` with ``purge_step`` after
    the checkpoint, so steps logged after it and run again are shown once."""

    def __init__(self, kind: str, run_dir: Path, project_name: str, run_name: str,
                 resume_step: int | None = None) -> None:
        from mlora.config.validate import LOGGERS

        if kind not in LOGGERS:
            raise ValueError(f"unknown trainer.logger {kind!r}; valid: {', '.join(LOGGERS)}")
        self.kind, self.backend = kind, None
        run_dir = Path(run_dir)
        if kind == "wandb":
            self.backend = _wandb_run(run_dir, project_name, run_name, resume_step)
        elif kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.backend = SummaryWriter(str(run_dir / "tensorboard"),
                                         purge_step=None if resume_step is None else resume_step + 1)
        self.path = run_dir / "metrics.jsonl"
        prepare_metrics_file(self.path, resume_step)
        self.file = open(self.path, "a")  # appended, never truncated: a resumed run continues the record

    def log(self, step: int, metrics: dict) -> None:
        flat = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        self.file.write(json.dumps({"step": step, **flat}) + "\n")
        self.file.flush()
        if self.kind == "wandb":
            self.backend.log(flat, step=step)
        elif self.kind == "tensorboard":
            for k, v in flat.items():
                self.backend.add_scalar(k, v, step)

    def close(self) -> None:
        self.file.close()
        if self.kind == "tensorboard":
            self.backend.close()
        elif self.kind == "wandb":
            import wandb

            self.backend.finish()
            # W&B's service may still hold the run file's last records after finish(); its atexit teardown, which
            # would write them, does not run in processes that end without the interpreter's exit handlers (forked
            # ranks): tear down here (the offline file is then complete, seen missing its rows under load)
            wandb.teardown()


def _wandb_run(run_dir: Path, project_name: str, run_name: str, resume_step: int | None):
    """A W&B run: a fresh id kept in ``<run_dir>/wandb_run_id`` for a new run, that id resumed otherwise."""
    import wandb

    id_file = run_dir / WANDB_ID_FILE
    if resume_step is not None and id_file.is_file():
        run_id, resume = id_file.read_text().strip(), "must"
    else:
        if resume_step is not None:
            log.warning("resume from step %d: %s has no %s (the run did not log to W&B before): a new W&B run "
                        "starts", resume_step, run_dir, WANDB_ID_FILE)
        run_id, resume = uuid.uuid4().hex[:12], None  # W&B ids: lowercase letters and digits
        id_file.write_text(run_id + "\n")
    (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
    return wandb.init(project=project_name, name=run_name, id=run_id, resume=resume, dir=str(run_dir))


def read_metrics(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``, in order (for plots and tables after a run)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def prepare_metrics_file(path: Path, resume_step: int | None) -> None:
    """Make ``path`` the record a run continues.

    Resuming from step k: lines of steps after k are dropped (the run died after logging them but
    before checkpointing them; they will be trained and logged again), everything else stays. A
    fresh run in a directory that already has a record moves it aside (``metrics.<time>.jsonl``)
    instead of mixing two runs in one plot.
    """
    if not path.is_file() or path.stat().st_size == 0:
        return
    if resume_step is None:
        old = path.with_name(f"metrics.{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
        os.replace(path, old)
        log.info("a fresh run: the previous %s was moved to %s", path.name, old.name)
        return
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short when the run died
            dropped += 1
            continue
        if isinstance(row, dict) and row.get("step", 0) > resume_step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, path)
        log.info("resume from step %d: dropped %d line(s) of %s logged after that checkpoint (steps > %d run again)",
                 resume_step, dropped, path.name, resume_step)


def step_line(step: int, m: dict) -> str:
    """The console summary of one step."""
    parts = [f"step {step:3d}", f"reward {m['reward/mean']:.3f}", f"kl {m['kl/mean']:.4f}",
             f"actor/pg_loss {m['actor/pg_loss']:+.4f}"]
    if "critic/value_loss" in m:
        parts.append(f"critic/value_loss {m['critic/value_loss']:.4f}")
    parts.append(f"|logp vLLM - trainer| {m.get('rollout/logprob_abs_diff', float('nan')):.2e}")
    parts.append(f"sync {m['timing/adapter_sync_s']:.2f}s")
    parts += [f"{k} {v:.3f}" for k, v in m.items() if k.startswith("eval/") and k.endswith("/reward_mean")]
    return "  ".join(parts)
