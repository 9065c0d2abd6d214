"""tools/: every script answers --help; merge/export-adapter/plan are `mlora`'s own subcommands
(one implementation, two doors: same files, same output, same exit codes)."""

from __future__ import annotations

import io
import os
import runpy
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ["import_adapter", "merge", "export_adapter", "plan"]  # convert_checkpoint.py has its own tests
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "COLUMNS": "100"}


def _tool(name: str, *args) -> tuple[int, str, str]:
    """Run ``tools/<name>.py`` as ``__main__`` in this process: (exit status, stdout, stderr)."""
    return _capture(lambda: runpy.run_path(str(ROOT / "tools" / f"{name}.py"), run_name="__main__"),
                    [f"tools/{name}.py", *map(str, args)])


def _mlora(*args) -> tuple[int, str, str]:
    """``mlora ARGS`` (the console script's entry point) in this process."""
    from mlora.cli import main

    return _capture(lambda: main(list(map(str, args))), ["mlora", *map(str, args)])


def _capture(fn, argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, redirect_stdout(out), redirect_stderr(err):
        mp.setattr(sys, "argv", argv)
        mp.setenv("COLUMNS", "100")  # argparse wraps help text to the terminal width
        try:
            code = fn()
            code = code if isinstance(code, int) else 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return code, out.getvalue(), err.getvalue()


def test_every_tool_has_help_and_the_readme_lists_it():
    readme = (ROOT / "tools" / "README.md").read_text()
    scripts = sorted(p.stem for p in (ROOT / "tools").glob("*.py"))
    assert set(TOOLS) <= set(scripts)
    for name in scripts:
        assert f"tools/{name}.py" in readme, f"tools/README.md does not list tools/{name}.py"
    helps = {}
    for name in TOOLS:
        code, out, err = _tool(name, "--help")
        assert code == 0, (name, err[-2000:])
        assert out.startswith("usage:"), (name, out[:200])
        helps[name] = out
    assert "--base" in helps["merge"] and "--adapter" in helps["merge"]  # merge's own flags
    assert "--model" in helps["plan"] and "--memory" in helps["plan"]  # plan's own flags
    assert helps["merge"] == _mlora("merge", "--help")[1]
    # a real interpreter, started in another directory: the scripts do not depend on the working directory
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "export_adapter.py"), "--help"], cwd="/",
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0 and proc.stdout == _mlora("export-adapter", "--help")[1], proc.stderr[-2000:]


def test_merge_through_tools_equals_mlora_merge(tiny_models, tmp_path):
    from peft_refs import random_peft_adapter

    base = tiny_models / "llama"
    adapter = random_peft_adapter(base, tmp_path / "adapter", r=4, alpha=8, seed=7)
    a, b = tmp_path / "via_tools", tmp_path / "via_mlora"
    ra = _tool("merge", "--base", base, "--adapter", adapter, "--out", a, "--quiet")
    rb = _mlora("merge", "--base", base, "--adapter", adapter, "--out", b, "--quiet")
    assert ra[0] == rb[0] == 0, (ra[2][-2000:], rb[2][-2000:])
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir()) and any(f.endswith(".safetensors") for f in files)
    for name in files:
        if name == "mlora_merge.json":  # records the output path
            continue
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    bad_a = _tool("merge", "--base", base, "--adapter", tmp_path / "missing", "--out", tmp_path / "x")
    bad_b = _mlora("merge", "--base", base, "--adapter", tmp_path / "missing", "--out", tmp_path / "y")
    assert bad_a[0] == bad_b[0] == 2
    assert bad_a[2] == bad_b[2] and "does not exist" in bad_a[2]


@pytest.mark.parametrize("args", [["--tp", "2", "--rank", "8"], ["--tp", "3"]])
def test_plan_through_tools_equals_mlora_plan(tiny_models, args):
    args = ["--model", tiny_models / "llama", *args]
    assert _tool("plan", *args) == _mlora("plan", *args)
