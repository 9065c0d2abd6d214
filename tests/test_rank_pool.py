"""The session's rank pool (mlora.testing.rank_pool): a failing case fails alone, with its own traceback,
and ends with its processes; the cases after it run in fresh processes that inherit nothing of it; a hung
case is ended at its timeout; the ranks see torchrun's environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import TESTS, _free_port, _pool

CASES = TESTS / "dist" / "pool_cases.py"
pytestmark = pytest.mark.quick


def _fresh(tmp_path, nproc: int = 4) -> list[dict]:
    result = _pool().run(nproc, CASES, ["fresh", tmp_path], timeout=120)
    assert result.ok, result.failure_report()
    return json.loads((tmp_path / "fresh.json").read_text())


def test_a_failing_case_fails_alone_with_its_traceback(tmp_path):
    pool = _pool()
    before = _fresh(tmp_path)
    t = time.monotonic()
    failed = pool.run(4, CASES, ["poison", tmp_path], timeout=120)
    assert time.monotonic() - t < 60  # ended at the failure, not at the group's timeout
    assert not failed.ok and not failed.timed_out and failed.first_failed == 1
    assert failed.returncodes[1] == 1  # the traceback's exit code; the others were ended by the pool
    assert all(code in (-15, -9) for r, code in enumerate(failed.returncodes) if r != 1), failed.returncodes
    report = failed.failure_report()
    assert report.index("--- rank 1") < report.index("Traceback") < report.index("deliberate failure in rank 1")
    assert "ValueError: deliberate failure in rank 1" in failed.logs[1][1].read_text()
    after = _fresh(tmp_path)  # the next case on the same pool: fresh processes, nothing inherited
    assert [r["sum"] for r in after] == [10.0] * 4  # a working all_reduce (the failed case had replaced it)
    for r in after:
        assert r["poison"] is None and r["seed"] == 67280421310721 and r["dtype"] == "torch.float32", r
        assert r["cwd"] == os.getcwd() and r["grace"] == 5.0 and r["world"] == 4, r
    assert not {r["pid"] for r in before} & {r["pid"] for r in after}


def test_a_case_whose_port_was_taken_runs_again_on_another(tmp_path, monkeypatch):
    """The free port picked for a case's store can be taken before rank 0 binds it (seen in CI: EADDRINUSE, with
    tests of the other xdist worker running); the case then runs again on a new port."""
    import socket

    import mlora.testing.rank_pool as rank_pool

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    monkeypatch.setattr(rank_pool, "_free_port", lambda: next(ports, None) or _free_port())
    try:
        result = _pool().run(2, CASES, ["fresh", tmp_path], timeout=120)
    finally:
        taken.close()
    assert result.ok, result.failure_report()
    assert [r["sum"] for r in json.loads((tmp_path / "fresh.json").read_text())] == [3.0, 3.0]


def test_a_hung_case_ends_at_its_timeout_and_the_next_passes(tmp_path):
    t = time.monotonic()
    hung = _pool().run(2, CASES, ["hang", tmp_path], timeout=3)
    assert hung.timed_out and not hung.ok and time.monotonic() - t < 30
    assert "timed out after" in hung.failure_report()
    assert [r["sum"] for r in _fresh(tmp_path, 2)] == [3.0, 3.0]


def test_what_a_failed_case_started_is_ended(tmp_path):
    failed = _pool().run(2, CASES, ["orphan", tmp_path], timeout=120)
    assert not failed.ok and "rank 0 fails with a child running" in failed.failure_report()
    for rank in range(2):
        pid = int((tmp_path / f"orphan{rank}.pid").read_text())
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and "Z" not in _state(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{pid}") or "Z" in _state(pid), f"sleep {pid} of rank {rank} survived"


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_ranks_see_torchruns_environment(tmp_path):
    """The same variables, by rank, as a real torchrun launch (the port and run id differ by design, and
    with no agent to host the rendezvous store, rank 0 hosts it: TORCHELASTIC_USE_AGENT_STORE False)."""
    pooled, real = tmp_path / "pool", tmp_path / "torchrun"
    pooled.mkdir()
    real.mkdir()
    assert _pool().run(2, CASES, ["env", pooled], timeout=120).ok
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={_free_port()}", str(CASES), "env", str(real)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        seen = json.loads((pooled / f"env{rank}.json").read_text())
        want = json.loads((real / f"env{rank}.json").read_text())
        assert (seen.pop("TORCHELASTIC_USE_AGENT_STORE"), want.pop("TORCHELASTIC_USE_AGENT_STORE")) == ("False", "True")
        assert seen == want


def test_bad_nproc_is_refused():
    with pytest.raises(ValueError, match=r"nproc=0 must be a positive integer"):
        _pool().run(0, CASES, [])
