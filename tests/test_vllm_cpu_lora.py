"""mlora's grouped CPU LoRA GEMMs equal vLLM's per-token ones (vllm.lora.ops.torch_ops) and install as
a vLLM plugin only where they match vLLM's signatures."""

import types

import pytest
import torch

pytestmark = pytest.mark.quick

lora_ops = pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")

from mlora.rollout import vllm_cpu_lora as grouped  # noqa: E402

# vLLM's own functions, captured before anything could patch them (install() is idempotent per process)
ORIGINAL = {name: getattr(lora_ops, name) for name in grouped.REPLACEMENTS}
if getattr(lora_ops, "_mlora_grouped", False):  # pragma: no cover - only when a plugin ran in this process
    pytest.skip("vLLM's ops were already replaced in this process", allow_module_level=True)

CASES = [  # (tokens, slot indices): one adapter, several with the no-adapter index -1, one token
    (37, [0]), (29, [0, 1, -1]), (1, [1])]


def _indices(tokens, slots, gen):
    return torch.tensor(slots)[torch.randint(len(slots), (tokens,), generator=gen)]


@pytest.mark.parametrize("tokens,slots", CASES)
@pytest.mark.parametrize("four_d", [False, True])
def test_shrink_and_expand_equal_vllm(tokens, slots, four_d):
    gen = torch.Generator().manual_seed(tokens)
    idx = _indices(tokens, slots, gen)
    a = torch.randn(3, 16, 64, generator=gen)  # [slots, r, in]
    b = torch.randn(3, 96, 16, generator=gen)  # [slots, out, r]
    if four_d:
        a, b = a.unsqueeze(1), b.unsqueeze(1)
    x = torch.randn(tokens, 64, generator=gen)
    # float32 products grouped into one GEMM per slot instead of one per token: summation order only
    tol = dict(rtol=1e-5, atol=1e-5)
    y_ref, y = torch.zeros(tokens, 20), torch.zeros(tokens, 20)  # wider than r, as vLLM's buffers are
    ORIGINAL["bgmv_shrink"](x, a, y_ref, idx, 0.5)
    grouped.bgmv_shrink(x, a, y, idx, 0.5)
    torch.testing.assert_close(y, y_ref, **tol)
    h = y[:, :16].contiguous()
    for add in (True, False):
        out_ref = torch.randn(tokens, 96, generator=gen)
        out = out_ref.clone()
        ORIGINAL["bgmv_expand"](h, b, out_ref, idx, add)
        grouped.bgmv_expand(h, b, out, idx, add)
        torch.testing.assert_close(out, out_ref, **tol)
        wide_ref = torch.randn(tokens, 200, generator=gen)
        wide = wide_ref.clone()
        ORIGINAL["bgmv_expand_slice"](h, b, wide_ref, idx, 40, 96, add)
        grouped.bgmv_expand_slice(h, b, wide, idx, 40, 96, add)
        torch.testing.assert_close(wide, wide_ref, **tol)


def test_single_row_broadcast_like_vllm():
    # vLLM's expand broadcasts one computed row over every output row; the replacement must too
    gen = torch.Generator().manual_seed(1)
    b, h = torch.randn(2, 8, 4, generator=gen), torch.randn(1, 4, generator=gen)
    out_ref, out = torch.zeros(5, 8), torch.zeros(5, 8)
    ORIGINAL["bgmv_expand"](h, b, out_ref, torch.tensor([1]), True)
    grouped.bgmv_expand(h, b, out, torch.tensor([1]), True)
    torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=1e-6)


def test_incompatible_vllm_is_left_alone():
    assert grouped.incompatibilities(lora_ops) == []
    fake = types.ModuleType("fake_lora_ops")
    fake.bgmv_shrink = lambda inputs, weights, out, indices, scaling=1.0: None
    problems = grouped.incompatibilities(fake)
    assert any("fake_lora_ops.bgmv_shrink(" in p for p in problems), problems
    assert any("fake_lora_ops.bgmv_expand is missing" in p for p in problems), problems


def test_registered_as_vllm_plugin():
    from importlib.metadata import entry_points

    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get(grouped.PLUGIN_NAME) == "mlora.rollout.vllm_cpu_lora:install", found
