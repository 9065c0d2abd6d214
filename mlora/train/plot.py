"""A PNG of reward, evaluation reward, KL and losses from a run's metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = (("reward/mean", "reward"), ("eval/all/reward_mean", "eval reward (held-out, greedy)"),
          ("kl/mean", "KL(policy || reference)"), ("actor/pg_loss", "policy loss"), ("critic/value_loss", "value loss"))


def plot_metrics(metrics_file: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_file).read_text().splitlines() if line.strip()]
    panels = [(k, title) for k, title in PANELS if any(k in r for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (key, title) in zip(list(axes) if len(panels) > 1 else [axes], panels):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
