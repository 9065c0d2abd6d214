"""Hub FP8 (block-quantized e4m3) checkpoints: exact sliced dequantization, bytes read, config errors."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from mlora.formats.checkpoint_reader import CheckpointError, CheckpointReader
from mlora.formats.fp8_checkpoint import fp8_quantization_config, is_block_quantized, read_dequantized

pytestmark = pytest.mark.quick

FP8_MAX = 448.0
BLOCK = (128, 128)


def block_quantize(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block e4m3 quantization as the Hub releases do it: scale = amax / 448, fp8 = w / scale."""
    br, bc = block
    out, inp = w.shape
    nr, nc = math.ceil(out / br), math.ceil(inp / bc)
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    scale = torch.empty(nr, nc, dtype=torch.float32)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            s = blk.abs().amax().clamp_min(1e-12) / FP8_MAX
            scale[i, j] = s
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def reference_dequant(q: torch.Tensor, scale: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """Element by block, independently of the code under test."""
    br, bc = block
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            sl = (slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc))
            out[sl] = q[sl].float() * scale[i, j]
    return out


@pytest.fixture
def ckpt(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * 0.05
    w[:128, 128:] *= 30  # blocks of very different ranges, so a wrong block lookup shows
    q, s = block_quantize(w)
    norm = torch.randn(200, generator=g).to(torch.bfloat16)
    save_file({"layer.weight": q, "layer.weight_scale_inv": s, "norm.weight": norm}, tmp_path / "model.safetensors")
    return tmp_path, q, s, reference_dequant(q, s), norm


def test_full_tensor_and_bytes(ckpt):
    path, q, s, ref, _ = ckpt
    with CheckpointReader(path) as r:
        assert r.entry("layer.weight").dtype == torch.float8_e4m3fn
        assert is_block_quantized(r, "layer.weight") and not is_block_quantized(r, "norm.weight")
        raw = r.read("layer.weight")
        assert raw.dtype == torch.float8_e4m3fn and torch.equal(raw.view(torch.uint8), q.view(torch.uint8))
        r.bytes_read = 0
        out = read_dequantized(r, "layer.weight")
        assert out.dtype == torch.float32 and torch.equal(out, ref)
        assert r.bytes_read == 300 * 200 * 1 + 3 * 2 * 4


@pytest.mark.parametrize("start,stop", [(0, 300), (0, 1), (5, 17), (100, 260), (128, 256), (256, 300),
                                        (299, 300), (7, 7)])
def test_row_slices(ckpt, start, stop):
    path, _, _, ref, _ = ckpt
    with CheckpointReader(path) as r:
        out = read_dequantized(r, "layer.weight", 0, start, stop)
        assert torch.equal(out, ref[start:stop])
        blocks = (stop + 127) // 128 - start // 128 if stop > start else 0
        assert r.bytes_read == (stop - start) * 200 + blocks * 2 * 4  # fp8 rows + the scale rows covering them


@pytest.mark.parametrize("start,stop", [(0, 200), (0, 100), (100, 200), (120, 140), (128, 200), (199, 200)])
def test_column_slices(ckpt, start, stop):
    path, _, _, ref, _ = ckpt
    with CheckpointReader(path) as r:
        out = read_dequantized(r, "layer.weight", dim=1, start=start, stop=stop)
        assert torch.equal(out, ref[:, start:stop])
        blocks = (stop + 127) // 128 - start // 128
        assert r.bytes_read == 300 * (stop - start) + 3 * blocks * 4


def test_tp_shards_concatenate_to_full(ckpt):
    path, _, _, ref, _ = ckpt
    with CheckpointReader(path) as r:
        rows = torch.cat([read_dequantized(r, "layer.weight", 0, k * 75, (k + 1) * 75) for k in range(4)])
        cols = torch.cat([read_dequantized(r, "layer.weight", 1, k * 50, (k + 1) * 50) for k in range(4)], dim=1)
        assert torch.equal(rows, ref) and torch.equal(cols, ref)
        # row shards cover scale rows 1+2+1+2 (2 floats each), column shards scale columns 1+1+2+1 (3 floats each)
        assert r.bytes_read == 2 * 300 * 200 + (6 * 2 + 5 * 3) * 4


def test_unquantized_tensors_pass_through(ckpt):
    path, _, _, _, norm = ckpt
    with CheckpointReader(path) as r:
        out = read_dequantized(r, "norm.weight", 0, 10, 20)
        assert out.dtype == torch.float32 and torch.equal(out, norm[10:20].float())


def test_dequantized_is_close_to_original(tmp_path):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(130, 260, generator=g)
    q, s = block_quantize(w)
    save_file({"w": q, "w_scale_inv": s}, tmp_path / "model.safetensors")
    with CheckpointReader(tmp_path) as r:
        out = read_dequantized(r, "w")
    assert ((out - w).norm() / w.norm()).item() < 0.05  # e4m3: 3 mantissa bits


def test_bad_scale_tensors(tmp_path):
    q, s = block_quantize(torch.randn(300, 200))
    save_file({"a.weight": q, "a.weight_scale_inv": s[:2].clone(), "b.weight": q.clone(),
               "c.weight": q.to(torch.float32).to(torch.float8_e5m2)}, tmp_path / "model.safetensors")
    with CheckpointReader(tmp_path) as r:
        with pytest.raises(CheckpointError, match=r"a.weight_scale_inv has shape \(2, 2\).*needs \(3, 2\)"):
            read_dequantized(r, "a.weight")
        with pytest.raises(CheckpointError, match="b.weight_scale_inv is missing"):
            read_dequantized(r, "b.weight", 0, 0, 10)
        with pytest.raises(CheckpointError, match="e5m2"):
            read_dequantized(r, "c.weight")
        with pytest.raises(CheckpointError, match=r"needs \(5, 4\)"):
            read_dequantized(r, "a.weight", block=(64, 64))


def test_quantization_config():
    good = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert fp8_quantization_config({"hidden_size": 8}) is None
    assert fp8_quantization_config({"quantization_config": good}) == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": (128, 128)}
    no_fmt = {k: v for k, v in good.items() if k != "fmt"}
    assert fp8_quantization_config({"quantization_config": no_fmt})["fmt"] == "e4m3"
    bad = [
        ({"quant_method": "awq"}, "quant_method is 'awq'"),
        ({"quant_method": "gptq"}, "quant_method is 'gptq'"),
        ({"quant_method": None}, "quant_method is None"),
        ({"fmt": "e5m2"}, "fmt is 'e5m2'"),
        ({"activation_scheme": "static"}, "activation_scheme is 'static'"),
        ({"weight_block_size": None}, "weight_block_size is missing"),
        ({"weight_block_size": [128]}, r"weight_block_size is \[128\]"),
        ({"weight_block_size": [128, 0]}, "weight_block_size is"),
        ({"weight_block_size": "128x128"}, "weight_block_size is"),
    ]
    for change, msg in bad:
        qc = {**good, **change}
        if change.get("weight_block_size", 1) is None:
            del qc["weight_block_size"]
        with pytest.raises(ValueError, match=msg) as exc:
            fp8_quantization_config({"quantization_config": qc})
        assert "e4m3" in str(exc.value) and "weight_block_size" in str(exc.value)  # says what is supported
    with pytest.raises(ValueError, match="must be a mapping"):
        fp8_quantization_config({"quantization_config": "fp8"})


def _to_hub_fp8(src, dst, block=(64, 64)):
    """A Hub-style FP8 copy of the tiny HF model in ``src``: its seven projections block-quantized
    (e4m3 + ``weight_scale_inv``), the rest as it was, ``quantization_config`` in config.json; and, in
    ``dst / "dequantized"``, the float32 checkpoint of exactly the values the FP8 one stands for."""
    import json
    import shutil

    from safetensors.torch import load_file

    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    fp8, deq = dst / "fp8", dst / "dequantized"
    for out in (fp8, deq):
        shutil.copytree(src, out)
        for f in out.glob("*.safetensors*"):
            f.unlink()
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in names:
            q, scale = block_quantize(t.float(), block)
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            dequantized[name] = reference_dequant(q, scale, block)
        else:
            quantized[name] = dequantized[name] = t
    save_file(quantized, fp8 / "model.safetensors")
    save_file(dequantized, deq / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    (deq / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, deq


def test_hub_fp8_checkpoint_loads(tiny_models, tmp_path):
    """from_pretrained on a Hub FP8 checkpoint equals loading the float32 checkpoint of its dequantized
    values: exactly for a float32 base, and for fp8="torch" (requantized to mlora's row scales)."""
    import mlora

    fp8_dir, deq_dir = _to_hub_fp8(tiny_models / "llama", tmp_path)
    mesh = mlora.init_parallel(tp=1, pp=1)
    ids = torch.randint(0, 1001, (2, 9), generator=torch.Generator().manual_seed(0))
    for fp8 in (None, "torch"):
        got = mlora.from_pretrained(fp8_dir, mesh, fp8=fp8).logits(ids)
        want = mlora.from_pretrained(deq_dir, mesh, fp8=fp8).logits(ids)
        assert torch.equal(got, want), (fp8, (got - want).abs().max())
    import json
    bad = json.loads((fp8_dir / "config.json").read_text())
    bad["quantization_config"]["quant_method"] = "awq"
    (fp8_dir / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="quant_method is 'awq'"):
        mlora.from_pretrained(fp8_dir, mesh)


def _shard_with_index(directory):
    """Split ``directory/model.safetensors`` into two files plus ``model.safetensors.index.json``, each
    weight next to its ``weight_scale_inv`` (as the Hub's sharded FP8 releases are)."""
    import json

    from safetensors.torch import load_file

    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    names = sorted(n for n in tensors if not n.endswith("_scale_inv"))
    weight_map = {}
    for i, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        chunk = {n: tensors[n] for n in part}
        chunk.update({n + "_scale_inv": tensors[n + "_scale_inv"] for n in part if n + "_scale_inv" in tensors})
        save_file(chunk, directory / file, {"format": "pt"})
        weight_map.update({n: file for n in chunk})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def _random_adapter(model_dir, out_dir, modules, rank=4, alpha=8, seed=1):
    """A PEFT adapter for ``model_dir`` on ``modules`` with non-zero A and B; its tensors."""
    import json

    from mlora.export.peft_files import peft_adapter_config, peft_tensor_name
    from mlora.formats.hf_config import load_hf_config, model_spec
    from mlora.lora.config import LoraConfig
    from mlora.lora.sites import factor_shapes, model_sites

    spec = model_spec(load_hf_config(model_dir))
    sites, g = model_sites(spec, 1), torch.Generator().manual_seed(seed)
    tensors = {}
    for layer, proj in sorted(modules):
        a_shape, b_shape = factor_shapes(sites[(layer, proj)], proj, rank)
        tensors[peft_tensor_name(layer, proj, "A")] = torch.randn(a_shape, generator=g) * 0.1
        tensors[peft_tensor_name(layer, proj, "B")] = torch.randn(b_shape, generator=g) * 0.1
    out_dir.mkdir()
    save_file(tensors, out_dir / "adapter_model.safetensors", {"format": "pt"})
    cfg = peft_adapter_config(LoraConfig(rank=rank, alpha=alpha), set(modules), spec.num_layers, str(model_dir),
                              spec.architecture)
    (out_dir / "adapter_config.json").write_text(json.dumps(cfg))
    return tensors


@pytest.mark.parametrize("declared", ["float32", "bfloat16"])
def test_merge_into_hub_fp8_checkpoint(tiny_models, tmp_path, declared):
    """merge_adapter on a (sharded) Hub FP8 base writes an unquantized checkpoint: every FP8 weight is
    dequantized with its block scales and stored in the declared dtype, the adapted ones carry s·B·A,
    the scale tensors and quantization_config are gone, the index lists exactly what was written; and
    the merged directory loads in transformers and in mlora with the logits of base + adapter."""
    import json

    from safetensors.torch import load_file

    import mlora
    from mlora.export.merge import merge_adapter
    from mlora.export.peft_files import peft_tensor_name
    from mlora.formats.checkpoint_reader import CheckpointReader
    from mlora.lora.targets import hf_module_name

    block = (64, 64)
    fp8_dir, _ = _to_hub_fp8(tiny_models / "llama", tmp_path, block=block)
    config = json.loads((fp8_dir / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = declared
    (fp8_dir / "config.json").write_text(json.dumps(config))
    source = load_file(fp8_dir / "model.safetensors")
    _shard_with_index(fp8_dir)
    modules = {(layer, proj) for layer in range(4) for proj in ("q_proj", "v_proj", "down_proj")}
    lora = _random_adapter(tiny_models / "llama", tmp_path / "adapter", modules)
    out = merge_adapter(fp8_dir, tmp_path / "adapter", tmp_path / "merged", progress=False)

    dtype = getattr(torch, declared)
    files = {file.name: load_file(file) for file in sorted(out.glob("*.safetensors"))}
    written = {n: t for part in files.values() for n, t in part.items()}
    scaling = 8 / 4
    n_merged = 0
    for name, t in source.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype != torch.float8_e4m3fn:
            assert torch.equal(written[name], t), name
            continue
        assert written[name].dtype == dtype, name
        deq = reference_dequant(t, source[name + "_scale_inv"], block)
        layer_proj = next(((layer, proj) for layer, proj in modules if f"{hf_module_name(layer, proj)}.weight" == name),
                          None)
        if layer_proj is None:
            assert torch.equal(written[name], deq.to(dtype)), name  # dequantized exactly, then one rounding
            continue
        delta = scaling * lora[peft_tensor_name(*layer_proj, "B")] @ lora[peft_tensor_name(*layer_proj, "A")]
        assert delta.abs().max() > 0.1 * deq.abs().max()  # the adapter is not lost in the comparison
        expect = (deq + delta).to(dtype).float()
        tol = dict(rtol=2**-8, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(written[name].float(), expect, **tol)
        n_merged += 1
    assert n_merged == len(modules)
    assert set(written) == {n for n in source if not n.endswith("_scale_inv")}
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {n: file for file, part in files.items() for n in part}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in written.values())
    with CheckpointReader(out):  # the index and the files agree for mlora's reader too
        pass

    if declared == "float32":  # loads: transformers as is, mlora with base + adapter's logits
        from transformers import AutoModelForCausalLM

        ids = torch.randint(0, 1001, (2, 9), generator=torch.Generator().manual_seed(0))
        hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        with torch.no_grad():
            hf_logits = hf(input_ids=ids).logits
        mesh = mlora.init_parallel(tp=1, pp=1)
        merged_logits = mlora.from_pretrained(out, mesh).logits(ids)
        model = mlora.from_pretrained(fp8_dir, mesh)
        model.load_adapter("a", tmp_path / "adapter")
        with model.use_adapters("a"):
            want = model.logits(ids)
        torch.testing.assert_close(merged_logits, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(hf_logits, merged_logits, rtol=1e-4, atol=1e-4)
