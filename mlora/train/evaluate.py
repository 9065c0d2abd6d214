"""Evaluation of the current policy on held-out prompts with the rollout engines (SkyRL's
``trainer.eval_*`` keys): mean reward and pass@n per data source / environment, and a dump of
every evaluated response."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Callable

from mlora.rollout.data import Prompt
from mlora.rollout.generator import Generation, SamplingConfig


def eval_metrics(groups: list[str], prompt_of: list[int], rewards: list[float], n: int) -> dict[str, float]:
    """``eval/<group>/reward_mean`` (mean over responses), ``eval/<group>/pass_at_<n>`` (share of prompts
    with a response whose reward is > 0, as SkyRL counts it), and the same over everything as ``all``.

    ``groups[i]`` is the group of prompt ``i``; response ``j`` answers prompt ``prompt_of[j]``.
    """
    by_group: dict[str, list[float]] = defaultdict(list)
    best: dict[int, float] = {}
    for p, r in zip(prompt_of, rewards):
        by_group[groups[p]].append(r)
        by_group["all"].append(r)
        best[p] = max(best.get(p, float("-inf")), r)
    passed: dict[str, list[bool]] = defaultdict(list)
    for p, r in best.items():
        passed[groups[p]].append(r > 0)
        passed["all"].append(r > 0)
    out = {}
    for g, rs in by_group.items():
        out[f"eval/{g}/reward_mean"] = sum(rs) / len(rs)
        out[f"eval/{g}/pass_at_{n}"] = sum(passed[g]) / len(passed[g])
    return out


def evaluate(generate: Callable, prompts: list[Prompt], sampling: SamplingConfig, batch_size: int,
             score: Callable[[Prompt, Generation], float], step: int, dump_dir: Path | None) -> dict[str, float]:
    """Generate ``sampling.n_samples_per_prompt`` responses per prompt, ``batch_size`` prompts per call,
    score them, and (with ``dump_dir``) write ``eval_step_<step>.jsonl``, one response per line.

    ``generate(prompts, sampling, score_of) -> (generations, rewards)`` runs the engines (multi-turn
    environments: whole trajectories, their rewards summed over turns) and
    ``score_of(prompt index, generation)`` beside them (:func:`mlora.rollout.spread.generate_scored`, which
    is collective: then every rank calls this, and only one passes ``dump_dir``)."""
    prompt_of, rewards, dump = [], [], []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        gens, scores = generate(chunk, sampling, lambda i, g, chunk=chunk: score(chunk[i], g))
        for g, reward in zip(gens, scores):
            prompt = chunk[g.prompt_index]
            prompt_of.append(start + g.prompt_index)
            rewards.append(reward)
            dump.append({"step": step, "data_source": prompt.group, "env_class": prompt.env_class,
                         "prompt": prompt.row["prompt"], "response": g.text, "reward": reward,
                         "finish_reason": g.finish_reason})
    if dump_dir is not None:
        dump_dir.mkdir(parents=True, exist_ok=True)
        with open(dump_dir / f"eval_step_{step}.jsonl", "w") as f:
            for row in dump:
                f.write(json.dumps(row, default=str) + "\n")
    return eval_metrics([p.group for p in prompts], prompt_of, rewards, sampling.n_samples_per_prompt)
