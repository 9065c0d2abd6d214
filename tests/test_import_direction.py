"""mlora's packages import in one direction only (docs/architecture.md, "Layers").

The checker reads every module under ``mlora/`` with ``ast`` (nothing is imported, so it takes well
under a second): every ``import x`` and ``from x import y``, at module level or inside functions,
relative imports resolved. Each module belongs to the package under ``mlora/`` that holds it; the
package root ``mlora/__init__.py`` counts as the facade; ``mlora/cli.py`` and every ``__main__.py``
are entry points. A module may import its own package and packages on strictly lower levels of
:data:`LEVELS` (peers on one level may not import each other, except the pairs in
:data:`SAME_LEVEL_ALLOWED`); entry points may import anything and nothing may import them; and the
module graph has no cycle. Importing ``a.b.c`` also runs ``a/__init__.py`` and ``a/b/__init__.py``:
those implicit edges are not counted, only the modules an import names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]
ENTRY = "<entry point>"
# Bottom to top. A package may import itself and the packages on lower levels.
LEVELS: tuple[tuple[str, ...], ...] = (
    ("parallel", "rl", "fp8"),  # 1: the mesh, pure RL math, the FP8 recipe
    ("formats",),  # 2: bytes of file formats, no LoRA or model knowledge
    ("lora",),  # 3: LoraConfig, sites, LoRA parallel linears, TP-partial gradient reduce
    ("models",),  # 4: HF config -> megatron model, attention, recompute, loading, the TE spec
    ("export",),  # 5: PEFT files, sharded writes, merge, bridge and reward adapters, export plans
    ("facade",),  # 6: MLoraModel, AdapterHost, from_pretrained; the package root mlora/__init__.py
    ("checkpoint", "rollout", "plan"),  # 7: run state, rollouts and engines, the memory planner
    ("config",),  # 8: the typed schema and its checks
    ("train",),  # 9: engines, loops, optimizer, evaluation, metrics
    ("service",),  # 10: the Tinker-compatible server (HTTP, SQLite state, mixed-adapter scheduling)
    ("testing",),  # 11: test helpers
    ("demos",),  # 12: demo assets
    (ENTRY,),  # 13: mlora/cli.py and every __main__.py
)
SAME_LEVEL_ALLOWED = {("fp8", "parallel")}  # (importer's package, imported package)


def _modules(src: Path, top: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package ``src/top``."""
    out = {}
    for path in sorted((src / top).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path], top: str) -> list[tuple[str, int, str]]:
    """(imported module, line, import as written) of every import of ``top`` in module ``name``."""

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    out = []
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == top or alias.name.startswith(top + "."):
                    out.append((resolve(alias.name), node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source != top and not source.startswith(top + "."):
                continue
            for alias in node.names:
                target = f"{source}.{alias.name}"
                out.append((target if target in modules else resolve(source), node.lineno,
                            f"from {'.' * node.level}{node.module or ''} import {alias.name}"))
    return out


def check_imports(src: Path, top: str = "mlora", levels=LEVELS, allowed=SAME_LEVEL_ALLOWED,
                  root_package: str = "facade") -> list[str]:
    """Every violation in the package ``src/top``: imports that go up or across a level, imports of an
    entry point, modules in no level, unresolvable imports, and import cycles."""
    modules = _modules(src, top)
    level_of = {pkg: i + 1 for i, pkgs in enumerate(levels) for pkg in pkgs}

    def package(module: str) -> str:
        if module == top:
            return root_package
        if module == f"{top}.cli" or module.endswith(".__main__"):
            return ENTRY
        return module.split(".")[1]

    problems: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        if package(module) not in level_of:
            problems.append(f"{module}: package {package(module)!r} is on no level of LEVELS")
            continue
        for target, line, text in _imports(module, path, modules, top):
            where = f"{path.relative_to(src)}:{line} ({text})"
            if target is None:
                problems.append(f"{module} -> ?: imports a module that does not exist, {where}")
                continue
            if target == module or target in graph[module]:
                continue  # the first import of a module speaks for the others
            graph[module].add(target)
            a, b = package(module), package(target)
            if b not in level_of:
                continue  # reported for the imported module itself
            la, lb = level_of[a], level_of[b]
            if b == ENTRY:
                problems.append(f"{module} -> {target} (level {la} {a} -> level {lb} entry point): nothing may "
                                f"import an entry point, {where}")
            elif a == ENTRY or a == b or lb < la or (la == lb and (a, b) in allowed):
                continue
            else:
                kind = "upward" if lb > la else "sideways (same level)"
                problems.append(f"{module} -> {target} (level {la} {a} -> level {lb} {b}): {kind}, {where}")
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> ... -> a) per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (about a hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:  # a path back to the first module, inside the component (BFS)
        members, start = set(component), component[0]
        previous: dict[str, str] = {}
        frontier, end = [start], None
        while frontier and end is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w == start:
                        end = v
                        break
                    if w not in previous:
                        previous[w] = v
                        nxt.append(w)
                if end is not None:
                    break
            frontier = nxt
        path = [end]
        while path[-1] != start:
            path.append(previous[path[-1]])
        cycles.append([*reversed(path), start])
    return cycles


def test_mlora_imports_point_down():
    problems = check_imports(ROOT)
    assert not problems, "import direction violated:\n" + "\n".join(problems)


def test_checker_reports_upward_imports_and_cycles(tmp_path):
    """A synthetic package with one upward import (inside a function) and one cycle (through a relative
    import): both are reported; a downward relative import is not."""
    files = {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": "def f():\n    from pkg.high import b\n    return b\n",
        "pkg/low/c.py": "import pkg.low.d\n",
        "pkg/low/d.py": "from . import c\n",
        "pkg/high/__init__.py": "",
        "pkg/high/b.py": "from ..low import c\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    problems = check_imports(tmp_path, "pkg", levels=(("low",), ("high",)), allowed=set(), root_package="low")
    assert len(problems) == 2, problems
    assert problems[0].startswith("pkg.low.a -> pkg.high.b (level 1 low -> level 2 high): upward, "), problems
    assert "pkg/low/a.py:2 (from pkg.high import b)" in problems[0], problems
    assert problems[1] == "import cycle: pkg.low.c -> pkg.low.d -> pkg.low.c", problems
