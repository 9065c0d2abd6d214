"""fp8="te" decisions computed as on CUDA, with fake Transformer Engine modules (no TE here).

Three faults of the TE path, each checked where mlora decides it:

- token padding: TE's FP8 GEMMs refuse operands whose token count (the product of all dims but the last) is
  not a multiple of 8 (``transformer_engine.pytorch.utils.assert_dim_for_fp8_exec``), 32 for MXFP8
  (``MXFP8Quantizer``); the fake TE linears apply that rule, so a micro-batch of 3x7 tokens fails unless
  mlora pads it;
- the attention mask type: TE's ``thd`` (packed) format asserts a ``padding*`` mask type; the fake TE
  attention applies megatron's rewrite and TE's assertion;
- the FP8 weight cache: megatron's TE linears hand ``is_first_microbatch`` to TE and clear it after each
  call; the fake records the flag of every call, which must be True at the first micro-batch of every
  forward/backward call (as megatron's schedules set it), also under an external ``fp8_autocast``.

What TE computes stays UNVERIFIED (tests/gpu/check_fp8_te.py); the fakes compute exactly (a plain GEMM,
SDPA), so logits must also equal the local spec's.
"""

from __future__ import annotations

import math

import pytest
import torch
from te_stand_ins import TELinearShape

import mlora
from mlora.models import te as fp8_te
from mlora.models.attention import SDPAttention
from mlora.models.packing import PackedRows
from mlora.testing import right_padded_batch

pytestmark = pytest.mark.quick

TOL = 1e-5


def _te_fp8_dims(recipe: str) -> tuple[int, int]:
    """TE's rule for an FP8 GEMM operand, written out here independently of mlora: (tokens, features)
    multiples. transformer_engine/pytorch/utils.py assert_dim_for_fp8_exec: prod(shape[:-1]) % 8 and
    shape[-1] % 16; MXFP8 (constants.MXFP8_BLOCK_SCALING_SIZE = 32, csrc/quantizer.cpp): both % 32."""
    return (32, 32) if recipe == "mxfp8" else (8, 16)


class _FakeTELinear(TELinearShape):
    """megatron's TE linear wrapper as mlora uses it (a local GEMM), with the TE behaviour under test:
    the FP8 shape assertion when the config asks for FP8, and ``is_first_microbatch`` handed to TE and
    cleared after every call (megatron/core/extensions/transformer_engine.py, TELinear.forward)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.is_first_microbatch = True
        self.flags: list[bool] = []  # is_first_microbatch as TE saw it, per call
        self.tokens: list[int] = []

    def forward(self, x):
        self.flags.append(self.is_first_microbatch)
        self.tokens.append(math.prod(x.shape[:-1]))
        if self.config.fp8:
            tokens, features = _te_fp8_dims(self.config.fp8_recipe)
            for t in (x, self.weight):
                if math.prod(t.shape[:-1]) % tokens or t.shape[-1] % features:
                    raise ValueError(f"FP8 execution requires the product of all dimensions except the last to be "
                                     f"divisible by {tokens} and the last dimension by {features}, but got tensor "
                                     f"with dims={list(t.shape)}")
        out = torch.nn.functional.linear(x, self.weight, None if self.skip_bias_add else self.bias)
        self.is_first_microbatch = False
        return out, (self.bias if self.skip_bias_add else None)


class _FakeTEAttention(torch.nn.Module):
    """megatron's TEDotProductAttention: the mask-type rewrite megatron does for ``thd`` (only ``causal`` and
    ``no_mask``) and TE's assertion that ``thd`` takes a padding mask type; computes with SDPAttention."""

    seen: list = []

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type="p2p", pg_collection=None):
        super().__init__()
        self.config = config
        self.attn_mask_type = attn_mask_type
        self.window_size = (-1, -1)  # TE's default for the spec's "arbitrary" mask type
        self.inner = SDPAttention(config, layer_number, attn_mask_type, attention_type,
                                  attention_dropout=attention_dropout, softmax_scale=softmax_scale)

    def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                packed_seq_params=None, num_splits=None):
        from megatron.core.transformer.enums import AttnMaskType

        fmt = packed_seq_params.qkv_format if packed_seq_params is not None else "sbhd"
        if fmt == "thd":
            attn_mask_type = {AttnMaskType.causal: AttnMaskType.padding_causal,
                              AttnMaskType.no_mask: AttnMaskType.padding}.get(attn_mask_type, attn_mask_type)
            assert "padding" in attn_mask_type.name, \
                "Attention mask type must be padding or padding_causal for qkv_format=thd!"
        else:
            assert attn_mask_type != AttnMaskType.arbitrary or attention_mask is not None
        type(self).seen.append((fmt, attn_mask_type, self.window_size))
        return self.inner(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                          packed_seq_params=packed_seq_params)


@pytest.fixture
def fake_te(monkeypatch):
    import megatron.core.extensions.transformer_engine as ext

    class Col(_FakeTELinear):
        mode = "column"

    class Row(_FakeTELinear):
        mode = "row"

    monkeypatch.setattr(ext, "TEColumnParallelLinear", Col, raising=False)
    monkeypatch.setattr(ext, "TERowParallelLinear", Row, raising=False)
    monkeypatch.setattr(ext, "TEDotProductAttention", _FakeTEAttention, raising=False)
    monkeypatch.setattr(fp8_te, "require_te", lambda *a, **k: None)
    monkeypatch.setattr(_FakeTEAttention, "seen", [])
    fp8_te.te_lora_linear_classes.cache_clear()
    yield
    fp8_te.te_lora_linear_classes.cache_clear()


@pytest.fixture(scope="module")
def mesh():
    return mlora.init_parallel(tp=1, pp=1)


def _te_linears(model) -> list[_FakeTELinear]:
    return [m for m in model.gpt.modules() if isinstance(m, _FakeTELinear)]


# ------------------------------------------------------------------ 4. tokens padded to TE's multiples

def test_te_token_multiple_and_padded_length():
    assert [fp8_te.te_token_multiple(r) for r in fp8_te.RECIPES] == [8, 8, 32]
    assert fp8_te.te_token_multiple("tensorwise") == 8  # megatron's name of "current"
    with pytest.raises(ValueError, match=r"unknown FP8 recipe 'fp4'"):
        fp8_te.te_token_multiple("fp4")
    # the smallest length >= seq whose batch * length is a multiple of the token multiple (and of TP under SP)
    assert fp8_te.te_padded_length(3, 7, 1, 8) == 8  # 21 -> 24 tokens
    assert fp8_te.te_padded_length(4, 10, 1, 8) == 10  # 40 tokens: nothing to pad
    assert fp8_te.te_padded_length(2, 13, 1, 8) == 16  # 26 -> 32
    assert fp8_te.te_padded_length(3, 7, 1, 32) == 32  # 96 tokens
    assert fp8_te.te_padded_length(1, 15, 2, 8) == 16
    assert fp8_te.te_padded_length(4, 5, 4, 8) == 8  # SP: a multiple of TP=4 too
    assert fp8_te.te_padded_length(3, 5, 1, 1) == 5  # no FP8: unchanged
    for bad in [(0, 5, 1, 8), (3, 0, 1, 8), (3, 5, 0, 8), (3, 5, 1, 0)]:
        with pytest.raises(ValueError, match="must be >= 1"):
            fp8_te.te_padded_length(*bad)


@pytest.mark.parametrize("recipe", ["delayed", "mxfp8"])
def test_fp8_te_pads_micro_batches_to_te_multiples(fake_te, tiny_models, mesh, recipe):
    """3 rows of 7 tokens (21) and a packed row of 15: TE's FP8 shape rule holds for every GEMM, logits at the
    tokens equal the local spec's (padded positions are masked and dropped)."""
    local = mlora.from_pretrained(tiny_models / "llama", mesh)
    te_model = mlora.from_pretrained(tiny_models / "llama", mesh, fp8="te", fp8_recipe=recipe)
    assert te_model.config.fp8 and _te_linears(te_model)
    multiple = _te_fp8_dims(recipe)[0]
    ids, mask = right_padded_batch(local.spec.vocab_size, (7, 5, 3), seed=1)
    token = mask.bool()
    ref = local.logits(ids, mask)
    got = te_model.logits(ids, mask)
    assert got.shape == ref.shape
    assert (got - ref)[token].abs().max() <= TOL * ref.abs().max()
    packed = PackedRows.of(mask)
    outs = te_model.forward_backward([{"input_ids": packed.pack(ids), "packed": packed}], forward_only=True)
    got_packed = packed.unpack(outs[0][..., : local.spec.vocab_size].float())
    assert (got_packed - ref)[token].abs().max() <= TOL * ref.abs().max()
    seen = {t for m in _te_linears(te_model) for t in m.tokens}
    assert seen and all(t % multiple == 0 for t in seen), seen


# ------------------------------------------------------------------ 5. the mask type from the layout

def test_te_mask_type_follows_the_layout():
    from megatron.core.transformer.enums import AttnMaskType

    assert fp8_te.te_mask_type("thd") == AttnMaskType.padding_causal
    assert fp8_te.te_mask_type("sbhd") == AttnMaskType.arbitrary
    assert fp8_te.te_mask_type("bshd") == AttnMaskType.arbitrary
    with pytest.raises(ValueError, match=r"qkv_format 'hsbd'.*thd, sbhd, bshd"):
        fp8_te.te_mask_type("hsbd")
    # TE's window_size (left, right), inclusive: HF's window w lets a query see w keys, itself included
    assert fp8_te.te_window_size("thd", None) == (-1, 0)
    assert fp8_te.te_window_size("thd", 8) == (7, 0)
    assert fp8_te.te_window_size("sbhd", 8) == (-1, -1)  # the full boolean mask carries the window


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_fp8_te_packed_attention_gets_a_padding_mask_type(fake_te, tiny_models, mesh, arch):
    """Packed micro-batches reach TE's attention as thd with padding_causal (and Mistral's window as TE's
    window_size); padded ones keep the full mask with "arbitrary". Logits equal the local spec's."""
    from megatron.core.transformer.enums import AttnMaskType

    local = mlora.from_pretrained(tiny_models / arch, mesh)
    te_model = mlora.from_pretrained(tiny_models / arch, mesh, fp8="te")
    ids, mask = right_padded_batch(local.spec.vocab_size, (16, 3, 5), seed=2)  # 24 packed, 48 padded
    token = mask.bool()
    ref = local.logits(ids, mask)
    packed = PackedRows.of(mask)
    outs = te_model.forward_backward([{"input_ids": packed.pack(ids), "packed": packed}], forward_only=True)
    window = local.spec.sliding_window
    assert {s for s in _FakeTEAttention.seen} == {("thd", AttnMaskType.padding_causal,
                                                   (window - 1 if window else -1, 0))}
    got = packed.unpack(outs[0][..., : local.spec.vocab_size].float())
    assert (got - ref)[token].abs().max() <= TOL * ref.abs().max()
    _FakeTEAttention.seen.clear()
    got = te_model.logits(ids, mask)
    assert {s[:2] for s in _FakeTEAttention.seen} == {("sbhd", AttnMaskType.arbitrary)}
    assert (got - ref)[token].abs().max() <= TOL * ref.abs().max()


# ------------------------------------------------------------------ 6. the FP8 weight cast per call

def _flag_sequence(model, ids, calls: int, micro_batches: int) -> list[list[bool]]:
    linears = _te_linears(model)
    for m in linears:
        m.flags.clear()
    for _ in range(calls):
        model.forward_backward([{"input_ids": ids}] * micro_batches,
                               lambda logits, mb: (logits.float().logsumexp(-1).mean(), {}))
    return [m.flags for m in linears]


@pytest.mark.parametrize("build", ["external_autocast", "fp8_te"])
def test_te_weight_cast_is_redone_at_each_calls_first_micro_batch(fake_te, tiny_models, mesh, monkeypatch, build):
    """Every TE linear sees is_first_microbatch=True at the first micro-batch of every forward_backward call
    (megatron's schedules: forward_step(is_first_microbatch=i == 0)), False at the others: delayed scaling
    updates its scales after each call, so the cached FP8 weight (first cast at the initial scale of 1) must
    be redone. "external_autocast" is the TE spec with config.fp8 unset under mlora.models.te.fp8_autocast_context
    (tests/gpu/check_fp8_te.py), where megatron's own reset (set_is_first_microbatch) does nothing."""
    if build == "fp8_te":
        model = mlora.from_pretrained(tiny_models / "llama", mesh, fp8="te")
    else:
        import mlora.models.megatron_build as mb

        monkeypatch.setattr(mb, "block_spec", fp8_te.te_block_spec)
        model = mlora.from_pretrained(tiny_models / "llama", mesh)
        assert not model.config.fp8
    model.add_adapter("policy", mlora.LoraConfig(rank=2, alpha=4, target_modules="all-linear"))
    ids, _ = right_padded_batch(model.spec.vocab_size, (8, 8), seed=3)
    with model.use_adapters("policy"):
        flags = _flag_sequence(model, ids, calls=3, micro_batches=2)
    assert len(flags) == 4 * model.spec.num_layers  # qkv, proj, fc1, fc2
    assert all(f == [True, False] * 3 for f in flags), flags[0]
    for m in _te_linears(model):
        m.flags.clear()
    model.logits(ids)
    model.logits(ids)
    assert all(m.flags == [True, True] for m in _te_linears(model))  # forward-only calls too, as megatron's
