"""The table a person compares experiments by: per experiment its steps, held-out reward and pass@n before
and after training, training reward of its first and last steps, and KL to the base; written to
``<run_dir>/experiments.md`` and ``experiments.json`` at the end of a run with experiments."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from mlora.train.metrics_log import read_metrics

WINDOW = 5  # training steps averaged at the start and the end (sampled rewards are noisy)


def experiment_results(rows: list[dict], name: str) -> dict:
    """One experiment's summary from the run's metrics rows (``<name>/...`` keys)."""
    p = f"{name}/"
    train = [r for r in rows if p + "reward/mean" in r]
    evals = sorted((r.get(p + "trainer/step", r["step"]), r) for r in rows if p + "eval/all/reward_mean" in r)

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    rewards = [r[p + "reward/mean"] for r in train]
    out = {"experiment": name, "steps": max((r[p + "trainer/step"] for r in train), default=0),
           "train_reward_first": mean(rewards[:WINDOW]), "train_reward_last": mean(rewards[-WINDOW:]),
           "kl_last": train[-1][p + "kl/mean"] if train else None}
    if evals:
        (s0, first), (s1, last) = evals[0], evals[-1]
        out.update(eval_step_first=s0, eval_reward_first=first[p + "eval/all/reward_mean"], eval_step_last=s1,
                   eval_reward_last=last[p + "eval/all/reward_mean"])
        for k in sorted(last):
            if k.startswith(p + "eval/all/pass_at_"):
                out[k[len(p) + len("eval/all/"):] + "_last"] = last[k]
    return out


def _cell(value) -> str:
    if value is None:
        return "–"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def results_markdown(results: Sequence[dict]) -> str:
    """The experiments side by side as a Markdown table."""
    head = ["experiment", "steps", "held-out reward (first eval → last)", "pass@n (last eval)",
            f"train reward (first {WINDOW} → last {WINDOW} steps)", "KL to base (last step)"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in results:
        passes = [f"{k[:-len('_last')]} {_cell(v)}" for k, v in r.items() if k.startswith("pass_at_")]
        held = (f"{_cell(r['eval_reward_first'])} (step {r['eval_step_first']}) → {_cell(r['eval_reward_last'])} "
                f"(step {r['eval_step_last']})" if "eval_reward_last" in r else "–")
        lines.append("| " + " | ".join([r["experiment"], str(r["steps"]), held, ", ".join(passes) or "–",
                                        f"{_cell(r['train_reward_first'])} → {_cell(r['train_reward_last'])}",
                                        _cell(r["kl_last"])]) + " |")
    return "\n".join(lines)


def write_results(metrics_file: Path, names: Sequence[str], run_dir: Path) -> str:
    """Write ``experiments.md`` and ``experiments.json`` into ``run_dir``; returns the Markdown table."""
    rows = read_metrics(metrics_file)
    results = [experiment_results(rows, name) for name in names]
    table = results_markdown(results)
    (Path(run_dir) / "experiments.md").write_text(table + "\n")
    (Path(run_dir) / "experiments.json").write_text(json.dumps(results, indent=1) + "\n")
    return table
