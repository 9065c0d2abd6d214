"""The docs site built once per test run: ``mkdocs build --strict`` into ``site/`` (git-ignored), shared by
``test_docs_site.py`` and ``test_docs_browser.py`` whether they run in one process or on two pytest-xdist workers
(a file lock, and the run's id in ``site/.mlora_build.json``)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "site"
MARK = ".mlora_build.json"
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}-{time.time()}"


@dataclass(frozen=True)
class Build:
    site: Path
    returncode: int
    seconds: float
    log: str


def load(relpath: str):
    """``bench/records.py`` or ``docs/cli_reference.py`` as the site's build loads them (``docs/hooks.py``), without
    putting their folders on ``sys.path`` (``bench/tinker.py`` would shadow the tinker SDK for the whole worker)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_mlora_docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = sys.modules.get("_mlora_docs_hooks")
    if hooks is None:
        hooks = importlib.util.module_from_spec(spec)
        sys.modules["_mlora_docs_hooks"] = hooks
        spec.loader.exec_module(hooks)
    return hooks.load(relpath)


def built_site() -> Build:
    """The site of this test run, built on the first call (by whichever worker gets there first)."""
    lock = Path(tempfile.gettempdir()) / f"mlora-docs-{hashlib.sha1(str(ROOT).encode()).hexdigest()[:12]}.lock"
    with lock.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            mark = json.loads((SITE / MARK).read_text())
        except (OSError, ValueError):
            mark = {}
        if mark.get("run") != _RUN:
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                                   "-d", str(SITE)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
            mark = {"run": _RUN, "returncode": proc.returncode, "seconds": round(time.perf_counter() - t0, 1),
                    "log": (proc.stdout + proc.stderr)[-20000:]}
            SITE.mkdir(exist_ok=True)
            (SITE / MARK).write_text(json.dumps(mark))
    return Build(SITE, mark["returncode"], mark["seconds"], mark["log"])
