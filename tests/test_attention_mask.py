"""Attention: masks follow HF semantics (causal, sliding window i - j < window, padded keys); the
fused core attention (SDPA) equals megatron's unfused one, builds no [b, 1, s, s] mask when it
needs none, and is the default; ``attention="unfused"`` keeps the old path."""

from __future__ import annotations

import pytest
import torch

import mlora
from mlora.models import attention as attn
from mlora.models.attention import attention_mask, is_right_padded, sdpa_mask
from mlora.testing import right_padded_batch

pytestmark = pytest.mark.quick


def test_causal_window_and_padding():
    pad = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    m = attention_mask(2, 4, pad, sliding_window=2)
    allowed0 = ~m[0, 0]
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(allowed0, expected)
    assert torch.equal(~m[1, 0, :, 2:], torch.zeros(4, 2, dtype=torch.bool))
    assert torch.equal(~attention_mask(1, 3)[0, 0], torch.tril(torch.ones(3, 3, dtype=torch.bool)))


def test_is_right_padded():
    assert is_right_padded(torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]]))
    assert not is_right_padded(torch.tensor([[1, 1, 1], [0, 1, 1]]))  # left padding
    assert not is_right_padded(torch.tensor([[1, 0, 1]]))  # a hole


def test_sdpa_mask_is_minimal_and_agrees_with_the_full_mask():
    right = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    left = right.flip(1)
    # causal alone needs no mask: unpadded, right-padded, window >= sequence
    assert sdpa_mask(6) is None and sdpa_mask(6, right) is None and sdpa_mask(6, right, sliding_window=6) is None
    # a window shorter than the sequence: one [1, 1, s, s] mask, also with right padding
    for pad in (None, right):
        m = sdpa_mask(6, pad, sliding_window=3)
        assert m.shape == (1, 1, 6, 6) and m.dtype == torch.float32
        assert torch.equal(m == 0, ~attention_mask(1, 6, None, sliding_window=3))
    # left padding: the full mask, equal to the boolean one at token queries, no row fully masked
    for window in (None, 3):
        m = sdpa_mask(6, left, sliding_window=window, dtype=torch.bfloat16)
        assert m.shape == (2, 1, 6, 6) and m.dtype == torch.bfloat16
        full = ~attention_mask(2, 6, left, sliding_window=window)
        queries = left.bool()[:, None, :, None].expand_as(full)
        assert torch.equal((m == 0)[queries], full[queries])
        assert bool((m == 0).any(-1).all())


@pytest.fixture(scope="module")
def mesh1():
    return mlora.init_parallel(tp=1, pp=1)


def _core_attentions(model):
    return [layer.self_attention.core_attention for layer in model.gpt.decoder.layers]


@pytest.mark.parametrize("case", ["causal", "window", "left_pad", "bool_mask"])
def test_sdpa_module_equals_megatron_unfused(model, case):
    """The module alone (float32, GQA 4 heads / 2 groups): outputs and q/k/v gradients equal
    megatron's DotProductAttention fed the full boolean mask, at token queries."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = model.config
    kw = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    fused, unfused = attn.SDPAttention(**kw), DotProductAttention(**kw)
    s, b, heads, groups, d = 12, 2, config.num_attention_heads, config.num_query_groups, config.kv_channels
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(s, b, h, d, generator=g, requires_grad=True) for h in (heads, groups, groups)]
    pad = torch.ones(b, s, dtype=torch.long)
    window = 5 if case == "window" else None
    if case == "left_pad":
        pad[1, :4] = 0
    full = attention_mask(b, s, pad, window)
    given = {"causal": None, "window": sdpa_mask(s, None, window), "left_pad": sdpa_mask(s, pad),
             "bool_mask": full}[case]
    outs, grads = [], []
    for module, mask in ((fused, given), (unfused, full)):
        out = module(*qkv, mask)
        assert out.shape == (s, b, heads * d)
        token = pad.bool().T[:, :, None]  # [s, b, 1]
        (out * token).square().sum().backward()
        outs.append(out.detach() * token)
        grads.append([t.grad.clone() for t in qkv])
        for t in qkv:
            t.grad = None
    assert (outs[0] - outs[1]).abs().max() < 1e-5
    for ga, gb in zip(*grads):  # gradients reach |g| ~ 5: float32 rounding, relative
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-5)


def test_default_is_sdpa_and_unfused_keeps_megatron(tiny_models, mesh1):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    default = mlora.from_pretrained(tiny_models / "llama", mesh1)
    assert all(type(c) is attn.SDPAttention for c in _core_attentions(default))
    old = mlora.from_pretrained(tiny_models / "llama", mesh1, attention="unfused")
    assert all(type(c) is DotProductAttention for c in _core_attentions(old))
    ids, mask = right_padded_batch(1001, (7, 4), seed=0)
    full = old._prepare(ids, mask)[2]
    assert full.dtype == torch.bool and full.shape == (2, 1, 7, 7)  # the old path keeps the full mask


def test_bad_attention_value_names_the_valid_ones(tiny_models, mesh1):
    with pytest.raises(ValueError, match=r"attention='flash'.*'sdpa', 'unfused'"):
        mlora.from_pretrained(tiny_models / "llama", mesh1, attention="flash")


def test_no_square_mask_without_padding_or_window(model, monkeypatch):
    """Unpadded and right-padded batches (Llama: no window) reach the layers with no mask, and the
    [b, 1, s, s] builder is never called, in inference and in a LoRA forward+backward."""
    import mlora.facade.model as model_module

    def no_full_mask(*args, **kwargs):
        raise AssertionError("the full [b, 1, s, s] mask was built")

    monkeypatch.setattr(model_module, "build_attention_mask", no_full_mask)
    seen = []
    real_forward = attn.SDPAttention.forward

    def spy(self, query, key, value, attention_mask, *args, **kwargs):
        seen.append(attention_mask)
        return real_forward(self, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setattr(attn.SDPAttention, "forward", spy)
    ids, mask = right_padded_batch(model.spec.vocab_size, (9, 6, 2), seed=1)
    assert model._prepare(ids, None)[2] is None and model._prepare(ids, mask)[2] is None
    model.logits(ids)
    model.logits(ids, mask)
    model.add_adapter("policy", mlora.LoraConfig(rank=4, alpha=8))
    with model.use_adapters("policy"):
        model.forward_backward([{"input_ids": ids, "attention_mask": mask}] * 2,
                               lambda logits, mb: (logits.float().square().mean(), {}))
    assert len(seen) == 4 * len(model.gpt.decoder.layers) and all(m is None for m in seen)
    grads = [p.grad for p in model.adapter_parameters("policy")]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)  # B starts at 0: A's grads are 0


def test_window_mask_is_built_once_and_small(tiny_models, mesh1, monkeypatch):
    """Mistral (window 8): sequences up to the window need no mask; longer ones one [1, 1, s, s]
    mask shared by every micro-batch; left padding the full [b, 1, s, s]."""
    import mlora.facade.model as model_module

    model = mlora.from_pretrained(tiny_models / "mistral", mesh1)
    window = model.spec.sliding_window
    assert window == 8
    short, short_mask = right_padded_batch(model.spec.vocab_size, (window, 3), seed=2)
    assert model._prepare(short, short_mask)[2] is None
    ids, mask = right_padded_batch(model.spec.vocab_size, (19, 13, 5), seed=2)
    assert model._prepare(ids, mask)[2].shape == (1, 1, 19, 19)
    assert model._prepare(ids, None)[2].shape == (1, 1, 19, 19)
    assert model._prepare(ids.flip(1), mask.flip(1))[2].shape == (3, 1, 19, 19)
    built = []
    real = model_module.sdpa_mask
    monkeypatch.setattr(model_module, "sdpa_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    model.forward_backward([{"input_ids": ids, "attention_mask": mask}] * 3, forward_only=True)
    assert len(built) == 1


def test_bf16_logits_as_close_as_the_unfused_path(tiny_models, mesh1):
    """bfloat16: SDPA keeps its own (fp32) accumulation; its logits are as close to float32
    transformers as the unfused path's (softmax in fp32) are."""
    from transformers import AutoModelForCausalLM

    for arch in ("llama", "mistral"):
        ids, mask = right_padded_batch(1001, (40, 23, 9), seed=3)
        hf = AutoModelForCausalLM.from_pretrained(str(tiny_models / arch), dtype=torch.float32,
                                                  attn_implementation="eager")
        with torch.no_grad():
            ref = hf(input_ids=ids, attention_mask=mask).logits
        valid = mask.bool()
        rel = {}
        for impl in ("sdpa", "unfused"):
            m = mlora.from_pretrained(tiny_models / arch, mesh1, dtype=torch.bfloat16, attention=impl)
            rel[impl] = ((m.logits(ids, mask) - ref)[valid].abs().max() / ref[valid].abs().max()).item()
        print(f"{arch} bf16 relative max diff vs float32 HF: {rel}")
        assert rel["sdpa"] < 0.02 and rel["sdpa"] <= 1.5 * rel["unfused"], rel
