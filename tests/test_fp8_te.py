"""fp8="te" on a machine without Transformer Engine (the CPU CI): errors, lazy import, spec wiring.

What TE itself does (GEMMs, fp8_autocast, the LoRA linears on TE) is checked only by
tests/gpu/check_fp8_te.py on a GPU with TE; nothing here runs TE.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from te_stand_ins import TELinearShape

from mlora.models import te as fp8_te


def _te_importable() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


needs_no_te = pytest.mark.skipif(_te_importable(), reason="Transformer Engine is importable here")


def _assert_gpu_extra_error(excinfo) -> None:
    msg = str(excinfo.value)
    assert isinstance(excinfo.value, ImportError)
    assert "scripts/setup_gpu.sh" in msg and "`gpu` extra" in msg
    assert 'fp8="torch"' in msg and "without Transformer Engine" in msg


@needs_no_te
def test_require_te_names_the_gpu_extra():
    with pytest.raises(fp8_te.TransformerEngineUnavailable) as excinfo:
        fp8_te.require_te()
    _assert_gpu_extra_error(excinfo)
    with pytest.raises(fp8_te.TransformerEngineUnavailable):
        fp8_te.require_te(fp8=False)


class _BrokenTE(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A transformer_engine whose import fails like the -cu12 wheel on a machine without cuDNN."""

    def find_spec(self, name, path=None, target=None):
        if name == "transformer_engine" or name.startswith("transformer_engine."):
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise RuntimeError("cudnn shared object not found")


def test_broken_te_gives_the_same_clear_error(monkeypatch):
    for name in [n for n in sys.modules if n.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_BrokenTE(), *sys.meta_path])
    with pytest.raises(fp8_te.TransformerEngineUnavailable) as excinfo:
        fp8_te.require_te(fp8=False)
    _assert_gpu_extra_error(excinfo)
    assert "RuntimeError: cudnn shared object not found" in str(excinfo.value)
    assert isinstance(excinfo.value.__cause__, RuntimeError)


def test_importing_the_module_never_imports_te():
    """In a fresh interpreter: the module itself attempts no transformer_engine import (megatron's
    own guarded attempts while importing megatron.core happen before and are not counted), no TE
    module is loaded, and megatron.core still imports and works afterwards."""
    code = textwrap.dedent("""
        import importlib.abc, sys
        attempts = []
        class Watch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "transformer_engine":
                    attempts.append(name)
                return None
        sys.meta_path.insert(0, Watch())
        import megatron.core, mlora, mlora.fp8  # megatron probes for TE here (guarded)
        sys.modules.pop("mlora.models.te", None)
        attempts.clear()
        import mlora.models.te
        assert attempts == [], attempts
        assert not any(n.split(".")[0] == "transformer_engine" for n in sys.modules)
        from megatron.core.tensor_parallel import ColumnParallelLinear
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        get_gpt_layer_local_spec(normalization="RMSNorm")
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("OK")


def test_unknown_recipe_is_a_clear_error_without_te():
    for call in (lambda: fp8_te.fp8_autocast_context("bogus"), lambda: fp8_te.check_recipe("e5m2"),
                 lambda: fp8_te.megatron_fp8_settings("fp4"), lambda: fp8_te.require_te(recipe="blockwise"),
                 lambda: fp8_te.fp8_recipe("Delayed")):
        with pytest.raises(ValueError, match=r"unknown FP8 recipe .*delayed, current, mxfp8"):
            call()
    with pytest.raises(ValueError, match="unknown FP8 recipe"):  # checked even when disabled
        fp8_te.fp8_autocast_context("bogus", enabled=False)


@needs_no_te
def test_known_recipes_need_te():
    for recipe in fp8_te.RECIPES:
        with pytest.raises(fp8_te.TransformerEngineUnavailable) as excinfo:
            fp8_te.fp8_autocast_context(recipe)
        _assert_gpu_extra_error(excinfo)
        with pytest.raises(fp8_te.TransformerEngineUnavailable):
            fp8_te.fp8_recipe(recipe)
    with fp8_te.fp8_autocast_context("delayed", enabled=False):  # disabled: a null context, no TE
        pass


def test_megatron_fp8_settings():
    assert fp8_te.megatron_fp8_settings("delayed") == {"fp8": "hybrid", "fp8_recipe": "delayed"}
    assert fp8_te.megatron_fp8_settings("current", "e4m3") == {"fp8": "e4m3", "fp8_recipe": "tensorwise"}
    assert fp8_te.megatron_fp8_settings("mxfp8")["fp8_recipe"] == "mxfp8"


@needs_no_te
def test_spec_builders_raise_the_clear_error():
    for call in (lambda: fp8_te.te_layer_spec(None), lambda: fp8_te.te_block_spec(None),
                 fp8_te.te_lora_linear_classes):
        with pytest.raises(fp8_te.TransformerEngineUnavailable) as excinfo:
            call()
        _assert_gpu_extra_error(excinfo)
    assert fp8_te.is_te_lora_linear(torch.nn.Linear(2, 2)) is False


def test_fp8_device_checks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(fp8_te.FP8DeviceUnsupported, match=r"no CUDA device.*fp8=\"torch\" runs on CPU"):
        fp8_te.check_fp8_device()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "FakeGPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(fp8_te.FP8DeviceUnsupported, match=r"FakeGPU has compute capability 8.0; FP8 GEMMs need >= 8.9"):
        fp8_te.check_fp8_device()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_te.check_fp8_device("delayed") == (9, 0)
    with pytest.raises(fp8_te.FP8DeviceUnsupported, match=r"mxfp8.*>= 10.0.*FakeGPU has 9.0"):
        fp8_te.check_fp8_device("mxfp8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert fp8_te.check_fp8_device("mxfp8") == (10, 0)


def test_te_spec_differs_from_the_local_spec_only_in_the_swapped_slots(monkeypatch):
    """The wiring of te_layer_spec, with stand-ins for the TE classes (which need TE)."""
    from megatron.core.transformer.enums import AttnMaskType

    from mlora.models.megatron_build import block_spec
    from mlora.models.norm import RMSNorm

    class Col:
        pass

    class Row:
        pass

    class CoreAttention:
        pass

    te_layer = fp8_te._swap_te_spec(Col, Row, CoreAttention)
    sub = te_layer.submodules
    attn, mlp = sub.self_attention, sub.mlp
    assert (attn.submodules.linear_qkv, attn.submodules.linear_proj) == (Col, Row)
    assert (mlp.submodules.linear_fc1, mlp.submodules.linear_fc2) == (Col, Row)
    assert attn.submodules.core_attention is CoreAttention
    assert attn.params["attn_mask_type"] == AttnMaskType.arbitrary
    assert sub.input_layernorm is RMSNorm and sub.pre_mlp_layernorm is RMSNorm

    import megatron.core.transformer.transformer_block as tb

    monkeypatch.setattr(tb, "get_num_layers_to_build", lambda config, *a, **k: 2)
    local = block_spec(None).layer_specs[0]
    lsub = local.submodules
    assert te_layer.module is local.module and mlp.module is lsub.mlp.module and attn.module is lsub.self_attention.module
    swapped_attn = {"linear_qkv", "linear_proj", "core_attention"}
    for f in dataclasses.fields(attn.submodules):
        if f.name not in swapped_attn:
            assert getattr(attn.submodules, f.name) is getattr(lsub.self_attention.submodules, f.name), f.name
    for f in dataclasses.fields(sub):
        if f.name not in {"self_attention", "mlp"}:
            assert getattr(sub, f.name) == getattr(lsub, f.name), f.name
    assert {k: v for k, v in attn.params.items() if k != "attn_mask_type"} == \
        {k: v for k, v in lsub.self_attention.params.items() if k != "attn_mask_type"}


def test_reset_fp8_weight_cache_needs_no_te():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[1].is_first_microbatch = False
    assert fp8_te.reset_fp8_weight_cache(model) == 1 and model[1].is_first_microbatch is True


# ------------------------------------------------------------------ the mlora side of the TE linears
# Stand-ins for megatron's TE wrappers (same constructor, TE's "local GEMM" forward) and megatron's
# local core attention for TEDotProductAttention: the whole TE spec then builds and runs on CPU.
# This checks mlora's wiring (spec, norms, weight names, adapter registry, where the LoRA branch
# joins, that TE is left without collectives); what TE itself computes stays UNVERIFIED.

class _StandInTELinear(TELinearShape):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.forward_calls = 0

    def forward(self, x):
        assert self.parallel_mode is None and self.sequence_parallel is False, "TE must be left without collectives"
        self.forward_calls += 1
        out = torch.nn.functional.linear(x, self.weight, None if self.skip_bias_add else self.bias)
        return out, (self.bias if self.skip_bias_add else None)


def _install_stand_ins(set_attr) -> None:
    """Swap megatron's TE wrappers for the stand-ins (``set_attr``: monkeypatch.setattr or setattr)."""
    import megatron.core.extensions.transformer_engine as ext
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class Col(_StandInTELinear):
        mode = "column"

    class Row(_StandInTELinear):
        mode = "row"

    set_attr(ext, "TEColumnParallelLinear", Col)
    set_attr(ext, "TERowParallelLinear", Row)
    set_attr(ext, "TEDotProductAttention", DotProductAttention)
    set_attr(fp8_te, "require_te", lambda *a, **k: None)
    fp8_te.te_lora_linear_classes.cache_clear()


def _te_model(mlora, model_dir, mesh, set_attr):
    """``mlora.from_pretrained`` with the TE block spec (the registry finds its LoRA linears: LoraHosts)."""
    import mlora.models.megatron_build as mb

    set_attr(mb, "block_spec", fp8_te.te_block_spec)
    return mlora.from_pretrained(model_dir, mesh)


def _random_adapter(model, out_dir, seed: int = 3) -> None:
    import mlora

    model.add_adapter("policy", mlora.LoraConfig(rank=4, alpha=8, target_modules="all-linear"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.gpt.modules():
            if hasattr(module, "lora") and "policy" in module.lora:
                for b in module.lora["policy"].lora_B:
                    b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    model.save_adapter("policy", out_dir)


def _logsumexp_loss(logits, mb):
    m = mb["attention_mask"].to(logits.device, logits.dtype)
    return (logits.float().logsumexp(-1) * m).sum() / m.sum(), {}


def _compare(local, te_model, ids, mask) -> dict:
    """Largest differences TE-spec vs local spec: base logits, LoRA logits, LoRA gradients (rel)."""
    valid = mask.bool()
    with torch.no_grad():
        with local.use_adapters(), te_model.use_adapters():  # the base alone
            base = [m.logits(ids, mask) for m in (local, te_model)]
        with local.use_adapters("policy"), te_model.use_adapters("policy"):
            lora = [m.logits(ids, mask) for m in (local, te_model)]
    grads = []
    for m in (local, te_model):
        for p in m.adapter_parameters("policy"):
            p.grad = None
        with m.use_adapters("policy"):
            m.forward_backward([{"input_ids": ids, "attention_mask": mask}], _logsumexp_loss)
        m.reduce_tp_replicated_grads()
        grads.append(m.adapter_tensors("policy", grads=True))
    out = {"factors": sorted(grads[0]) == sorted(grads[1]) and len(grads[0]),
           "min_grad_norm": min(v.norm().item() for v in grads[0].values()),
           "grad_rel": max(((grads[1][k] - v).norm() / v.norm()).item() for k, v in grads[0].items())}
    if base[0] is not None:
        out["base"] = (base[0] - base[1])[valid].abs().max().item()
        out["lora"] = (lora[0] - lora[1])[valid].abs().max().item()
        out["lora_effect"] = (lora[0] - base[0])[valid].abs().max().item()
    return out


@pytest.fixture
def stand_in_te(monkeypatch):
    _install_stand_ins(monkeypatch.setattr)
    yield
    fp8_te.te_lora_linear_classes.cache_clear()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_te_spec_with_stand_in_te_equals_the_local_spec(stand_in_te, tiny_models, monkeypatch, tmp_path, arch):
    import mlora
    from mlora.testing import right_padded_batch

    mesh = mlora.init_parallel(tp=1, pp=1)
    local = mlora.from_pretrained(tiny_models / arch, mesh)
    te_model = _te_model(mlora, tiny_models / arch, mesh, monkeypatch.setattr)
    col, row = fp8_te.te_lora_linear_classes()
    layer = te_model.gpt.decoder.layers[0]
    assert isinstance(layer.self_attention.linear_qkv, col) and isinstance(layer.mlp.linear_fc2, row)
    assert fp8_te.is_te_lora_linear(layer.mlp.linear_fc1)
    _random_adapter(local, tmp_path / "policy")
    te_model.load_adapter("policy", tmp_path / "policy", trainable=True)
    ids, mask = right_padded_batch(local.spec.vocab_size, (12, 9, 5), seed=4)
    r = _compare(local, te_model, ids, mask)
    assert r["factors"] == 7 * 2 * local.spec.num_layers and r["min_grad_norm"] > 0
    assert r["base"] < 1e-5 and r["lora"] < 1e-5 and r["lora_effect"] > 1e-3, r
    assert r["grad_rel"] < 1e-4, r
    assert layer.self_attention.linear_qkv.forward_calls > 0


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_te_spec_with_stand_in_te_at_tp2(tiny_models, tmp_path, sp):
    """TP2 (and TP2+SP) on CPU ranks: the TE LoRA linears' one collective each (megatron's
    mappings; TE left without any) give the local spec's logits and LoRA gradients."""
    from conftest import torchrun

    import mlora

    local = mlora.from_pretrained(tiny_models / "llama", mlora.init_parallel(tp=1, pp=1))
    _random_adapter(local, tmp_path / "policy")
    out = tmp_path / "out.json"
    torchrun(2, "../test_fp8_te.py", tiny_models / "llama", tmp_path / "policy", out, int(sp), timeout=600)
    r = json.loads(out.read_text())
    assert r["factors"] == 7 * 2 * local.spec.num_layers and r["min_grad_norm"] > 0
    assert r["base"] < 1e-5 and r["lora"] < 1e-5 and r["lora_effect"] > 1e-3, r
    assert r["grad_rel"] < 1e-4, r


def _tp2_worker(model_dir: str, adapter_dir: str, out: str, sp: str) -> None:
    import mlora
    from mlora.testing import right_padded_batch

    _install_stand_ins(setattr)
    mesh = mlora.init_parallel(tp=2, pp=1, sp=bool(int(sp)))
    local = mlora.from_pretrained(model_dir, mesh)
    te_model = _te_model(mlora, model_dir, mesh, setattr)
    for m in (local, te_model):
        m.load_adapter("policy", adapter_dir, trainable=True)
    ids, mask = right_padded_batch(local.spec.vocab_size, (12, 9, 5), seed=4)
    r = _compare(local, te_model, ids, mask)
    if mesh.rank == 0:
        Path(out).write_text(json.dumps(r))


if __name__ == "__main__":  # the TP2 worker, under torchrun
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _tp2_worker(*sys.argv[1:])
