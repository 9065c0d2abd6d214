"""The wheelhouse that the lent GPU machine installs with ``pip install --no-index`` (tests/gpu/README.md).

    .venv/bin/python tests/gpu/wheelhouse.py build    [--dest tests/gpu/wheels]   # downloads, once
    .venv/bin/python tests/gpu/wheelhouse.py verify   [--dest tests/gpu/wheels]   # offline, seconds

The device has Python 3.12 and a CUDA torch 2.11 but no network and none of the trainer's other packages;
what it gets is carried (64 MiB in all, the working tree included). ``build`` downloads, for CPython 3.12 on
manylinux x86-64, every package the GPU checks import except torch, with the dependencies they pull, at the
versions this machine's venv runs (so the device runs what was tested here), into ``--dest``; it writes the
top-level pins to ``requirements.txt`` there, which is what the device installs. It fails when the wheelhouse
plus the tracked files exceed the carry limit.

torch is kept out of the resolution by a metadata-only stand-in for the device's torch (``torch 2.11.0``, no
files, no requirements): megatron-core, peft and accelerate ask for ``torch>=...``, which the device's own
torch satisfies, and the stand-in makes pip resolve the rest as it will there. Packages torch brings along
(filelock, fsspec, typing-extensions, ...) are nevertheless in the wheelhouse when ours need them, so the
install does not depend on what the device happens to have.

``verify`` proves the wheelhouse complete for the device without a Python 3.12 here: ``pip install --dry-run
--no-index --python-version 3.12 --platform manylinux... --only-binary=:all:`` of ``requirements.txt`` from the
wheelhouse and the torch stand-in alone must resolve, and every package it picks must be a file of the
wheelhouse. It prints the package count and the size.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DEST = ROOT / "tests" / "gpu" / "wheels"
CARRY_LIMIT = 64 << 20  # the device's limit on carried files, the working tree included
DEVICE_PYTHON = "3.12"
DEVICE_TORCH = "2.11.0"
# The device's torch 2.11 CUDA wheels are manylinux_2_28, so its glibc is at least 2.28: any wheel tagged up to
# that runs there. Listed explicitly (pip expands some aliases, not all, depending on its version).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux_2_5_x86_64",
             "manylinux1_x86_64")
# What the check scripts and the mlora modules they use import (besides torch), by distribution name. pyarrow
# (42 MB) and matplotlib are imported only by the data and plot paths, which no GPU check takes.
PACKAGES = ("megatron-core", "transformers", "tokenizers", "safetensors", "peft", "accelerate", "huggingface_hub",
            "hydra-core", "omegaconf", "numpy", "pyyaml", "tqdm", "packaging")
# Published only as source distributions: built into a (pure-Python) wheel here first.
SDIST_ONLY = ("antlr4-python3-runtime", "func-timeout")
# Installed without their requirements (nodeps.txt): skyrl-gym (mlora.rollout imports it) and its func-timeout.
# skyrl-gym also asks for pandas and requests, which the device's image has (device KINDS.md) and which would
# pass the carry limit (pandas alone is ~12 MB); omegaconf comes with PACKAGES.
NO_DEPS = ("skyrl-gym", "func-timeout")
STUB_TAG = "gpustub"  # the stand-in's local version label: only the stand-in matches torch==2.11.0+gpustub
MANIFEST = "manifest.json"


def pins() -> dict[str, str]:
    """``{distribution: version}`` of the venv running this script (``pip freeze``, without torch and mlora)."""
    out = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() not in ("torch", "mlora"):
            out[name.lower().replace("_", "-")] = dist.version
    return out


def requirements() -> list[str]:
    """The top-level pins the device installs: :data:`PACKAGES` at this venv's versions."""
    have = pins()
    missing = [p for p in PACKAGES if p.lower().replace("_", "-") not in have]
    if missing:
        raise SystemExit(f"wheelhouse: {', '.join(missing)} not installed in {sys.prefix}; run scripts/setup.sh and "
                         f"use .venv/bin/python")
    return [f"{p}=={have[p.lower().replace('_', '-')]}" for p in PACKAGES]


def no_deps_pins() -> list[str]:
    """:data:`NO_DEPS` at this venv's versions."""
    have = pins()
    return [f"{p}=={have[p]}" for p in NO_DEPS if p in have]


def key(reqs: list[str]) -> str:
    """What a wheelhouse was built for: the pins and the target, so that a changed venv rebuilds it."""
    text = "\n".join([*reqs, *no_deps_pins(), DEVICE_PYTHON, DEVICE_TORCH, *PLATFORMS])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def torch_stub(folder: Path) -> Path:
    """A metadata-only ``torch-2.11.0+gpustub`` wheel (no modules, no requirements): the device's torch, for the
    resolver only. Never installed anywhere; never left in the wheelhouse."""
    version = f"{DEVICE_TORCH}+{STUB_TAG}"
    info = f"torch-{version}.dist-info"
    path = folder / f"torch-{version}-py3-none-any.whl"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: mlora-wheelhouse\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def target_flags() -> list[str]:
    """pip's flags for the device's interpreter and platform, binary wheels only."""
    flags = ["--only-binary=:all:", "--python-version", DEVICE_PYTHON, "--implementation", "cp"]
    for plat in PLATFORMS:
        flags += ["--platform", plat]
    return flags


def pip(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"wheelhouse: {' '.join(cmd[2:6])} ... failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}")
    return proc


def tree_bytes() -> int:
    """Bytes of the files that travel with the working tree (tracked and untracked, not ignored)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / os.fsdecode(p)).stat().st_size for p in listed if p and (ROOT / os.fsdecode(p)).is_file())


def wheel_files(dest: Path) -> list[Path]:
    return sorted(dest.glob("*.whl"))


def size_line(dest: Path) -> tuple[str, bool]:
    wheels = sum(p.stat().st_size for p in wheel_files(dest))
    tree = tree_bytes()
    ok = wheels + tree <= CARRY_LIMIT
    return (f"wheelhouse: {len(wheel_files(dest))} wheels, {wheels / 2**20:.1f} MiB + working tree {tree / 2**20:.1f} MiB "
            f"= {(wheels + tree) / 2**20:.1f} MiB of the {CARRY_LIMIT >> 20} MiB carry limit"), ok


def build(dest: Path, force: bool = False) -> None:
    """Download the wheelhouse into ``dest`` unless one for the same pins is there already."""
    reqs = requirements()
    manifest = dest / MANIFEST
    if not force and manifest.exists() and json.loads(manifest.read_text()).get("key") == key(reqs):
        print(f"wheelhouse: reusing {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} (same pins)")
        line, ok = size_line(dest)
        print(line)
        if not ok:
            raise SystemExit("wheelhouse: over the carry limit")
        return
    dest.mkdir(parents=True, exist_ok=True)
    for old in wheel_files(dest):
        old.unlink()
    have = pins()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        stub_dir = tmp / "stub"
        stub_dir.mkdir()
        torch_stub(stub_dir)
        # every package at this venv's version where it has one, and torch only as the stand-in
        constraints = tmp / "constraints.txt"
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(have.items()))
                               + f"torch=={DEVICE_TORCH}+{STUB_TAG}\n")
        for name in SDIST_ONLY:  # pure-Python sdists: one py3-none-any wheel serves every interpreter
            if name in have:
                pip("wheel", "--no-deps", "-q", "-w", str(dest), f"{name}=={have[name]}")
        pip("download", "-q", "-d", str(dest), "--find-links", str(stub_dir), "--find-links", str(dest),
            "-c", str(constraints), *target_flags(), *reqs)
        pip("download", "-q", "--no-deps", "-d", str(dest), "--find-links", str(dest), *target_flags(),
            *no_deps_pins())
    (dest / "nodeps.txt").write_text(
        "# installed after requirements.txt with: pip install --no-index --no-deps --find-links tests/gpu/wheels -r this file\n"
        + "".join(f"{r}\n" for r in no_deps_pins()))
    for stub in dest.glob(f"torch-*{STUB_TAG}*.whl"):
        stub.unlink()
    (dest / "requirements.txt").write_text(
        "# the device installs these with: pip install --no-index --find-links tests/gpu/wheels -r this file\n"
        + "".join(f"{r}\n" for r in reqs))
    manifest.write_text(json.dumps({"key": key(reqs), "python": DEVICE_PYTHON, "torch": DEVICE_TORCH,
                                    "requirements": reqs,
                                    "wheels": {p.name: p.stat().st_size for p in wheel_files(dest)}}, indent=1))
    line, ok = size_line(dest)
    print(line)
    if not ok:
        raise SystemExit("wheelhouse: over the carry limit: drop a package from PACKAGES or carry less")


def verify(dest: Path) -> None:
    """Resolve ``requirements.txt`` offline for CPython 3.12 on manylinux from the wheelhouse and the torch
    stand-in only; SystemExit unless it resolves and every package comes from the wheelhouse."""
    reqs_file = dest / "requirements.txt"
    if not reqs_file.exists():
        raise SystemExit(f"wheelhouse: {reqs_file} missing: run `python tests/gpu/wheelhouse.py build` first")
    # no pip configuration of this machine (its find-links hold cp311 wheels that the device does not have)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        torch_stub(tmp)
        (tmp / "constraints.txt").write_text(f"torch=={DEVICE_TORCH}+{STUB_TAG}\n")
        report = tmp / "report.json"
        pip("install", "--dry-run", "--ignore-installed", "--no-index", "-q", "--find-links", str(dest),
            "--find-links", str(tmp), "-c", str(tmp / "constraints.txt"), "--target", str(tmp / "target"),
            "--report", str(report), *target_flags(), "-r", str(reqs_file), env=env)
        picked = json.loads(report.read_text())["install"]
    names = {p.name for p in wheel_files(dest)}
    foreign = []
    for item in picked:
        meta = item["metadata"]
        if meta["name"].lower() == "torch":
            continue
        file = item["download_info"]["url"].rsplit("/", 1)[-1]
        if file not in names:
            foreign.append(f"{meta['name']} {meta['version']} ({file})")
    if foreign:
        raise SystemExit("wheelhouse: resolved from outside the wheelhouse: " + ", ".join(foreign))
    unused = names - {i["download_info"]["url"].rsplit("/", 1)[-1] for i in picked}
    for pin in (dest / "nodeps.txt").read_text().split("\n")[1:]:  # installed on their own, without requirements
        if pin:
            stem = pin.replace("-", "_").replace("==", "-")
            found = {n for n in unused if n.lower().startswith(stem.lower() + "-")}
            if not found:
                raise SystemExit(f"wheelhouse: {pin} (nodeps.txt) has no wheel in {dest}")
            unused -= found
    line, ok = size_line(dest)
    print(f"wheelhouse: complete for CPython {DEVICE_PYTHON} manylinux x86-64 with the device's torch "
          f"{DEVICE_TORCH}: {len(picked) - 1} packages resolve offline" + (f"; unused: {sorted(unused)}" if unused else ""))
    print(line)
    if not ok:
        raise SystemExit("wheelhouse: over the carry limit")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("build", "verify"))
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    ap.add_argument("--force", action="store_true", help="download again even if the pins did not change")
    args = ap.parse_args()
    dest = args.dest.resolve()
    build(dest, args.force) if args.action == "build" else verify(dest)


if __name__ == "__main__":
    main()
