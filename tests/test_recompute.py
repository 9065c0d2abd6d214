"""Activation recompute (issue 12, part 2) on one rank: gradients of every LoRA factor and of the value
head with recompute selective / full uniform / full block equal recompute none (float32, 1e-6), LoRA
dropout and the FP8 base included; the recompute really runs; eval passes are unchanged; bad
arguments fail clearly. TP2xPP2 (and SP) is checked in the torchrun launch of
tests/test_lora_equivalence.py (check "recompute")."""

from __future__ import annotations

import pytest
import torch

import mlora
from mlora.models import recompute as rc

pytestmark = pytest.mark.quick

TOL = 1e-6  # float32, absolute and relative
SETTINGS = {
    "selective": dict(recompute="selective"),
    "selective_mlp": dict(recompute="selective", recompute_modules=["core_attn", "mlp"]),
    "full_uniform_1": dict(recompute="full"),
    "full_uniform_2": dict(recompute="full", recompute_method="uniform", recompute_num_layers=2),
    "full_block_3": dict(recompute="full", recompute_method="block", recompute_num_layers=3),
}
LAYERS = 4  # the tiny Llama


@pytest.fixture(scope="module")
def mesh():
    return mlora.init_parallel(tp=1, pp=1)


def _batch():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 1000, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding in one row
    return ids, mask


def _build(tiny_models, mesh, dropout: float = 0.0, **kwargs):
    """The tiny Llama with a trainable ``policy`` and ``critic`` adapter (random B, so that A gets a
    gradient too) and a value head with random weights."""
    model = mlora.from_pretrained(tiny_models / "llama", mesh, **kwargs)
    for name in ("policy", "critic"):
        model.add_adapter(name, mlora.LoraConfig(rank=4, alpha=8, dropout=dropout, seed=3))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.trainable_parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.add_value_head("critic", seed=2, init_std=0.1)
    return model


def _grads(model) -> dict[str, torch.Tensor]:
    """Gradients of an actor loss (logits, ``policy``) and a critic loss (value head on the hidden
    states, ``critic``) over two micro-batches in train mode, by parameter name."""
    ids, mask = _batch()
    mbs = [{"input_ids": ids, "attention_mask": mask}, {"input_ids": ids.flip(0), "attention_mask": mask.flip(0)}]
    lo, hi = model.vocab_shard_range()

    def actor(logits, mb):
        w = torch.linspace(-1, 1, hi - lo)
        return (logits[..., : hi - lo] * w * mb["attention_mask"][..., None]).sum() * 1e-2, {}

    def critic(hidden, mb):
        values = model.heads["critic"](hidden)[..., 0]
        return ((values - 0.5) ** 2 * mb["attention_mask"]).sum(), {}

    for p in model.trainable_parameters():
        p.grad = None
    model.train()
    try:
        with model.use_adapters("policy"):
            model.forward_backward(mbs, actor)
        with model.use_adapters("critic"):
            model.forward_backward(mbs, critic, hidden_states=True)
    finally:
        model.eval()
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{name} got no gradient"
            out[name] = p.grad.clone()
    return out


def _layer_calls(model):
    """Forward calls per decoder layer, core attention and MLP (recompute runs them again)."""
    calls = {}

    def counter(key):
        def hook(module, args, output):
            calls[key] = calls.get(key, 0) + 1
        return hook

    for i, layer in enumerate(model.gpt.decoder.layers):
        layer.register_forward_hook(counter(("layer", i)))
        layer.self_attention.core_attention.register_forward_hook(counter(("core_attn", i)))
        layer.mlp.register_forward_hook(counter(("mlp", i)))
    return calls


def _assert_equal_grads(got: dict, want: dict, relative: bool = False) -> None:
    """Elementwise within TOL (absolute and relative), or with ``relative`` ||g - g0|| / ||g0|| <= TOL per
    tensor."""
    assert got.keys() == want.keys()
    assert any(".lora_A" in k for k in want) and any("heads.critic" in k for k in want)
    for name, g in want.items():
        assert g.abs().sum() > 0, f"{name}: zero gradient without recompute"  # the comparison means something
        if relative:
            assert ((got[name] - g).norm() / g.norm()).item() <= TOL, name
        else:
            torch.testing.assert_close(got[name], g, rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def reference(tiny_models, mesh):
    return _grads(_build(tiny_models, mesh))


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_gradients_equal_without_recompute(tiny_models, mesh, reference, setting):
    model = _build(tiny_models, mesh, **SETTINGS[setting])
    calls = _layer_calls(model)
    got = _grads(model)
    _assert_equal_grads(got, reference)
    # 2 passes (actor, critic) x 2 micro-batches; a recomputed part runs twice per micro-batch
    kwargs = SETTINGS[setting]
    for i in range(LAYERS):
        full = kwargs["recompute"] == "full" and (kwargs.get("recompute_method") != "block"
                                                  or i < kwargs["recompute_num_layers"])
        modules = kwargs.get("recompute_modules", ["core_attn"]) if kwargs["recompute"] == "selective" else []
        assert calls[("layer", i)] == 4 * (2 if full else 1), (setting, i, calls)
        assert calls[("core_attn", i)] == 4 * (2 if full or "core_attn" in modules else 1), (setting, i, calls)
        assert calls[("mlp", i)] == 4 * (2 if full or "mlp" in modules else 1), (setting, i, calls)


def _dropout_calls(model) -> set[int]:
    return {b.dropout_calls for m in model._lora_linears() for b in m.lora.values()}


@pytest.fixture(scope="module")
def dropout_reference(tiny_models, mesh):
    """Gradients with LoRA dropout 0.3 and no recompute; each branch drew masks twice (2 micro-batches)."""
    model = _build(tiny_models, mesh, dropout=0.3)
    grads = _grads(model)
    assert _dropout_calls(model) == {2}
    return grads


@pytest.mark.parametrize("setting", ["full_uniform_1", "full_block_3", "selective_mlp"])
def test_gradients_equal_with_lora_dropout(tiny_models, mesh, dropout_reference, setting):
    """Dropout 0.3: the recompute redraws the original forward's masks (same call index), and the
    counters advance once per forward, not per recompute."""
    model = _build(tiny_models, mesh, dropout=0.3, **SETTINGS[setting])
    _assert_equal_grads(_grads(model), dropout_reference)
    assert _dropout_calls(model) == {2}


def test_dropout_replay_is_what_makes_it_exact(tiny_models, mesh, dropout_reference, monkeypatch):
    """Negative control: without the counters in megatron's RNG states the recompute draws other
    masks and the gradients differ (so the test above can fail)."""
    want = dropout_reference
    model = _build(tiny_models, mesh, dropout=0.3, recompute="full")
    monkeypatch.setattr(rc._DropoutReplay, "set_states", lambda self, states: super(rc._DropoutReplay, self)
                        .set_states(dict(states)))  # the counters left behind
    got = _grads(model)
    assert any(not torch.allclose(got[k], want[k], rtol=TOL, atol=TOL) for k in want if ".lora_" in k)


def test_tracker_states_list_generator_states_only(tiny_models, mesh):
    """The counters ride on the states object, not in it: code that lists megatron's tracker states
    (RNG checkpoints) sees generator states only, and a plain dict handed back leaves them alone."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from mlora.lora.layers import DROPOUT_CALLS

    _build(tiny_models, mesh, dropout=0.3, recompute="full")
    tracker = get_cuda_rng_tracker()
    states = tracker.get_states()
    assert states and all(isinstance(v, torch.Tensor) for v in states.values())
    before = list(DROPOUT_CALLS)
    DROPOUT_CALLS[-1] += 5
    tracker.set_states(dict(states))
    assert DROPOUT_CALLS[-1] == before[-1] + 5
    tracker.set_states(states)
    assert DROPOUT_CALLS == before


def test_frozen_embedding_needs_the_grad_hook(tiny_models, mesh):
    """Negative control of the classic reentrant-checkpoint bug: without the hook that makes the frozen
    embedding's output require grad, the first checkpointed layer's LoRA factors get no gradient."""
    model = _build(tiny_models, mesh, recompute="full")
    model.gpt.embedding._forward_hooks.clear()
    with pytest.raises(AssertionError, match="decoder.layers.0.* got no gradient"):
        _grads(model)


def test_fp8_base_under_recompute(tiny_models, mesh):
    """The forward is bitwise the same; the FP8 input-gradient GEMM then rounds about one float32 ulp
    differently (the recomputed graph hands it another gradient layout), on critic gradients of size
    ~100: compared relative to each tensor's norm."""
    want = _grads(_build(tiny_models, mesh, fp8="torch"))
    _assert_equal_grads(_grads(_build(tiny_models, mesh, fp8="torch", recompute="full")), want, relative=True)


def test_eval_passes_are_unchanged(tiny_models, mesh):
    ids, mask = _batch()
    plain = _build(tiny_models, mesh)
    model = _build(tiny_models, mesh, recompute="full")
    calls = _layer_calls(model)
    torch.testing.assert_close(model.logits(ids, mask), plain.logits(ids, mask), rtol=0, atol=0)
    assert set(calls.values()) == {1}  # megatron recomputes in training mode only
    assert model.config.recompute_granularity == "full" and plain.config.recompute_granularity is None


def test_settings_and_errors(tiny_models, mesh):
    s = rc.recompute_settings("full")
    assert (s.granularity, s.method, s.num_layers) == ("full", "uniform", 1)
    assert s.config_kwargs() == {"recompute_granularity": "full", "recompute_method": "uniform",
                                 "recompute_num_layers": 1}
    assert rc.recompute_settings("selective").config_kwargs() == {"recompute_granularity": "selective",
                                                                  "recompute_modules": ["core_attn"]}
    assert not rc.recompute_settings().enabled
    path = tiny_models / "llama"
    cases = [
        (dict(recompute="all"), r"recompute='all' is not valid; valid: none, selective, full"),
        (dict(recompute="full", recompute_method="random"), r"recompute_method='random' is not valid; valid: "
                                                            r"uniform, block"),
        (dict(recompute="none", recompute_num_layers=2), r"recompute_num_layers=2 applies to recompute=full only"),
        (dict(recompute="selective", recompute_method="block"), r"recompute_method='block' applies to "
                                                                r"recompute=full only \(recompute='selective'\)"),
        (dict(recompute="full", recompute_modules=["mlp"]), r"recompute_modules=\['mlp'\] applies to "
                                                            r"recompute=selective only"),
        (dict(recompute="selective", recompute_modules=["layernorm"]), r"recompute_modules=\['layernorm'\] is not "
                                                                       r"valid; valid: a non-empty list of core_attn, mlp"),
        (dict(recompute="full", recompute_num_layers=0), r"recompute_num_layers=0 is not valid: it must be a positive"),
        (dict(recompute="full", recompute_num_layers=3), r"recompute_num_layers=3 with recompute_method=uniform "
                                                         r"must divide the 4 layers of each pipeline stage; valid: 1, 2, 4"),
        (dict(recompute="full", recompute_method="block", recompute_num_layers=5),
         r"recompute_num_layers=5 with recompute_method=block exceeds the 4 layers of each pipeline stage; "
         r"valid: 1 to 4"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            mlora.from_pretrained(path, mesh, **kwargs)


# ---------------------------------------------------------------------------------------------- config keys
def _compose(tiny_models, *args: str, pp: int = 1):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlora.config.schema import register_schema
    from mlora.config.validate import finalize
    from mlora.train.__main__ import CONFIG_DIR

    overrides = [f"trainer.policy.model.path={tiny_models / 'llama'}",
                 f"trainer.policy.megatron_config.pipeline_model_parallel_size={pp}", *args]
    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="ppo", overrides=overrides))
    notes = finalize(cfg, pp, cuda=False, explicit=[a.split("=", 1)[0] for a in overrides])
    return cfg.trainer, notes


def test_config_keys(tiny_models):
    from mlora.train.from_config import recompute_kwargs

    t, notes = _compose(tiny_models)
    assert t.recompute == "none" and recompute_kwargs(t)["recompute"] == "none"
    t, _ = _compose(tiny_models, "trainer.recompute=full", "trainer.recompute_method=block",
                    "trainer.recompute_num_layers=2", pp=2)
    assert recompute_kwargs(t) == dict(recompute="full", recompute_method="block", recompute_num_layers=2,
                                       recompute_modules=None)
    t, _ = _compose(tiny_models, "trainer.recompute=selective", "trainer.recompute_modules=[core_attn,mlp]")
    assert recompute_kwargs(t)["recompute_modules"] == ["core_attn", "mlp"]
    # SkyRL's switch: true is full recompute (uniform, 1 layer per group), unless trainer.recompute says more
    t, notes = _compose(tiny_models, "trainer.gradient_checkpointing=true")
    assert (t.recompute, t.recompute_method, t.recompute_num_layers) == ("full", None, None)
    assert not any("gradient_checkpointing=" in n for n in notes)
    t, _ = _compose(tiny_models, "trainer.gradient_checkpointing=true", "trainer.recompute=selective")
    assert t.recompute == "selective"
    t, _ = _compose(tiny_models, "trainer.gradient_checkpointing=false")
    assert t.recompute == "none"
    _, notes = _compose(tiny_models, "trainer.gradient_checkpointing_use_reentrant=true")
    assert any(n.startswith("trainer.gradient_checkpointing_use_reentrant=True has no effect") for n in notes)


@pytest.mark.parametrize("args,pp,match", [
    (["trainer.recompute=partial"], 1, r"trainer.recompute='partial' is not valid; valid: none, selective, full"),
    (["trainer.gradient_checkpointing=true", "trainer.recompute=none"], 1,
     r"trainer.gradient_checkpointing=True contradicts trainer.recompute='none'"),
    (["trainer.gradient_checkpointing=false", "trainer.recompute=full"], 1,
     r"trainer.gradient_checkpointing=False contradicts trainer.recompute='full'"),
    (["trainer.recompute_num_layers=2"], 1, r"trainer.recompute_num_layers=2 applies to trainer.recompute=full only "
                                            r"\(trainer.recompute='none'\)"),
    (["trainer.recompute=selective", "trainer.recompute_method=uniform"], 1,
     r"trainer.recompute_method='uniform' applies to trainer.recompute=full only"),
    (["trainer.recompute=full", "trainer.recompute_modules=[mlp]"], 1,
     r"trainer.recompute_modules=\['mlp'\] applies to trainer.recompute=selective only"),
    (["trainer.recompute=full", "trainer.recompute_method=blocks"], 1,
     r"trainer.recompute_method='blocks' is not valid; valid: uniform, block"),
    (["trainer.recompute=full", "trainer.recompute_num_layers=0"], 1,
     r"trainer.recompute_num_layers=0 is not valid: it must be a positive integer"),
    (["trainer.recompute=selective", "trainer.recompute_modules=[layernorm]"], 1,
     r"trainer.recompute_modules=\['layernorm'\] is not valid; valid: a non-empty list of core_attn, mlp"),
    (["trainer.recompute=full", "trainer.recompute_num_layers=4"], 2,
     r"trainer.recompute_num_layers=4 with trainer.recompute_method=uniform must divide the 2 layers of each "
     r"pipeline stage; valid: 1, 2"),
    (["trainer.recompute=full", "trainer.recompute_method=block", "trainer.recompute_num_layers=3"], 2,
     r"trainer.recompute_num_layers=3 with trainer.recompute_method=block exceeds the 2 layers of each pipeline "
     r"stage; valid: 1 to 2"),
])
def test_config_errors(tiny_models, args, pp, match):
    from mlora.config.validate import ConfigError

    with pytest.raises(ConfigError, match=match):
        _compose(tiny_models, *args, pp=pp)


def test_flash_attn_key_chooses_the_core_attention(tiny_models):
    """``trainer.flash_attn`` (SkyRL's key) does what its name says: true is torch's fused SDPA, false
    megatron's unfused DotProductAttention; it is no longer a key with no effect."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from mlora.config.validate import ConfigError
    from mlora.models.attention import SDPAttention
    from mlora.train.from_config import model_kwargs

    for flash, cls in ((True, SDPAttention), (False, DotProductAttention)):
        t, notes = _compose(tiny_models, f"trainer.flash_attn={str(flash).lower()}")
        kwargs = model_kwargs(t)
        assert kwargs["attention"] == ("sdpa" if flash else "unfused")
        assert not [n for n in notes if "flash_attn" in n], notes
        m = mlora.from_pretrained(tiny_models / "llama", mlora.init_parallel(tp=1, pp=1), **kwargs)
        assert {type(layer.self_attention.core_attention) for layer in m.gpt.decoder.layers} == {cls}
    with pytest.raises(ConfigError, match=r"trainer.flash_attn=false selects megatron's unfused core attention .* "
                                          r"trainer.fp8=te uses Transformer Engine's own core attention"):
        _compose(tiny_models, "trainer.flash_attn=false", "trainer.fp8=te", "trainer.dtype=bfloat16")
