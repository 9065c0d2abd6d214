"""One line per GPU check and a JSON file of their figures, shared by the scripts that ``run_all.sh`` runs.

Each check records its figure, whether it met its goal (None: a measurement with no goal) and a note; a
check that cannot run here says why (``skip``: "no CUDA" on a CPU machine, "Transformer Engine cannot be
imported here", ...) instead of pretending. Lines look like ``check <name>: <figure> [PASS|FAIL|SKIP] note``
so that ``grep '^check '`` over a device run's output is its summary.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class Report:
    """The checks of one script, written to ``$OUT/<name>.json`` after every record (a script killed by its
    time limit keeps what it measured)."""

    def __init__(self, name: str, out_dir: str | os.PathLike | None = None) -> None:
        self.path = Path(out_dir or os.environ.get("OUT") or "gpu_out") / f"{name}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.checks: dict[str, dict[str, Any]] = {}

    def record(self, check: str, figure: Any, passed: bool | None = None, note: str = "") -> None:
        """A measured check: ``figure`` (a number, or a dict of numbers), its verdict against its goal."""
        verdict = "" if passed is None else ("PASS" if passed else "FAIL")
        self._add(check, {"figure": figure, "pass": passed, "note": note},
                  f"{_text(figure)} {verdict} {note}".strip())

    def skip(self, check: str, why: str) -> None:
        """A check that cannot run here, and why."""
        self._add(check, {"figure": None, "pass": None, "skipped": why}, f"SKIP {why}")

    def error(self, check: str, exc: BaseException) -> None:
        """A check that raised: recorded as failed, with the exception, so that the next check still runs."""
        self._add(check, {"figure": None, "pass": False, "error": f"{type(exc).__name__}: {exc}"},
                  f"FAIL {type(exc).__name__}: {exc}")

    @property
    def failed(self) -> bool:
        return any(c.get("pass") is False for c in self.checks.values())

    def _add(self, check: str, entry: dict, line: str) -> None:
        self.checks[check] = entry
        print(f"check {check}: {line}", flush=True)
        self.path.write_text(json.dumps(self.checks, indent=1, default=str))


def _text(figure: Any) -> str:
    if isinstance(figure, float):
        return f"{figure:.4g}"
    if isinstance(figure, dict):
        return " ".join(f"{k}={_text(v)}" for k, v in figure.items())
    return str(figure)
