"""`mlora merge`: correct W + s·B·A, streaming (peak RSS < 3x the largest tensor over the interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from mlora.export.peft_files import peft_adapter_config, peft_tensor_name
from mlora.formats.hf_config import load_hf_config, model_spec
from mlora.lora.config import LoraConfig
from mlora.lora.sites import factor_shapes, model_sites
from mlora.lora.targets import HF_PROJECTIONS, hf_module_name

R, ALPHA = 8, 16


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A ~440 MB Llama checkpoint in two shards and an r-8 all-linear adapter (random tensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("merge")
    base, adapter = root / "base", root / "adapter"
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=16000, tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(str(base))
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    names = sorted(shapes)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: torch.randn(shapes[n], generator=g) * 0.02 for n in part}, str(base / file), {"format": "pt"})
        weight_map.update({n: file for n in part})
    (base / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    spec = model_spec(load_hf_config(base))
    sites = model_sites(spec, 1)
    modules = {(i, p) for i in range(6) for p in HF_PROJECTIONS}
    tensors = {}
    for layer, proj in sorted(modules):
        a_shape, b_shape = factor_shapes(sites[(layer, proj)], proj, R)
        tensors[peft_tensor_name(layer, proj, "A")] = torch.randn(a_shape, generator=g) * 0.05
        tensors[peft_tensor_name(layer, proj, "B")] = torch.randn(b_shape, generator=g) * 0.05
    adapter.mkdir()
    save_file(tensors, str(adapter / "adapter_model.safetensors"), {"format": "pt"})
    cfg_json = peft_adapter_config(LoraConfig(rank=R, alpha=ALPHA), modules, 6, str(base), "LlamaForCausalLM")
    (adapter / "adapter_config.json").write_text(json.dumps(cfg_json))
    largest = max(torch.Size(s).numel() * 4 for s in shapes.values())
    return base, adapter, largest


def _peak_rss(code: str) -> tuple[int, str]:
    """Run ``code`` in a fresh interpreter; its peak RSS in bytes and its stderr."""
    wrapped = code + "\nimport resource; print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    proc = subprocess.run([sys.executable, "-c", wrapped], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    peak = int(proc.stdout.split("PEAK")[-1].split()[0]) * 1024
    return peak, proc.stderr


def test_merge_is_correct_and_streams(big, tmp_path):
    base, adapter, largest = big
    out = tmp_path / "merged"
    interpreter, _ = _peak_rss(
        "import mlora.cli, mlora.export.merge\n"
        f"from mlora.formats.hf_config import load_hf_config, model_spec; model_spec(load_hf_config({str(base)!r}))")
    peak, err = _peak_rss(f"import mlora.cli; assert mlora.cli.main(['merge', '--base', {str(base)!r}, "
                          f"'--adapter', {str(adapter)!r}, '--out', {str(out)!r}]) == 0")
    assert "merge: 100%" in err  # progress bar
    checkpoint = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    assert checkpoint > 300 * 2**20
    assert peak - interpreter < 3 * largest, (peak, interpreter, largest)

    merged, source = {}, {}
    for f in sorted(out.glob("*.safetensors")):
        merged.update(load_file(f))
    for f in sorted(base.glob("*.safetensors")):
        source.update(load_file(f))
    lora = load_file(adapter / "adapter_model.safetensors")
    assert set(merged) == set(source)
    for layer, proj in [(0, "q_proj"), (5, "down_proj"), (3, "up_proj")]:
        name = f"{hf_module_name(layer, proj)}.weight"
        expect = source[name] + (ALPHA / R) * lora[peft_tensor_name(layer, proj, "B")] @ lora[
            peft_tensor_name(layer, proj, "A")]
        torch.testing.assert_close(merged[name], expect, rtol=1e-5, atol=1e-6)
    assert torch.equal(merged["model.embed_tokens.weight"], source["model.embed_tokens.weight"])
    assert (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()


def test_merge_errors(big, tmp_path):
    base, adapter, _ = big
    from mlora.cli import main

    assert main(["merge", "--base", str(base), "--adapter", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(base)]) == 2


def test_export_adapter_from_checkpoint(big, tmp_path):
    import shutil

    from safetensors import safe_open

    from mlora.checkpoint.run_state import ADAPTERS
    from mlora.cli import main

    base, adapter, _ = big
    ckpt = tmp_path / "ckpt"
    shutil.copytree(adapter, ckpt / ADAPTERS / "policy")
    out = tmp_path / "exported"
    assert main(["export-adapter", str(ckpt), "--adapter", "policy", "--out", str(out), "--base", str(base),
                 "--dtype", "bfloat16"]) == 0
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(base) and cfg["r"] == R
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        names = list(f.keys())
        assert len(names) == 6 * 7 * 2 and f.get_tensor(names[0]).dtype == torch.bfloat16
    assert main(["export-adapter", str(ckpt), "--adapter", "critic", "--out", str(out)]) == 2


def test_adapter_for_a_deeper_base_is_rejected(tmp_path):
    from mlora.export.peft_files import peft_modules
    from mlora.formats.checkpoint_reader import CheckpointError

    names = [peft_tensor_name(9, "q_proj", f) for f in "AB"]
    with pytest.raises(CheckpointError, match="adapter has layer 9, the base has only 4 layers"):
        peft_modules(names, 4, tmp_path)
