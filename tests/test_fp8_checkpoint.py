"""Hub FP8 (block-quantized e4m3) checkpoints: exact sliced dequantization, bytes read, config errors."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from mlora.models.checkpoint_reader import CheckpointError, CheckpointReader
from mlora.models.fp8_checkpoint import fp8_quantization_config, is_block_quantized, read_dequantized

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
