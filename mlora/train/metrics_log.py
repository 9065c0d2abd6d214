"""Where a run's numbers go: ``metrics.jsonl`` (one JSON object per step), wandb or TensorBoard, and
rank-0-aware console logging."""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("mlora")


def setup_logging(rank: int) -> None:
    """INFO on global rank 0, warnings and errors only elsewhere (every rank runs the same loop)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False


class MetricsLogger:
    """Numeric metrics of each step to ``<run_dir>/metrics.jsonl`` and the configured backend."""

    def __init__(self, kind: str, run_dir: Path, project_name: str, run_name: str) -> None:
        self.kind, self.backend = kind, None
        if kind == "wandb":
            import wandb

            self.backend = wandb.init(project=project_name, name=run_name)
        elif kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.backend = SummaryWriter(str(run_dir / "tensorboard"))
        elif kind != "console":
            raise ValueError(f"unknown trainer.logger {kind!r}; valid: console, wandb, tensorboard")
        self.path = run_dir / "metrics.jsonl"
        self.file = open(self.path, "w")  # a new run starts a new record

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
            self.backend.finish()


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
