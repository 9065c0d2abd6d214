"""SFT -> reward model -> PPO with the reward adapter, on one frozen base, on CPU (see docs/rlhf.md).

Each stage is one ``mlora-train`` run under torchrun (TP2xPP2 on 4 CPU ranks by default):

1. ``--config-name sft``: adapter ``policy`` on (prompt, response), the response the chosen or the
   rejected one by a coin (:func:`sft_data`) -> ``sft/final_adapter``;
2. ``--config-name rm``: adapter ``reward`` + score head on (prompt, chosen, rejected), held-out
   accuracy every few steps -> ``rm/final_adapter`` (a PEFT SEQ_CLS adapter);
3. ``--config-name cpu_demo`` with ``environment.env_class=reward_model``: PPO of a new ``policy``
   adapter on top of the frozen SFT adapter, rewarded by the reward adapter scored on the trainer's
   own base (no second model, no reward server).

Then ``pipeline.png`` (reward-model held-out accuracy; PPO's reward-model score per step) and
``summary.json``. The task (mlora.demos.preference_assets): responses of colour words are preferred
to responses of animal words.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int, config: str, overrides: list[str], log_file: Path) -> float:
    """One mlora-train run; its output goes to ``log_file``. Returns its wall time in seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={_free_port()}",
           "-m", "mlora.train", "--config-name", config, *overrides]
    print(f"\n$ {' '.join(cmd)}\n  (log: {log_file})", flush=True)
    t0 = time.perf_counter()
    with open(log_file, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        sys.exit(f"stage {config} failed ({proc.returncode}); last lines of {log_file}:\n"
                 + "\n".join(log_file.read_text().splitlines()[-40:]))
    return time.perf_counter() - t0


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def ppo_prompts(assets: Path, count: int, seed: int) -> Path:
    """Prompts of the preference task for PPO (other draws than the pairs), scored by the reward model."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mlora.demos.preference_assets import preference_rows

    rows = [{"prompt": r["prompt"], "env_class": "reward_model", "reward_spec": "{}",
             "data_source": "synthetic_preference"} for r in preference_rows(count, seed)]
    path = assets / "ppo_prompts.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def sft_data(assets: Path, seed: int) -> Path:
    """SFT rows of the pair prompts whose response is the chosen or the rejected one, by a seeded coin:
    SFT teaches the format (a short list of words), not the preference, so the SFT policy answers
    with colours and animals alike and the preference is left for the reward model and PPO to add
    (SFT on the chosen responses alone would leave PPO nothing to improve on this task)."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    rows = [{"prompt": r["prompt"], "response": r["chosen"] if rng.random() < 0.5 else r["rejected"]}
            for r in pq.read_table(assets / "pairs_train.parquet").to_pylist()]
    path = assets / "sft_mixed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/rlhf_pipeline"))
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--sft-steps", type=int, default=30)
    p.add_argument("--rm-steps", type=int, default=30)
    p.add_argument("--ppo-steps", type=int, default=20)
    args = p.parse_args()

    from mlora.demos.preference_assets import build_preference_assets

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    assets = build_preference_assets(out / "assets")
    prompts = ppo_prompts(assets, PPO_PROMPTS, seed=7)
    sft_rows = sft_data(assets, seed=3)
    nproc = args.tp * args.pp
    mesh = [f"trainer.policy.megatron_config.tensor_model_parallel_size={args.tp}",
            f"trainer.policy.megatron_config.pipeline_model_parallel_size={args.pp}"]
    model = f"trainer.policy.model.path={assets / 'tiny-llama'}"
    seconds = {}

    # 1. SFT: the policy adapter learns the response format (colour and animal answers alike)
    sft_dir = out / "sft"
    seconds["sft"] = _torchrun(nproc, "sft", [
        *mesh, model, f"data.train_data=[{sft_rows}]", f"trainer.run_dir={sft_dir}",
        f"trainer.total_steps={args.sft_steps}", "trainer.run_name=rlhf_sft", *SFT_OVERRIDES], out / "sft.log")
    sft_adapter = sft_dir / "final_adapter"

    # 2. reward model: a reward adapter + score head on the pairs, held-out accuracy as it trains
    rm_dir = out / "rm"
    seconds["rm"] = _torchrun(nproc, "rm", [
        *mesh, model, f"data.train_data=[{assets / 'pairs_train.parquet'}]",
        f"data.val_data=[{assets / 'pairs_val.parquet'}]", f"trainer.run_dir={rm_dir}",
        f"trainer.total_steps={args.rm_steps}", "trainer.run_name=rlhf_rm", *RM_OVERRIDES], out / "rm.log")
    reward_adapter = rm_dir / RM_ADAPTER_DIR

    # 3. PPO on top of the frozen SFT adapter, rewarded by the reward adapter on the same base
    ppo_dir = out / "ppo"
    seconds["ppo"] = _torchrun(nproc, "cpu_demo", [
        *mesh, model, "demo.prepare=false", f"data.train_data=[{prompts}]", "data.val_data=[]",
        f"trainer.policy.model.frozen_adapter_path={sft_adapter}", "environment.env_class=reward_model",
        f"reward_model.adapter_path={reward_adapter}", f"trainer.total_steps={args.ppo_steps}",
        "trainer.ckpt_interval=0", "trainer.eval_before_train=false", f"trainer.run_dir={ppo_dir}",
        "trainer.run_name=rlhf_ppo", *PPO_OVERRIDES], out / "ppo.log")

    summary = summarize(out, rm_dir, ppo_dir, seconds)
    print(json.dumps(summary, indent=1))


# Stage settings beyond the defaults of configs/sft.yaml, rm.yaml and cpu_demo.yaml. The learning rates
# are a tiny random model's (the configs' 1e-4 suits real models); PPO sees the same 16 prompts every
# step (train_batch_size = all of them), so its curve shows the policy's progress rather than which
# prompts were drawn (a learned reward has a per-prompt offset: Bradley-Terry fixes only differences).
SFT_OVERRIDES = ["trainer.policy.optimizer_config.lr=3e-3", "trainer.eval_interval=0", "trainer.ckpt_interval=0"]
RM_OVERRIDES = ["trainer.policy.optimizer_config.lr=3e-3", "trainer.eval_interval=5", "trainer.eval_before_train=true",
                "trainer.ckpt_interval=0"]
RM_ADAPTER_DIR = "final_adapter"  # mlora-train --config-name rm writes the PEFT SEQ_CLS adapter here
RM_ACCURACY = ("eval/rewards/accuracies", "eval/accuracy")  # the held-out accuracy (whichever the run logs)
PPO_PROMPTS = 16
PPO_OVERRIDES = [f"trainer.train_batch_size={PPO_PROMPTS}", "trainer.policy_mini_batch_size=8",
                 "generator.sampling_params.max_generate_length=16"]


def summarize(out: Path, rm_dir: Path, ppo_dir: Path, seconds: dict) -> dict:
    """``pipeline.png`` (reward-model held-out accuracy, PPO's reward-model score) and ``summary.json``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = next((k for k in RM_ACCURACY if any(k in r for r in _rows(rm_dir))), RM_ACCURACY[0])
    rm = [(r["step"], r[key]) for r in _rows(rm_dir) if key in r]
    ppo = [(r["step"], r["reward_model/score"]) for r in _rows(ppo_dir) if "reward_model/score" in r]
    first, last = (sum(s for _, s in ppo[:5]) / 5, sum(s for _, s in ppo[-5:]) / 5) if len(ppo) >= 10 else (None, None)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    a.plot([s for s, _ in rm], [v for _, v in rm], marker=".")
    a.set_title("reward model: held-out accuracy")
    a.set_xlabel("RM step")
    a.set_ylim(0, 1.02)
    b.plot([s for s, _ in ppo], [v for _, v in ppo], marker=".")
    b.set_title("PPO: reward-model score of rollouts")
    b.set_xlabel("PPO step")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "pipeline.png", dpi=100)
    plt.close(fig)
    summary = {"rm_heldout_accuracy_first": rm[0][1] if rm else None,
               "rm_heldout_accuracy_final": rm[-1][1] if rm else None,
               "ppo_score_step1": ppo[0][1] if ppo else None, "ppo_score_first5": first, "ppo_score_last5": last,
               "ppo_score_final": ppo[-1][1] if ppo else None, "ppo_steps": len(ppo),
               "seconds": {k: round(v, 1) for k, v in seconds.items()}, "plot": str(out / "pipeline.png")}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    main()
