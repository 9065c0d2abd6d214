"""Runs that survive: train N steps ≡ train k, stop, resume, train N−k, with the vLLM rollouts in the
loop, on the same mesh and on another one; SIGTERM mid-run checkpoints and exits 75; multi-node
torchrun (two agents, c10d rendezvous on 127.0.0.1) gives the same steps as one 4-rank launch.

Four trainer launches of the CPU demo (tiny Llama, TP2×PP2 unless said otherwise, N=4 steps):

1. ``ref``: 4 ranks, uninterrupted, a checkpoint every 2 steps (``resume_mode=latest`` on an empty
   directory: a fresh start).
2. ``multinode``: two torchrun agents × 2 ranks; after step 1 is logged, SIGTERM goes to one agent's
   process group only (torchrun, its workers, the engine): every rank must stop after step 2.
3. ``multinode`` resumed by one 4-rank launch (``latest``): steps 3-4.
4. ``other_mesh``: a copy of ``ref`` resumed from its step-2 checkpoint at TP1×PP2×DP2: steps 3-4.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import _free_port, mlora_train

N = 4
EXACT_KEYS = ("reward/mean", "actor/pg_loss", "actor/loss", "critic/value_loss", "kl/mean", "actor/grad_norm",
              "critic/grad_norm", "response_length/mean")
TOL = 1e-5  # another mesh: another order of float sums; the same mesh must agree exactly
COMMON = ["--config-name", "cpu_demo", f"trainer.total_steps={N}", "trainer.eval_interval=0"]


def _cmd(launch: list[str], run_dir: Path, assets: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "mlora.train", *COMMON,
            f"demo.dir={assets}", f"trainer.run_dir={run_dir}", *extra]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _train(run_dir: Path, assets: Path, *extra: str, tp: int = 2) -> subprocess.CompletedProcess:
    proc = mlora_train([*COMMON, f"demo.dir={assets}", f"trainer.run_dir={run_dir}",
                        f"trainer.policy.megatron_config.tensor_model_parallel_size={tp}", *extra], 4)
    if proc.returncode != 0:
        pytest.fail(f"mlora-train failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _logged_step(run_dir: Path, step: int) -> bool:
    try:
        return any(r["step"] == step for r in _rows(run_dir))
    except (OSError, json.JSONDecodeError):
        return False


def _multinode_preempted(run_dir: Path, assets: Path) -> tuple[list[int], list[str]]:
    """Two agents on this machine; once step 1 is logged, SIGTERM to the process group of the agent that
    holds global rank 0 (it exits last: rank 0 releases the engine; the other agent, whose workers exit
    first, reports their exit codes while the rendezvous store is surely up). Returns (exit codes, logs),
    the signalled agent first."""
    port = _free_port()
    launch = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
              "--rdzv-id=mlora-test"]
    logs = [run_dir.parent / f"multinode_agent{i}.log" for i in range(2)]
    cmd = _cmd(launch, run_dir, assets, "trainer.ckpt_interval=0")  # only the preemption saves
    procs = [subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=_env(),
                              start_new_session=True) for log in logs]
    try:
        deadline = time.monotonic() + 900
        rank0 = []
        while not rank0:
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                pytest.fail("multi-node run ended before step 1:\n" + "\n".join(log.read_text()[-4000:] for log in logs))
            time.sleep(0.1)
            if _logged_step(run_dir, 1):  # rank 0 logs its console line right after the metrics line
                rank0 = [i for i, log in enumerate(logs) if "step   1  reward" in log.read_text()]
        order = [rank0[0], 1 - rank0[0]]
        os.killpg(procs[order[0]].pid, signal.SIGTERM)  # step 2 is running; the other "node" is not signalled
        codes = [procs[i].wait(timeout=300) for i in order]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return codes, [logs[i].read_text() for i in order]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    assets = tmp / "assets"
    out: dict = {"tmp": tmp, "assets": assets, "seconds": {}}
    t0 = time.perf_counter()
    out["ref_log"] = _train(tmp / "ref", assets, "trainer.ckpt_interval=2", "trainer.resume_mode=latest")
    out["seconds"]["ref"] = time.perf_counter() - t0
    shutil.copytree(tmp / "ref", tmp / "other_mesh")  # before anything reads it

    t0 = time.perf_counter()
    out["multinode_codes"], out["multinode_logs"] = _multinode_preempted(tmp / "multinode", assets)
    out["multinode_rows"] = _rows(tmp / "multinode")
    out["marker"] = json.loads((tmp / "multinode" / "preempted.json").read_text())
    out["seconds"]["multinode"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    out["resumed_log"] = _train(tmp / "multinode", assets, "trainer.ckpt_interval=2", "trainer.resume_mode=latest")
    out["seconds"]["resumed"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    out["other_log"] = _train(tmp / "other_mesh", assets, "trainer.ckpt_interval=2", "trainer.resume_mode=from_path",
                              f"trainer.resume_path={tmp / 'other_mesh' / 'checkpoints' / 'global_step_2'}", tp=1)
    out["seconds"]["other_mesh"] = time.perf_counter() - t0
    print("launch seconds:", {k: round(v) for k, v in out["seconds"].items()})
    return out


def _compare(a: list[dict], b: list[dict], tol: float) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        for k in EXACT_KEYS:
            assert abs(x[k] - y[k]) <= tol, (x["step"], k, x[k], y[k])


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _compare_files(a: Path, b: Path, tol: float) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        diff = float((ta[k].double() - tb[k].double()).abs().max())
        assert diff <= tol, (a, k, diff)


TRAINED = ("final_adapter/adapter_model.safetensors",
           f"checkpoints/global_step_{N}/adapters/policy/adapter_model.safetensors",
           f"checkpoints/global_step_{N}/adapters/critic/adapter_model.safetensors",
           f"checkpoints/global_step_{N}/heads/critic.safetensors")


def test_fresh_start_under_latest(runs):
    out = runs["ref_log"].stdout + runs["ref_log"].stderr
    assert "trainer.resume_mode=latest: no complete checkpoint in" in out and "starting from step 0" in out
    ckpts = runs["tmp"] / "ref" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["global_step_2", "global_step_4", "latest_ckpt_global_step.txt"]
    assert (ckpts / "latest_ckpt_global_step.txt").read_text().strip() == str(N)


def test_multinode_matches_single_node_and_preempts(runs):
    """Two torchrun agents give bit-identical first steps; a SIGTERM that reached one agent's process group
    stops every rank after step 2 (the other agent's ranks learn it from the per-step all-reduce), with a
    complete checkpoint, the marker, and exit code 75 on the workers whose codes torchrun reports."""
    tmp, ref = runs["tmp"], _rows(runs["tmp"] / "ref")
    rows = runs["multinode_rows"]
    assert [r["step"] for r in rows] == [1, 2], rows
    _compare(ref[:2], rows, 0.0)  # an identical run (another launch, two "nodes") is bit-reproducible
    ckpt = tmp / "multinode" / "checkpoints" / "global_step_2"
    assert runs["marker"]["step"] == 2 and runs["marker"]["checkpoint"] == str(ckpt.resolve())
    assert runs["marker"]["signal"] == "SIGTERM" and runs["marker"]["exit_code"] == 75
    from mlora.checkpoint.dirs import check_complete

    assert check_complete(ckpt)["step"] == 2  # interval 0: only the preemption saved
    signalled, other = runs["multinode_logs"]
    # torchrun turns what its workers did into its own exit code 1: SignalException on the signalled agent,
    # ChildFailedError on the other, which lists its workers' own exit codes
    assert runs["multinode_codes"] == [1, 1], runs["multinode_codes"]
    assert "SIGTERM received: finishing the step" in signalled
    assert other.count("exitcode  : 75") == 2, other[-3000:]
    assert "exiting with 75" in signalled + other


def test_resume_same_mesh_continues_exactly(runs):
    tmp = runs["tmp"]
    out = runs["resumed_log"].stdout + runs["resumed_log"].stderr
    assert "continuing with step 3 of 4" in out
    _compare(_rows(tmp / "ref"), _rows(tmp / "multinode"), 0.0)  # metrics.jsonl: steps 1-2, then 3-4 appended
    for rel in TRAINED:
        _compare_files(tmp / "ref" / rel, tmp / "multinode" / rel, 0.0)
    assert not (tmp / "multinode" / "preempted.json").exists()  # completed: nothing to requeue
    assert (tmp / "multinode" / "metrics.png").stat().st_size > 0


def test_resume_on_another_mesh(runs):
    """TP2×PP2 → TP1×PP2×DP2 from the reference's step-2 checkpoint: the lines it had logged for steps 3-4
    are dropped, then steps 3-4 come again within 1e-5 of the uninterrupted run."""
    tmp = runs["tmp"]
    out = runs["other_log"].stdout + runs["other_log"].stderr
    assert "saved at TP2×PP2×DP1, now TP1×PP2×DP2" in out
    assert "dropped 2 line(s) of metrics.jsonl logged after that checkpoint" in out
    _compare(_rows(tmp / "ref"), _rows(tmp / "other_mesh"), TOL)
    for rel in TRAINED:
        _compare_files(tmp / "ref" / rel, tmp / "other_mesh" / rel, TOL)


def test_damaged_checkpoints_and_other_base(runs, tmp_path, caplog):
    """On the real checkpoints: a truncated or deleted file is a clear error and latest falls back; a
    checkpoint is refused on another base model."""
    import logging

    from mlora.checkpoint.dirs import CheckpointError, check_base_model, check_complete, resolve_resume
    from mlora.testing import build_tiny_model

    root = tmp_path / "checkpoints"
    shutil.copytree(runs["tmp"] / "ref" / "checkpoints", root)
    optim = root / f"global_step_{N}" / "optim" / "pp1-tp1.safetensors"
    optim.write_bytes(optim.read_bytes()[:-16])
    with pytest.raises(CheckpointError, match=r"optim/pp1-tp1.safetensors has \d+ bytes, \d+ were written"):
        resolve_resume("from_path", root, str(root / f"global_step_{N}"))
    with caplog.at_level(logging.WARNING, logger="mlora"):
        assert resolve_resume("latest", root, None) == root / "global_step_2"
    assert f"not resuming from {root / f'global_step_{N}'}" in caplog.text
    (root / "global_step_2" / "adapters" / "policy" / "adapter_model.safetensors").unlink()
    assert resolve_resume("latest", root, None) is None
    manifest = check_complete(runs["tmp"] / "ref" / "checkpoints" / "global_step_2")
    check_base_model(manifest, runs["assets"] / "tiny-llama", root)
    other = build_tiny_model("llama", tmp_path / "other_llama")
    with pytest.raises(CheckpointError, match="was trained on the base model"):
        check_base_model(manifest, other, root)


def _handles(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux: the SigCgt mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def test_signal_during_start_up(tmp_path):
    """SIGUSR1 while the trainer loads (no step yet): it does not wait for a step, exits 75 at once and
    leaves the marker with no checkpoint (a requeued job resumes from whatever it had)."""
    cmd = [sys.executable, "-m", "mlora.train", "--config-name", "cpu_demo", "trainer.total_steps=1",
           "trainer.policy.megatron_config.tensor_model_parallel_size=1",
           "trainer.policy.megatron_config.pipeline_model_parallel_size=1", f"demo.dir={tmp_path / 'assets'}",
           f"trainer.run_dir={tmp_path / 'run'}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    deadline = time.monotonic() + 300
    while not _handles(proc.pid, signal.SIGUSR1):  # the trainer entry installed its handlers
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-4000:]
    assert "SIGUSR1 received during start-up: exiting 75" in err
    marker = json.loads((tmp_path / "run" / "preempted.json").read_text())
    assert marker["step"] is None and marker["checkpoint"] is None and marker["signal"] == "SIGUSR1"
