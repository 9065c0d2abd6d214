"""Sliced safetensors reads: exact values, exact byte counts, clear errors on broken checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from mlora.formats.checkpoint_reader import CheckpointError, CheckpointReader

pytestmark = pytest.mark.quick


@pytest.fixture
def ckpt(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(6, 10, generator=g), "b": torch.randn(10, generator=g),
               "h": torch.randn(4, 6, 5, generator=g).to(torch.bfloat16)}
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path, tensors


def test_slices_match_and_count_bytes(ckpt):
    path, t = ckpt
    with CheckpointReader(path) as r:
        assert torch.equal(r.read("w"), t["w"])
        assert r.bytes_read == 6 * 10 * 4
        assert torch.equal(r.read("w", dim=0, start=2, stop=4), t["w"][2:4])
        assert torch.equal(r.read("w", dim=1, start=3, stop=8), t["w"][:, 3:8])
        assert torch.equal(r.read("h", dim=1, start=1, stop=3), t["h"][:, 1:3])
        assert torch.equal(r.read("b", dim=0, start=5, stop=10), t["b"][5:])
        assert r.bytes_read == (60 + 20 + 30) * 4 + 4 * 2 * 5 * 2 + 5 * 4
        with pytest.raises(CheckpointError, match="outside"):
            r.read("w", dim=1, start=8, stop=12)
        with pytest.raises(CheckpointError, match="'missing' is missing"):
            r.read("missing")


def test_sharded_checkpoint_with_index(tmp_path):
    save_file({"a": torch.ones(2)}, tmp_path / "part-1.safetensors")
    save_file({"b": torch.zeros(3)}, tmp_path / "part-2.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "part-1.safetensors", "b": "part-2.safetensors"}}))
    with CheckpointReader(tmp_path) as r:
        assert torch.equal(r.read("b"), torch.zeros(3)) and torch.equal(r.read("a"), torch.ones(2))
    (tmp_path / "part-2.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing.*part-2.safetensors"):
        CheckpointReader(tmp_path)


def test_truncated_file_is_named(ckpt):
    path, _ = ckpt
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-16])
    with pytest.raises(CheckpointError, match="model.safetensors is truncated"):
        CheckpointReader(path)
    f.write_bytes(b"\x05")
    with pytest.raises(CheckpointError, match="truncated"):
        CheckpointReader(path)


def test_no_safetensors(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="no \\*.safetensors.*pytorch_model.bin"):
        CheckpointReader(tmp_path)
