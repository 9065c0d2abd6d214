"""tools/convert_checkpoint.py: HF <-> megatron-core dist checkpoint.

One torchrun launch (4 ranks) writes llama and qwen2 at TP2xPP2 and mistral at TP1xPP4 with
megatron-core's own dist_checkpointing.save. Then, in this process: megatron's dist_checkpointing.load
puts them into a plain megatron GPTModel at TP1 whose float32 logits match transformers' within 1e-4,
mcore-to-hf gives back the HF files bit for bit, and bad input fails naming what is wrong.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_records

from mlora.formats.checkpoint_reader import CheckpointError
from mlora.models.mcore_checkpoint import (
    CONVERT_INFO,
    HF_SIDE_DIR,
    RELEASE_DIR,
    TRACKER_FILE,
    mcore_to_hf,
    padded_vocab_size,
)
from mlora.testing import load_checkpoint_tensors

TOOL = Path(__file__).resolve().parents[1] / "tools" / "convert_checkpoint.py"
LOGITS_TOL = 1e-4  # float32, megatron local spec vs transformers eager


def _tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def converted(tiny_models, tmp_path_factory) -> Path:
    """The tiny models converted under one torchrun launch (see tests/dist/mcore_convert.py)."""
    out = tmp_path_factory.mktemp("mcore")
    records = run_records(4, "mcore_convert.py", out / "records.json", tiny_models, out)
    assert {(r["model"], r["exit"]) for r in records} == {("llama", 0), ("qwen2", 0), ("mistral", 0)}
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------ what it must show
@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_tp2pp2_checkpoint_loads_into_megatron_gpt_at_tp1_with_hf_logits(converted, tiny_models, name):
    from megatron.core import dist_checkpointing
    from transformers import AutoModelForCausalLM

    import mlora
    from mlora.formats.hf_config import load_hf_config, model_spec
    from mlora.models.mcore_checkpoint import build_plain_gpt

    ckpt = converted / name / RELEASE_DIR
    assert (converted / name / TRACKER_FILE).read_text() == RELEASE_DIR
    # four ranks wrote (megatron names each rank's files __<rank>_<i>.distcp)
    assert {p.name.split("_")[2] for p in ckpt.glob("__*_*.distcp")} == {"0", "1", "2", "3"}
    spec = model_spec(load_hf_config(tiny_models / name))
    padded = padded_vocab_size(spec.vocab_size, tp=2)
    assert padded == 1024  # Megatron-LM's padding at TP2: a multiple of 128 x 2

    mesh = mlora.init_parallel(tp=1, pp=1)
    model = build_plain_gpt(spec, mesh, torch.float32, padded).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # everything must come from the checkpoint
    # megatron-core's own load, laid out as Megatron-LM's load_checkpoint asks for it
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt))
    assert state["checkpoint_version"] == 3.0 and state["iteration"] == 0
    model.load_state_dict(state["model"], strict=True)
    assert not any(torch.isnan(p).any() for p in model.parameters())

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (2, 16), generator=g)
    pos = torch.arange(16).unsqueeze(0).expand(2, -1)
    causal = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
    with torch.no_grad():
        ours = model(ids, pos, causal)[..., : spec.vocab_size]
        hf = AutoModelForCausalLM.from_pretrained(tiny_models / name, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
        ref = hf(ids).logits
    diff = (ours - ref).abs().max().item()
    print(f"{name}: TP2xPP2 dist checkpoint -> megatron GPTModel TP1, max |logits - transformers| = {diff:.3e}")
    assert diff <= LOGITS_TOL
    assert ref.abs().max() > 0.1  # logits of substance, not a trivially small comparison


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_hf_to_mcore_to_hf_is_bit_identical(converted, tiny_models, tmp_path, name):
    src = tiny_models / name
    out = mcore_to_hf(converted / name, tmp_path / "hf", progress=False)
    a, b = load_checkpoint_tensors(src), load_checkpoint_tensors(out)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    weights = sorted(p.name for p in src.iterdir() if p.suffix == ".safetensors" or p.name.endswith("index.json"))
    assert sorted(p.name for p in out.iterdir() if p.name in weights) == weights
    for file in weights:  # same files, byte for byte (header, order, index)
        assert (src / file).read_bytes() == (out / file).read_bytes(), file
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


@pytest.mark.slow
def test_cli_mcore_to_hf_and_foreign_checkpoint_with_hf_config(converted, tiny_models, tmp_path, capsys):
    """A checkpoint with no mlora side files (as Megatron-LM or Bridge write them) converts given --hf-config;
    the release/ directory itself is accepted too."""
    ckpt = _copy(converted / "llama" / RELEASE_DIR, tmp_path / "foreign")
    shutil.rmtree(ckpt / HF_SIDE_DIR)
    (ckpt / CONVERT_INFO).unlink()
    args = ["mcore-to-hf", "--mcore", str(ckpt), "--out", str(tmp_path / "hf"), "--quiet"]
    assert _tool().main(args) == 2
    assert "--hf-config" in capsys.readouterr().err
    assert _tool().main([*args, "--hf-config", str(tiny_models / "llama")]) == 0
    a, b = load_checkpoint_tensors(tiny_models / "llama"), load_checkpoint_tensors(tmp_path / "hf")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "hf" / "model.safetensors").is_file()  # default layout: one file under 5 GiB


def test_single_process_tp1_round_trip(tiny_models, tmp_path):
    """TP1×PP1 needs no torchrun: megatron's save runs in this process (a one-rank group)."""
    from megatron.core.dist_checkpointing import load_common_state_dict

    from mlora.models.mcore_checkpoint import hf_to_mcore

    ckpt = hf_to_mcore(tiny_models / "mistral", tmp_path / "mcore", progress=False)
    assert ckpt == tmp_path / "mcore" / RELEASE_DIR and sorted(p.name for p in ckpt.glob("*.distcp"))
    common = load_common_state_dict(str(ckpt))
    assert common["checkpoint_version"] == 3.0 and common["content_metadata"]["singleton_local_shards"] is False
    info = json.loads((ckpt / CONVERT_INFO).read_text())
    assert (info["padded_vocab_size"], info["tensor_model_parallel_size"]) == (1024, 1)
    out = mcore_to_hf(tmp_path / "mcore", tmp_path / "hf", progress=False)
    a, b = load_checkpoint_tensors(tiny_models / "mistral"), load_checkpoint_tensors(out)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


_MEASURE = """
import gc, sys
from mlora.models.mcore_checkpoint import mcore_to_hf
from mlora.formats.hf_config import load_hf_config, model_spec
import megatron.core.dist_checkpointing, torch.distributed.checkpoint, tqdm
model_spec(load_hf_config(sys.argv[3]))  # every import the conversion needs, done before measuring
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))
gc.collect()
start = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS: the peak from here on
mcore_to_hf(sys.argv[1], sys.argv[2], progress=False)
print("EXTRA", status("VmHWM:") - start)
"""


def test_mcore_to_hf_streams(tmp_path):
    """A 100 MB checkpoint comes back with less than 3x its largest tensor of memory over the imported
    interpreter's (peak RSS, measured in a fresh process)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from mlora.models.mcore_checkpoint import hf_to_mcore

    src = tmp_path / "hf"
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=8000, tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(str(src))
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    save_file({n: torch.randn(s, generator=g) * 0.02 for n, s in sorted(shapes.items())},
              str(src / "model.safetensors"), {"format": "pt"})
    size, largest = (src / "model.safetensors").stat().st_size, max(torch.Size(s).numel() * 4 for s in shapes.values())
    assert size > 6 * largest  # holding the model would be distinguishable from streaming it
    hf_to_mcore(src, tmp_path / "mcore", progress=False)
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path / "mcore"), str(tmp_path / "back"), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    extra = int(proc.stdout.split("EXTRA")[-1].split()[0])
    print(f"mcore-to-hf of a {size / 2**20:.0f} MB checkpoint: peak {extra / 2**20:.1f} MB over the imported "
          f"interpreter, largest tensor {largest / 2**20:.1f} MB")
    assert extra < 3 * largest, (extra, largest)
    assert (src / "model.safetensors").read_bytes() == (tmp_path / "back" / "model.safetensors").read_bytes()


def test_help_runs_without_heavy_imports():
    proc = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "hf-to-mcore" in proc.stdout and "mcore-to-hf" in proc.stdout
    proc = subprocess.run([sys.executable, str(TOOL), "hf-to-mcore", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "--make-vocab-size-divisible-by" in proc.stdout


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("tp, pp, message", [
    (3, 1, "tp=3 does not divide num_attention_heads=4; valid tp: [1, 2]"),
    (4, 1, "tp=4 does not divide num_key_value_heads=2; valid tp: [1, 2]"),
    (1, 3, "pp=3 does not divide num_hidden_layers=4; valid pp: [1, 2, 4]"),
])
def test_layout_that_does_not_divide_the_model_is_refused(tiny_models, tmp_path, capsys, tp, pp, message):
    code = _tool().main(["hf-to-mcore", "--hf", str(tiny_models / "llama"), "--out", str(tmp_path / "o"),
                         "--tp", str(tp), "--pp", str(pp)])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_hf_to_mcore_refuses_wrong_world_size_and_nonempty_out(tiny_models, tmp_path):
    from mlora.models.mcore_checkpoint import hf_to_mcore

    with pytest.raises(ValueError, match=r"tp=2 × pp=1 needs 2 ranks, this run has 1.*torchrun --nproc_per_node=2"):
        hf_to_mcore(tiny_models / "llama", tmp_path / "o", tp=2, pp=1)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="is not an empty directory"):
        hf_to_mcore(tiny_models / "llama", tmp_path / "full")


def test_hf_checkpoint_with_tensors_megatron_cannot_hold_is_refused(tiny_models, tmp_path):
    from safetensors.torch import save_file

    from mlora.models.mcore_checkpoint import hf_to_mcore

    src = _copy(tiny_models / "qwen2", tmp_path / "qwen2")
    tensors = load_checkpoint_tensors(src)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)
    save_file(tensors, str(src / "model.safetensors"), {"format": "pt"})
    with pytest.raises(CheckpointError, match=r"no place for: model\.layers\.0\.self_attn\.rotary_emb\.inv_freq"):
        hf_to_mcore(src, tmp_path / "o")


@pytest.mark.slow
def test_missing_or_truncated_shard_file_is_named(converted, tmp_path):
    ckpt = _copy(converted / "llama", tmp_path / "missing")
    (ckpt / RELEASE_DIR / "__1_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"missing shard files: __1_0\.distcp \(holds "):
        mcore_to_hf(ckpt, tmp_path / "o1", progress=False)
    ckpt = _copy(converted / "llama", tmp_path / "short")
    shard = ckpt / RELEASE_DIR / "__2_1.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"truncated shard files: __2_1\.distcp is 1000 bytes"):
        mcore_to_hf(ckpt, tmp_path / "o2", progress=False)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


@pytest.mark.slow
def test_checkpoint_of_another_architecture_is_refused(converted, tiny_models, tmp_path):
    # recorded source architecture vs the config given
    with pytest.raises(CheckpointError, match="converted from a Qwen2ForCausalLM checkpoint"):
        mcore_to_hf(converted / "qwen2", tmp_path / "o1", hf_config=tiny_models / "llama", progress=False)
    # no record (a checkpoint from elsewhere): the tensors themselves give it away
    ckpt = _copy(converted / "qwen2" / RELEASE_DIR, tmp_path / "foreign")
    shutil.rmtree(ckpt / HF_SIDE_DIR)
    (ckpt / CONVERT_INFO).unlink()
    with pytest.raises(CheckpointError) as err:
        mcore_to_hf(ckpt, tmp_path / "o2", hf_config=tiny_models / "llama", progress=False)
    msg = str(err.value)
    assert "LlamaForCausalLM has no place for: decoder.layers.self_attention.linear_qkv.bias" in msg
    assert "lacks tensors LlamaForCausalLM needs: output_layer.weight" in msg


@pytest.mark.slow
def test_stored_config_that_disagrees_with_the_tensors_is_refused(converted, tmp_path):
    ckpt = _copy(converted / "llama", tmp_path / "edited")
    config = ckpt / RELEASE_DIR / HF_SIDE_DIR / "config.json"
    cfg = json.loads(config.read_text())
    cfg["intermediate_size"] = 384
    config.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"decoder\.layers\.mlp\.linear_fc1\.weight is \(4, 512, 128\) in the "
                                              r"checkpoint, the config implies \(4, 768, 128\)"):
        mcore_to_hf(ckpt, tmp_path / "o", progress=False)


def test_not_a_dist_checkpoint_is_refused(tiny_models, tmp_path):
    with pytest.raises(CheckpointError, match="is not a megatron-core dist checkpoint: no metadata.json"):
        mcore_to_hf(tiny_models / "llama", tmp_path / "o", progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        mcore_to_hf(tmp_path / "nowhere", tmp_path / "o", progress=False)
