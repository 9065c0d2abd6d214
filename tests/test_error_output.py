"""A failing run prints one report, not one per rank (mlora.train.failure, mlora.train.launch).

Launched as a user would at 2 ranks (``mlora-train --nproc_per_node 2``; the per-rank blocks collapse the same at
any count): a bad key, a bad value (config
errors: exit 2, before any model loads) and a missing model (a failure while running: exit 1, the full
traceback in ``<run_dir>/errors/rank<r>.log``). Each message appears once and the whole output stays
under 30 lines (Hydra's override dump and torchrun's per-rank blocks used to make ~200).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MLORA_TRAIN = str(Path(sys.executable).with_name("mlora-train"))


def _launch(tmp_path: Path, *overrides: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([MLORA_TRAIN, "--nproc_per_node", "2", "--config-name", "cpu_demo",
                           f"trainer.run_dir={tmp_path / 'run'}", f"demo.dir={tmp_path / 'assets'}", *overrides],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("override,message", [
    ("trainer.placement.tp=2", "Could not override 'trainer.placement.tp'"),  # a key the schema lacks
    ("trainer.algorithm.advantage_estimator=ppo2",  # a value mlora cannot run with
     "trainer.algorithm.advantage_estimator='ppo2' is not valid; valid: gae, grpo, rloo"),
])
def test_config_error_reported_once(tmp_path, override, message):
    code, out = _launch(tmp_path, override)
    assert code == 2, out
    assert out.count(message) == 1, out
    assert "config error on rank" in out and "1 other rank(s) stopped with it" in out, out
    assert len(out.splitlines()) < 30, out
    assert "Error executing job with overrides" not in out and "ChildFailedError" not in out, out
    assert not (tmp_path / "assets").exists()  # stopped before the demo's model was built


def test_runtime_failure_reported_once_with_its_traceback(tmp_path):
    code, out = _launch(tmp_path, "demo.prepare=false", f"trainer.policy.model.path={tmp_path / 'no_model'}",
                        "trainer.policy.megatron_config.pipeline_model_parallel_size=1")  # TP2 on the 2 ranks
    assert code == 1, out
    first = [line for line in out.splitlines() if line.startswith("mlora-train failed: ")]
    assert len(first) == 1 and "no_model" in first[0], out
    assert len(out.splitlines()) < 30, out
    logs = sorted((tmp_path / "run" / "errors").glob("rank*.log"))
    assert logs and f"full traceback: {tmp_path / 'run' / 'errors'}" in out, out
    assert "Traceback (most recent call last)" in logs[0].read_text()


def test_argument_splitting():
    from mlora.train.__main__ import plain_argv
    from mlora.train.launch import split_argv, wants_launcher

    assert split_argv(["--nproc_per_node", "4", "--config-name", "cpu_demo", "--nnodes=1", "a=1"]) == (
        ["--nproc_per_node", "4", "--nnodes=1"], ["--config-name", "cpu_demo", "a=1"])
    assert split_argv(["--standalone", "--nproc-per-node=2", "-cn", "sft"]) == (
        ["--standalone", "--nproc-per-node=2"], ["-cn", "sft"])
    assert wants_launcher(["--nproc_per_node", "2"]) == ("LOCAL_RANK" not in os.environ)
    assert plain_argv(["--config-name", "dpo", "a=1", "+b=2", "~c"]) == ("dpo", ["a=1", "+b=2", "~c"])
    assert plain_argv(["-cn=sft"]) == ("sft", [])
    for hydra_own in (["--help"], ["--cfg", "job"], ["hydra.run.dir=out"], ["--config-path", "x"]):
        assert plain_argv(hydra_own) is None  # left to hydra.main
