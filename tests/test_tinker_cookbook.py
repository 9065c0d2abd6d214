"""The real tinker-cookbook 0.6.1, unchanged, against ``python -m mlora.service`` serving SmolLM2-135M-Instruct (the
local directory as ``model_name``; the cookbook's ChatML renderer ``qwen3_instruct``, SmolLM2's chat format).

- ``python -m tinker_cookbook.recipes.math_rl.train env=arithmetic loss_fn=importance_sampling``: every step samples
  groups through the server's vLLM engine (the client's sampler weights a LoRA adapter of it, ``lm_head`` included:
  the cookbook trains the unembedding) and trains on them; the reward rises (the answers' format first: a bare
  number closed by ``<|im_end|>`` within ``max_tokens``).
- ``tinker_cookbook.supervised.train.main`` on the cookbook's bundled ``example_data/conversations.jsonl``: the
  training NLL falls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tinker_server import Server

pytest.importorskip("tinker_cookbook")

RL_STEPS = 6
SL_STEPS = 3


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cookbook_server")
    s = Server(smollm2, tmp / "data", tmp / "server.log", ["--kv-cache-bytes", str(256 << 20), "--max-model-len", "1024",
                                                          "--max-lora-rank", "32"], threads=2)
    yield s
    s.stop()


def _run(argv: list[str], server: Server, log: Path) -> None:
    env = {**os.environ, "TINKER_API_KEY": "tml-mlora-cookbook", "TINKER_BASE_URL": server.url}
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT, env=env,
                              timeout=900).returncode
    assert code == 0, f"{argv[:2]} exited {code}:\n{log.read_text()[-4000:]}\nserver:\n{server.log.read_text()[-3000:]}"


def _metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_math_rl_arithmetic_reward_rises(server, smollm2, tmp_path):
    log_path = tmp_path / "math_rl"
    _run(["-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={smollm2}",
          "renderer_name=qwen3_instruct", "loss_fn=importance_sampling", "group_size=4", "groups_per_batch=8",
          "learning_rate=3e-4", "max_tokens=8", "lora_rank=16", f"max_steps={RL_STEPS}", f"log_path={log_path}",
          "behavior_if_log_dir_exists=delete", "eval_every=0", "save_every=0", f"base_url={server.url}"],
         server, tmp_path / "math_rl.log")
    steps = [m for m in _metrics(log_path) if "env/all/reward/total" in m]
    assert len(steps) == RL_STEPS
    reward = [m["env/all/reward/total"] for m in steps]
    fmt = [m["env/all/format"] for m in steps]
    print(f"\ncookbook math_rl on mlora: reward {[round(r, 3) for r in reward]}, format {[round(f, 2) for f in fmt]}")
    late = slice(RL_STEPS // 2, None)
    assert sum(reward[late]) / len(reward[late]) > reward[0] and sum(fmt[late]) / len(fmt[late]) >= fmt[0] + 0.15
    # each step's sampler weights were a new LoRA adapter of the engine, the output layer's included
    assert server.log.read_text().count("requests running (") >= RL_STEPS - 1


def test_supervised_train_on_the_bundled_conversations_nll_falls(server, smollm2, tmp_path):
    log_path = tmp_path / "sl"
    _run([str(Path(__file__).parent / "cookbook_supervised.py"), str(smollm2), server.url, str(log_path),
          str(SL_STEPS)], server, tmp_path / "sl.log")
    nll = [m["train_mean_nll"] for m in _metrics(log_path) if "train_mean_nll" in m]
    print(f"\ncookbook supervised.train on mlora: NLL {[round(x, 3) for x in nll]}")
    assert len(nll) == SL_STEPS and sum(nll[1:]) / (SL_STEPS - 1) < 0.8 * nll[0]
