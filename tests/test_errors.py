"""Bad input gets a clear error naming the bad value and what would be valid."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import mlora
from mlora.formats.checkpoint_reader import CheckpointError
from mlora.parallel import Mesh

pytestmark = pytest.mark.quick


def fake_mesh(tp: int = 1, pp: int = 1) -> Mesh:
    """A mesh description without process groups: enough for the checks that run before any build."""
    return Mesh(tp=tp, pp=pp, dp=1, sp=False, rank=0, world_size=tp * pp, tp_rank=0, pp_rank=0, dp_rank=0,
                device=torch.device("cpu"), backend="gloo")


@pytest.fixture
def llama(tiny_models, tmp_path):
    dst = tmp_path / "llama"
    shutil.copytree(tiny_models / "llama", dst)
    return dst


def test_unsupported_architecture(llama):
    cfg = json.loads((llama / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (llama / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM, "
                                         "Qwen2ForCausalLM, MistralForCausalLM"):
        mlora.from_pretrained(llama, fake_mesh())


def test_tp_must_divide_attention_heads(tiny_models):
    with pytest.raises(ValueError, match=r"tp=3 does not divide num_attention_heads=4; valid tp: \[1, 2\]"):
        mlora.from_pretrained(tiny_models / "llama", fake_mesh(tp=3))


def test_tp_must_divide_kv_heads(tiny_models):
    with pytest.raises(ValueError, match=r"tp=4 does not divide num_key_value_heads=2; valid tp: \[1, 2\]"):
        mlora.from_pretrained(tiny_models / "qwen2", fake_mesh(tp=4))


def test_pp_must_divide_layers(tiny_models):
    with pytest.raises(ValueError, match=r"pp=3 does not divide num_hidden_layers=4; valid pp: \[1, 2, 4\]"):
        mlora.from_pretrained(tiny_models / "mistral", fake_mesh(pp=3))


def test_world_size_not_divisible():
    # In a fresh interpreter: this process may already hold a (world-1) process group.
    code = ("import mlora\ntry:\n    mlora.init_parallel(tp=2, pp=2)\nexcept ValueError as e:\n    print(e)\n"
            "try:\n    mlora.init_parallel(tp=0)\nexcept ValueError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RANK": "0", "WORLD_SIZE": "6"}).stdout
    assert "world size 6 is not divisible by tp*pp = 2*2 = 4; valid world sizes are multiples of 4" in out
    assert "tp=0 is invalid" in out


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        mlora.from_pretrained(tmp_path, fake_mesh())
    with pytest.raises(FileNotFoundError, match="does not exist"):
        mlora.from_pretrained(tmp_path / "nope", fake_mesh())


def test_missing_safetensors_shard(llama):
    (llama / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing from .*model-00002-of-00004.safetensors"):
        mlora.from_pretrained(llama, fake_mesh())


def test_missing_tensor(llama):
    from safetensors.torch import load_file, save_file

    index = json.loads((llama / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.up_proj.weight"
    file = llama / index["weight_map"][name]
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lacks tensors the model needs: model.layers.1.mlp.up_proj.weight"):
        mlora.from_pretrained(llama, fake_mesh())


def test_truncated_safetensors(llama):
    f = llama / "model-00003-of-00004.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model-00003-of-00004.safetensors is truncated"):
        mlora.from_pretrained(llama, fake_mesh())


def test_tensor_shapes_disagree_with_config(llama):
    cfg = json.loads((llama / "config.json").read_text())
    cfg["intermediate_size"] = 384
    (llama / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"gate_proj.weight is \(256, 128\), config.json implies \(384, 128\)"):
        mlora.from_pretrained(llama, fake_mesh())
