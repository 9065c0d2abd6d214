"""fp8="torch" on CUDA: the local GEMM shapes torch._scaled_mm accepts, checked when the model is built, and the
bf16-output fallback for stacks whose rowwise FP8 GEMM refuses a float32 output (GPU-path issue, fault 7).

CPU's ``_scaled_mm`` accepts any shape, so the CUDA rule is a pure function of the model and TP, tested here
without a GPU; the loader applies it for a CUDA mesh (simulated with a stand-in mesh, failing before any I/O).
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

pytestmark = pytest.mark.quick

QKV = "decoder.layers.*.self_attention.linear_qkv"
PROJ = "decoder.layers.*.self_attention.linear_proj"
FC1 = "decoder.layers.*.mlp.linear_fc1"
FC2 = "decoder.layers.*.mlp.linear_fc2"
# torch's own message for a float32 output of a rowwise FP8 GEMM on cuBLAS < 12.9 / the CUTLASS path (older
# torch: TORCH_CHECK_VALUE, a ValueError in Python; see mlora/fp8/quant.py)
OLD_CUBLAS_MSG = "Only bf16 high precision output types are supported for row-wise scaling."


def _llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(architectures=["LlamaForCausalLM"], **kw)


def _smollm2_config():
    """SmolLM2-135M's architecture (tests/test_smollm2.py checks the real converted model's spec has these)."""
    return _llama_config(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                         rope_theta=100000.0, max_position_embeddings=8192)


def _open_llama_3b_config(num_layers: int = 26):
    """OpenLLaMA-3B's architecture: head_dim 100 and intermediate 8640, so FP8 fits TP 1, 2, 4 only."""
    return _llama_config(vocab_size=32000, hidden_size=3200, intermediate_size=8640, num_hidden_layers=num_layers,
                         num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048)


def _spec(cfg):
    from mlora.formats.hf_config import model_spec

    return model_spec(cfg)


def test_smollm2_tp8_shapes_are_refused_naming_the_layers():
    from mlora.fp8 import fp8_shape_problems
    from mlora.models.megatron_build import fp8_local_shapes

    shapes = fp8_local_shapes(_spec(_smollm2_config()), tp=8)
    assert shapes[PROJ] == (576 // 8, 576)  # K = 9 heads x 64 / TP8 = 72
    assert shapes[QKV] == (576, (9 + 2 * 3) * 64 // 8)  # N = 120
    problems = fp8_shape_problems(shapes)
    text = "\n".join(problems)
    assert len(problems) == 2, problems
    assert "linear_proj" in text and "K=72" in text and "linear_qkv" in text and "N=120" in text
    assert "linear_fc1" not in text and "linear_fc2" not in text  # 3072/8 = 384 and 1536/8 = 192 fit


def test_smollm2_tp8_error_names_layer_why_and_the_tps_that_work():
    from mlora.fp8 import FP8ShapeError, FP8Unsupported
    from mlora.models.megatron_build import check_fp8_shapes

    with pytest.raises(FP8ShapeError) as info:
        check_fp8_shapes(_spec(_smollm2_config()), tp=8, device="cuda")
    msg = str(info.value)
    assert PROJ in msg and "K=72" in msg and "tp=8" in msg and "multiple of 16" in msg, msg
    assert "tp that work" in msg and "1, 3" in msg, msg  # 9 heads, 3 KV heads: only 1 and 3 split the model
    assert "fp8=None" in msg, msg
    assert isinstance(info.value, FP8Unsupported) and isinstance(info.value, ValueError)


def test_shapes_that_fit_pass():
    from mlora.fp8 import fp8_shape_problems
    from mlora.models.megatron_build import check_fp8_shapes, fp8_local_shapes

    spec = _spec(_smollm2_config())
    for tp in (1, 3):
        assert fp8_shape_problems(fp8_local_shapes(spec, tp)) == []
        check_fp8_shapes(spec, tp, device="cuda")
    assert fp8_shape_problems({"x.linear_proj": (576, 576), "y": (16, 32)}) == []


def test_valid_tps_are_computed_for_the_model():
    from mlora.fp8 import FP8ShapeError
    from mlora.models.megatron_build import check_fp8_shapes, fp8_valid_tps

    spec = _spec(_open_llama_3b_config())
    assert fp8_valid_tps(spec) == [1, 2, 4]  # TP8: fc2 K = 8640/8 = 1080; TP16: also proj K = 3200/16 = 200
    with pytest.raises(FP8ShapeError) as info:
        check_fp8_shapes(spec, tp=8, device=torch.device("cuda", 0))
    msg = str(info.value)
    assert FC2 in msg and "K=1080" in msg and "1, 2, 4" in msg and PROJ not in msg, msg


def test_local_shapes_are_the_loaders_shards():
    """The (K, N) the check reads equal the shard shapes the loader cuts (mlora.plan.weights.shard_shape runs
    the loader's own slicing on meta tensors)."""
    from mlora.formats.weight_map import stage_param_maps
    from mlora.models.megatron_build import fp8_local_shapes
    from mlora.plan.weights import shard_shape

    for cfg, tps in ((_smollm2_config(), (1, 3)), (_open_llama_3b_config(num_layers=2), (1, 2, 4, 8))):
        spec = _spec(cfg)
        for tp in tps:
            shapes = fp8_local_shapes(spec, tp)
            seen = {}
            for pm in stage_param_maps(spec, 1, 0):
                owner, _, leaf = pm.megatron_name.rpartition(".")
                if leaf == "weight" and owner.startswith("decoder.layers.0.") and "linear_" in owner:
                    name = "decoder.layers.*." + owner.removeprefix("decoder.layers.0.")
                    n, k = shard_shape(pm, spec, tp, tp - 1)
                    seen[name] = (k, n)
            assert seen == shapes, (tp, seen, shapes)


def test_check_is_for_cuda_only():
    """CPU's _scaled_mm runs K = 72 (what the CPU test bed does), so the CUDA rule must not refuse it there."""
    from mlora.fp8 import fp8_linear, quantize_weight
    from mlora.models.megatron_build import check_fp8_shapes

    check_fp8_shapes(_spec(_smollm2_config()), tp=8, device="cpu")
    wq, sw = quantize_weight(torch.randn(24, 72))
    assert fp8_linear(torch.randn(3, 72), wq, sw).shape == (3, 24)


def test_loader_checks_fp8_shapes_for_a_cuda_mesh_before_reading(tmp_path, monkeypatch):
    """load_shard on a CUDA mesh refuses an FP8 layout torch._scaled_mm cannot run right after the layout check:
    no checkpoint is read (this directory holds only config.json) and nothing is built."""
    import mlora.fp8.quant as quant
    from mlora.fp8 import FP8ShapeError
    from mlora.models.loader import load_shard

    _open_llama_3b_config(num_layers=2).save_pretrained(tmp_path)
    monkeypatch.setattr(quant, "require_scaled_mm", lambda device, dtype=torch.float32: None)  # no GPU here
    mesh = types.SimpleNamespace(device=torch.device("cuda", 0), tp=8, pp=1, pp_rank=0, tp_rank=0, ep=1, ep_rank=0, sp=False)
    with pytest.raises(FP8ShapeError, match=r"(?s)linear_fc2.*K=1080.*1, 2, 4"):
        load_shard(tmp_path, mesh, dtype=torch.bfloat16, fp8="torch")


def _old_cublas(monkeypatch, calls: list):
    """torch._scaled_mm as on a stack whose rowwise FP8 GEMM writes bf16 only (raises torch's ValueError)."""
    import mlora.fp8.quant as quant

    real = torch._scaled_mm

    def rowwise_bf16_only(*args, out_dtype=None, **kwargs):
        calls.append(out_dtype)
        if out_dtype != torch.bfloat16:
            raise ValueError(OLD_CUBLAS_MSG)
        return real(*args, out_dtype=out_dtype, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", rowwise_bf16_only)
    monkeypatch.setattr(quant, "_BF16_OUTPUT_DEVICES", set())  # a fresh per-process decision


def test_float32_output_falls_back_to_bf16_output(monkeypatch, caplog):
    from mlora.fp8 import dequantize_rows, fp8_linear, quantize_tokens, quantize_weight, require_scaled_mm

    calls: list = []
    _old_cublas(monkeypatch, calls)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 64, generator=g), torch.randn(2, 5, 64, generator=g)
    wq, sw = quantize_weight(w)
    xq, sx = quantize_tokens(x.reshape(-1, 64))
    ref = ((xq.float() * sx) @ dequantize_rows(wq, sw, torch.float32).t()).view(2, 5, 48)
    with caplog.at_level(logging.WARNING, logger="mlora"):
        require_scaled_mm("cpu", torch.float32)  # the probe asks what the layers ask, and picks bf16 output
        out = fp8_linear(x, wq, sw)
        out2 = fp8_linear(x, wq, sw)
    assert out.dtype == torch.float32 and out.shape == (2, 5, 48)
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 2 ** -8, rel  # bf16 rounding of the output only; the GEMM is the same FP8 GEMM
    assert torch.equal(out, out2)
    assert calls.count(torch.float32) == 1, calls  # refused once, then bf16 output for this device
    said = [r.getMessage() for r in caplog.records if "bf16" in r.getMessage() or "bfloat16" in r.getMessage()]
    assert len(said) == 1 and "float32" in said[0], [r.getMessage() for r in caplog.records]


def test_bf16_output_failing_too_is_fp8_unsupported(monkeypatch):
    import mlora.fp8.quant as quant
    from mlora.fp8 import FP8Unsupported, require_scaled_mm

    def broken(*args, **kwargs):
        raise ValueError("no rowwise FP8 kernel for this device")

    monkeypatch.setattr(torch, "_scaled_mm", broken)
    monkeypatch.setattr(quant, "_BF16_OUTPUT_DEVICES", set())
    with pytest.raises(FP8Unsupported, match="no rowwise FP8 kernel"):
        require_scaled_mm("cpu", torch.float32)
