"""slurm/train.sbatch on a real Slurm: a two-node cluster on this machine (one slurmctld, slurmd
``n1`` and ``n2`` on 127.0.0.1 with ports of their own, a private munged), started by the module
fixture from Debian's ``slurmctld``/``slurmd``/``slurm-client``/``munge`` packages (installed with
apt-get when missing) and stopped by pid afterwards.

Jobs run the CPU demo (TP2xPP2, 2 ranks per node across both nodes): 3 steps to completion; a job
preempted with ``scancel --signal=USR1 --batch`` is requeued and finishes from its checkpoint; with
``MLORA_ENGINE_NODES=1`` the engine runs as a Ray actor on the other node; and the script's errors.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import _free_port
from doc_commands import SLURM_CPU_DEMO, sbatch_parts

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "slurm" / "train.sbatch"
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch")
IS_ROOT = os.geteuid() == 0
# The short run every job here makes: no evaluation, the rest of cpu_demo as it is.
SHORT = ("trainer.eval_before_train=false", "trainer.eval_interval=0")

needs_cluster = pytest.mark.skipif(not IS_ROOT and shutil.which("apt-get") is None,
                                   reason="a Slurm cluster needs root (slurmd, apt-get install) and apt-get")


def _which(tool: str) -> str | None:
    return shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def _install() -> None:
    """apt-get install the Slurm and munge packages unless their programs are there already."""
    if all(_which(t) for t in DAEMONS):
        return
    if not IS_ROOT:
        pytest.fail(f"Slurm is not installed ({', '.join(t for t in DAEMONS if not _which(t))} missing) and "
                    f"installing it needs root: apt-get install {' '.join(PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    # The packages' maintainer scripts would start the system's munge/slurm services with their
    # default configuration; a policy-rc.d that says "no" (as in Docker images) keeps them stopped.
    policy = Path("/usr/sbin/policy-rc.d")
    ours = not policy.exists()
    if ours:
        policy.write_text("#!/bin/sh\n# mlora tests/test_slurm.py: no service starts while installing\nexit 101\n")
        policy.chmod(0o755)
    try:
        proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:  # a fresh machine has no package lists yet
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=900)
            proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    finally:
        if ours:
            policy.unlink()
    if proc.returncode != 0 or not all(_which(t) for t in DAEMONS):
        pytest.fail(f"could not install Slurm ({' '.join(install)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


class Cluster:
    """slurmctld + slurmd n1, n2 + munged, all in ``root``; ``env`` is what a Slurm client needs."""

    def __init__(self, root: Path) -> None:
        self.root, self.procs, self.conf = root, [], root / "slurm.conf"
        # what a Slurm client and the jobs get: this cluster, this Python's environment first on PATH,
        # none of the caller's Slurm or mlora variables
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "MLORA_"))}
        self.env.update(SLURM_CONF=str(self.conf), OMP_NUM_THREADS="1",
                        PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
        for d in ("state", "spool", "munge", "log"):
            (root / d).mkdir(mode=0o700)
        key, sock = root / "munge" / "munge.key", root / "munge" / "socket"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._start("munged", [_which("munged"), "--foreground", "--force", f"--key-file={key}", f"--socket={sock}",
                               f"--pid-file={root / 'munge' / 'pid'}", f"--seed-file={root / 'munge' / 'seed'}",
                               f"--log-file={root / 'log' / 'munged.log'}"])
        ports = [_free_port() for _ in range(3)]
        nodes = "\n".join(f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname=localhost CPUs=2 Port={p}"
                          for n, p in zip(("n1", "n2"), ports[1:]))
        self.conf.write_text(f"""\
ClusterName=mloratest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ports[0]}
# munged of this cluster; cred_expire is also how long a requeued job waits (default 120 s)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock},cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
# containers: no cgroups; processes are tracked through their parents
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# both nodes advertise 2 CPUs on a host that may have 2 in all: trust slurm.conf, not the hardware
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
MinJobAge=3600
KillWait=10
{nodes}
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
""")
        self._start("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for node in ("n1", "n2"):
            self._start(f"slurmd {node}", [_which("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
        deadline = time.time() + 90
        while time.time() < deadline:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
            if sorted(out.split()) == sorted(["n1", "idle", "n2", "idle"]):
                return
            time.sleep(1)
        self.stop()
        pytest.fail(f"the Slurm nodes did not come up: sinfo says {out!r}\n{self.logs()}")

    def _start(self, name: str, cmd: list) -> None:
        log = open(self.root / "log" / f"{name.replace(' ', '.')}.out", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        time.sleep(0.5)
        if proc.poll() is not None:
            self.stop()
            pytest.fail(f"{name} exited at start ({proc.returncode}):\n{self.logs()}")
        self.procs.append((name, proc))

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-2000:]}" for f in sorted((self.root / "log").iterdir()))

    def run(self, *cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(cmd), env=kw.pop("env", self.env), capture_output=True, text=True, timeout=60, **kw)
        if check and proc.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        return proc

    def sbatch(self, workdir: Path, *args: str, env: dict | None = None, nodes: int = 2) -> int:
        """Submit slurm/train.sbatch from ``workdir`` with mlora-train arguments ``args``."""
        out = self.run("sbatch", "--parsable", f"--nodes={nodes}", f"--chdir={workdir}", str(SCRIPT), *args,
                       env={**self.env, **(env or {})}).stdout
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        out = self.run("scontrol", "-o", "show", "job", str(job_id)).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait(self, job_id: int, timeout: float,
             until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.job(job_id)
            if info["JobState"] in until:
                return info
            time.sleep(2)
        self.run("scancel", str(job_id), check=False)
        pytest.fail(f"job {job_id} still {info['JobState']} after {timeout:.0f} s\n{self.output(job_id)}")

    def output(self, job_id: int) -> str:
        path = Path(self.job(job_id)["StdOut"])
        return path.read_text() if path.exists() else f"(no {path})"

    def stop(self) -> None:
        """Cancel what still runs, then stop slurmd, slurmctld and munged by pid."""
        if any(name == "slurmctld" for name, _ in self.procs):
            jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if jobs:
                self.run("scancel", *jobs, check=False)
                deadline = time.time() + 60
                while time.time() < deadline and self.run("squeue", "-h", "-o", "%i", check=False).stdout.split():
                    time.sleep(1)
        for _, proc in reversed(self.procs):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not IS_ROOT:
        pytest.fail("the Slurm tests run slurmd, which needs root: run them as root")
    _install()
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    yield c
    c.stop()


def _steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if r["step"] > 0]


def test_outside_slurm_is_a_clear_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(SCRIPT), "--config-name", "cpu_demo"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "not inside a Slurm job" in proc.stderr and "sbatch" in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


@needs_cluster
def test_cpu_nodes_need_a_process_count(cluster, tmp_path):
    job = cluster.sbatch(tmp_path, "--config-name", "cpu_demo")  # no GPUs, no MLORA_NPROC_PER_NODE
    info = cluster.wait(job, 120)
    assert info["JobState"] == "FAILED", info
    assert "MLORA_NPROC_PER_NODE is unset" in cluster.output(job)


@needs_cluster
def test_two_nodes_cpu_demo(cluster, tmp_path):
    """TP2xPP2 over two nodes (2 ranks each, one torchrun per node, c10d rendezvous on n1)."""
    t0 = time.time()
    env, nodes, _, args = sbatch_parts(SLURM_CPU_DEMO)  # as docs/getting-started.md shows it (tests/doc_commands.py)
    job = cluster.sbatch(tmp_path, *args, "trainer.total_steps=3", *SHORT, env=env, nodes=nodes)
    info = cluster.wait(job, 900)
    out = cluster.output(job)
    assert info["JobState"] == "COMPLETED", out
    assert "trainer on 2 node(s) n1 n2 x 2 rank(s)" in out, out
    assert _steps(tmp_path / "runs" / "mlora" / "cpu_demo") == [1, 2, 3]
    print(f"two-node cpu_demo, 3 steps: {time.time() - t0:.0f} s")


@needs_cluster
def test_preempted_job_is_requeued_and_resumes(cluster, tmp_path):
    """USR1 to the batch shell mid-run: the trainer saves at the end of its step and exits, the script
    requeues the job, and the requeued job resumes from that checkpoint and finishes."""
    steps, t0 = 4, time.time()
    run_dir = tmp_path / "runs" / "mlora" / "cpu_demo"
    job = cluster.sbatch(tmp_path, "--config-name", "cpu_demo", f"trainer.total_steps={steps}", *SHORT,
                         env={"MLORA_NPROC_PER_NODE": "2"})
    deadline = time.time() + 600
    while not ((run_dir / "metrics.jsonl").exists() and _steps(run_dir)):
        assert time.time() < deadline and cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), cluster.output(job)
        time.sleep(1)
    cluster.run("scancel", "--signal=USR1", "--batch", str(job))
    info = cluster.wait(job, 900)
    out = cluster.output(job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out
    # the trainer's <run_dir>/preempted.json, as the script logged it (a completed run removes the file)
    marker = re.search(rf"preempted: (.*); requeueing job {job}", out)
    assert marker, out
    preempted = json.loads(marker.group(1))
    k = preempted["step"]
    assert 1 <= k < steps and preempted["checkpoint"].endswith(f"global_step_{k}"), preempted
    assert "(restart 1)" in out
    assert _steps(run_dir) == list(range(1, steps + 1)), "every step once, appended across the restart"
    print(f"preempted after step {k}, requeued and resumed: {time.time() - t0:.0f} s")


@needs_cluster
def test_engines_on_a_ray_node(cluster, tmp_path):
    """MLORA_ENGINE_NODES=1: a Ray head on n2 holds the vLLM engine, the trainer (1 rank, TP1) on n1 drives it."""
    pytest.importorskip("ray")
    t0 = time.time()
    port = _free_port()
    job = cluster.sbatch(tmp_path, "--config-name", "cpu_demo", "trainer.total_steps=2", *SHORT,
                         "trainer.policy.megatron_config.tensor_model_parallel_size=1",
                         "trainer.policy.megatron_config.pipeline_model_parallel_size=1",
                         env={"MLORA_NPROC_PER_NODE": "1", "MLORA_ENGINE_NODES": "1", "MLORA_RAY_PORT": str(port),
                              "MLORA_RAY_START_ARGS": f"--ray-client-server-port={_free_port()}"})
    info = cluster.wait(job, 900)
    out = cluster.output(job)
    assert info["JobState"] == "COMPLETED", out
    assert f"Ray head on n2 (127.0.0.1:{port})" in out and "trainer on 1 node(s) n1 x 1 rank(s)" in out, out
    assert "generator.inference_engine.run_engines_locally=false" in out
    # rank 0 drove the job's cluster (not a Ray of its own); n1's raylet offers no CPU, so the
    # engine's placement group (one CPU bundle) and actor can only be on n2
    assert "Connecting to existing Ray cluster" in out and "Connected to Ray cluster" in out, out
    assert _steps(tmp_path / "runs" / "mlora" / "cpu_demo") == [1, 2]
    print(f"trainer node + Ray engine node, 2 steps: {time.time() - t0:.0f} s")
