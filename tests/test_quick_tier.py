"""``pytest -m quick`` touches every mlora package: the quick tests' own imports (module level, and inside the
quick test functions) name each package under ``mlora/`` and ``mlora.cli``. Read with ``ast``, nothing runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.quick


def _is_quick(node: ast.expr) -> bool:
    """``pytest.mark.quick`` (or a list/tuple holding it)."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_quick(n) for n in node.elts)
    return isinstance(node, ast.Attribute) and node.attr == "quick" and ast.unparse(node) == "pytest.mark.quick"


def _mlora_packages(nodes) -> set[str]:
    out = set()
    for node in nodes:
        for n in ast.walk(node):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                [f"{n.module}.{a.name}" for a in n.names] if isinstance(n, ast.ImportFrom) and n.module else []
            for name in names:
                parts = name.split(".")
                if parts[0] == "mlora" and len(parts) > 1:
                    out.add(parts[1])
    return out


def quick_coverage() -> dict[str, set[str]]:
    """Test file -> the mlora packages its quick tests import."""
    cover = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text(), str(path))
        module_quick = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                           and _is_quick(n.value) for n in tree.body)
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
                 and (module_quick or any(_is_quick(d) for d in n.decorator_list))]
        if module_quick or funcs:
            cover[path.name] = _mlora_packages(top + funcs + ([n for n in tree.body] if module_quick else []))
    return cover


def test_quick_tier_touches_every_package():
    packages = {p.name for p in (ROOT / "mlora").iterdir() if (p / "__init__.py").is_file()} | {"cli"}
    covered = set().union(*quick_coverage().values())
    assert packages - covered == set(), f"no quick test imports mlora.{sorted(packages - covered)}"
