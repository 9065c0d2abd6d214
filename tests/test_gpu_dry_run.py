"""``bash tests/gpu/run_all.sh --dry``: the device check's wheelhouse is built (or reused) and proven complete for the
device's Python 3.12 offline, and every check script runs without CUDA, saying so check by check, exit 0.

The expected checks are each script's literal ``CHECKS`` tuple and its JSON file ``$OUT/<REPORT>.json`` (read with
ast, not imported); the scripts written elsewhere (the engine fork and memory checks) may be missing, which
run_all.sh reports as such; check_fp8_te.py exits 3 without Transformer Engine, which is a skip. The first run
downloads ~48 MiB from PyPI (tests/gpu/wheels, git-ignored); later runs reuse it.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "tests" / "gpu"
OURS = ("check_fp8_shapes.py", "check_gpu.py", "check_plan_gpu.py", "check_logits.py", "bench_gpu.py")
OTHERS = ("check_engine_fork.py", "check_engine_memory.py")


def literals(script: Path) -> dict:
    """The module-level literal assignments of ``script`` (``REPORT``, ``CHECKS``); a ``CHECKS`` built from other
    literals (``tuple(s[0] for s in SHAPES) + (...)``) is evaluated from them without importing the script."""
    tree = ast.parse(script.read_text())
    found: dict = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            try:
                found[name] = ast.literal_eval(node.value)
            except ValueError:
                if name == "CHECKS":  # an expression over earlier literals only (no calls but tuple)
                    found[name] = eval(compile(ast.Expression(node.value), str(script), "eval"),  # noqa: S307
                                       {"__builtins__": {"tuple": tuple}, **found})
    return found


def wheelhouse_ready() -> bool:
    manifest = GPU / "wheels" / "manifest.json"
    return manifest.exists() and (GPU / "wheels" / "requirements.txt").exists()


def pypi_reachable() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    if not wheelhouse_ready() and not pypi_reachable():
        pytest.skip("PyPI unreachable and no wheelhouse in tests/gpu/wheels: the dry run cannot build it")
    out = tmp_path_factory.mktemp("gpu_dry")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(["bash", str(GPU / "run_all.sh"), "--dry"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    return proc, out


def test_dry_run_exits_0(dry_run):
    proc, _ = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "complete for CPython 3.12" in proc.stdout


@pytest.mark.parametrize("script", OURS)
def test_every_check_says_no_cuda(dry_run, script):
    proc, out = dry_run
    meta = literals(GPU / script)
    assert meta["CHECKS"], script
    for check in meta["CHECKS"]:
        assert f"check {check}: SKIP no CUDA" in proc.stdout.splitlines(), (script, check, proc.stdout[-3000:])
    recorded = json.loads((out / f"{meta['REPORT']}.json").read_text())
    assert set(recorded) == set(meta["CHECKS"])
    assert all(entry["skipped"] == "no CUDA" and entry["pass"] is None for entry in recorded.values())


def test_summary_records_every_script(dry_run):
    proc, out = dry_run
    summary = json.loads((out / "run_all.json").read_text())
    assert summary["wheelhouse_install"]["pass"] is True
    for script in OURS + OTHERS + ("check_fp8_te.py",):
        entry = summary[script[:-3]]
        assert "skipped" in entry, (script, entry)  # no CUDA, no TE, or not written yet: never a failure
    for script in OTHERS:
        if not (GPU / script).exists():
            assert f"check {script[len('check_'):-3]}: SKIP script missing" in proc.stdout
    for module in ("vllm", "transformer_engine"):
        assert "cannot be carried" in summary[module]["skipped"]
    assert "0 FAIL" in proc.stdout


def test_wheelhouse_fits_the_carry_limit(dry_run):
    manifest = json.loads((GPU / "wheels" / "manifest.json").read_text())
    assert manifest["python"] == "3.12"
    assert sum(manifest["wheels"].values()) < 60 << 20  # 64 MiB with the working tree (~2.5 MiB)
    assert not any(name.startswith(("torch-", "vllm-", "transformer_engine")) for name in manifest["wheels"])
