"""SkyRL's own code (the ``skyrl`` 0.3.0 wheel, installed with ``--no-deps`` by scripts/setup.sh) as the
reference of mlora's RL functions.

``skyrl.backends/__init__.py`` imports SkyRL's Tinker backend, whose pydantic models need Python 3.12
(``typing.TypedDict``); the modules the tests use (``ppo_utils``, ``off_policy_correction_utils``,
``torch_utils``) do not. So the ``skyrl.backends`` package is entered without running that ``__init__``:
its folder is put on a bare package module, and the submodules import as they are. A function whose module
imports SkyRL's whole trainer stack (torchdata, datasets, its Ray workers) is taken from the installed
file's source by name (:func:`owner_function`), unchanged.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest


def skyrl_root() -> Path:
    spec = importlib.util.find_spec("skyrl")
    if spec is None:
        pytest.fail("the skyrl wheel is not installed: run scripts/setup.sh (it installs skyrl==0.3.0 --no-deps)")
    return Path(spec.origin).parent


def skyrl_module(name: str):
    """``skyrl.<name>`` imported from the wheel, ``skyrl.backends``' package ``__init__`` skipped."""
    root = skyrl_root()
    if "skyrl.backends" not in sys.modules:
        pkg = types.ModuleType("skyrl.backends")
        pkg.__path__ = [str(root / "backends")]
        sys.modules["skyrl.backends"] = pkg
    return importlib.import_module(f"skyrl.{name}")


def ppo_utils():
    mod = skyrl_module("backends.skyrl_train.utils.ppo_utils")
    mod.repopulate_all_registries()
    return mod


def owner_function(relpath: str, name: str, namespace: dict):
    """Function or class ``name`` of ``skyrl/<relpath>``, compiled from the installed file's own source with
    ``namespace`` as its globals (the names it uses that its module imports)."""
    path = skyrl_root() / relpath
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec")
            scope = dict(namespace)
            exec(code, scope)
            return scope[name]
    raise LookupError(f"{name} not found in {path}")


def algorithm_config(**overrides):
    """SkyRL's ``AlgorithmConfig`` with its defaults and ``overrides`` (nested sections by attribute)."""
    config = skyrl_module("train.config")
    cfg = config.AlgorithmConfig()
    for key, value in overrides.items():
        target = cfg
        *path, leaf = key.split(".")
        for part in path:
            target = getattr(target, part)
        setattr(target, leaf, value)
    return cfg


def config_keys() -> dict[str, object]:
    """Every leaf of SkyRL's own configuration (``SkyRLTrainConfig``, walked from its dataclasses): dotted key ->
    its default."""
    def walk(obj, prefix: str) -> dict[str, object]:
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            out.update(walk(value, prefix + f.name + ".") if dataclasses.is_dataclass(value)
                       else {prefix + f.name: value})
        return out

    return walk(skyrl_module("train.config").SkyRLTrainConfig(), "")
