"""A PNG of reward, evaluation reward, KL and losses from a run's metrics.jsonl; with experiments, one line
per experiment on shared axes (each over its own steps)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from mlora.train.metrics_log import read_metrics

PANELS = (("reward/mean", "reward"), ("eval/all/reward_mean", "eval reward (held-out, greedy)"),
          ("kl/mean", "KL(policy || reference)"), ("actor/pg_loss", "policy loss"), ("critic/value_loss", "value loss"))


def plot_metrics(metrics_file: Path, out: Path, experiments: Sequence[str] = ()) -> Path:
    """Draw ``metrics_file``'s panels into ``out``; ``experiments``: their names (metrics ``<name>/...``,
    plotted over each one's own steps ``<name>/trainer/step``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_file)
    lines = [(f"{e}/", e) for e in experiments] or [("", None)]
    panels = [(k, title) for k, title in PANELS if any(p + k in r for r in rows for p, _ in lines)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (key, title) in zip(list(axes) if len(panels) > 1 else [axes], panels):
        for prefix, label in lines:
            pts = [(r.get(prefix + "trainer/step", r["step"]), r[prefix + key]) for r in rows if prefix + key in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if experiments:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
