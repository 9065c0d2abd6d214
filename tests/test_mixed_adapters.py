"""Mixed-adapter micro-batches (issue 25, item 4): rows of one micro-batch routed to different adapters.

One mixed forward+backward (``adapter_rows``) must give every row the logits of its own adapter (stacked on
a frozen adapter that applies to all rows) and every adapter the factor gradients of its rows alone: each
is compared with a reference that runs the adapter's rows alone, unrouted (float32: 1e-5 relative; a bf16
base: the bf16 tolerance below). Cases: float32 (the fused ``_LoraLinear``), a bf16 base with float32
LoRA (the ``branch_deltas`` path), ``fp8="torch"``, a packed micro-batch, the Transformer Engine spec with
stand-ins for TE, dropout replayed under full recompute. The routed linear itself is checked in float64
against the masked composition of ``lora_delta``. The torchrun launch covers TP2xPP2 + SP with full
recompute under 1F1B and TP2xDP2 with an adapter that has rows on one DP rank only
(``tests/dist/mixed_adapters.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mlora
from mlora.lora.layers import LoraBranch, add_deltas, branch_deltas, lora_delta, lora_linear
from mlora.lora.routing import ROUTES, row_route, sequence_route
from mlora.testing import right_padded_batch
from mlora.train.micro_batches import micro_batch, unpack_tokens

ROWS = {"a": [0, 2], "b": [1, 4], "c": [3]}  # rows [a, b, a, c, b]
LENS = (12, 9, 12, 7, 10)
# relative, logits and factor gradients. A bf16 base: the gradients reach the factors through bf16 GEMMs whose
# rounding depends on the rows of the batch (1.9% measured between two unrouted runs that differ in one row)
TOL = {"float32": 1e-5, "bf16": 5e-2, "fp8": 1e-5, "packed": 1e-5, "te": 1e-5}
MIN_EFFECT = 1e-2  # the adapters' logits differ by this much (relative): a misrouted row cannot pass


# ------------------------------------------------------------------ the routed linear, float64

def _branch(site, subs, seed, dropout=0.0, trainable=True):
    g = torch.Generator().manual_seed(seed)
    r = 3
    a = torch.randn(len(subs) * r, site.in_local, generator=g, dtype=torch.float64)
    local = {sub: size * site.groups for sub, (_, size) in zip(site.subs, site.placement)} or {site.subs[0]: None}
    bs = [torch.randn(local[sub] or site.out_full[0], r, generator=g, dtype=torch.float64) for sub in subs]
    return LoraBranch(subs, r, 1.5, dropout, a, bs, trainable=trainable, parallel=site.parallel)


def _token_mask(route, tokens):
    if route is None:
        return torch.ones(tokens, 1, dtype=torch.float64)
    mask = torch.zeros(tokens, 1, dtype=torch.float64)
    for seg in route:
        mask[seg] = 1
    return mask


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("site_name", ["qkv", "fc1", "row"])
def test_routed_linear_equals_masked_reference(site_name, layout):
    """Forward and every gradient of the fused routed linear equal the base plus each branch's delta
    masked to its tokens (autograd); q/k/v over two interleaved query groups, gate/up, row-parallel."""
    from test_lora_linear import FC1, QKV, ROW

    site = {"qkv": QKV, "fc1": FC1, "row": ROW}[site_name]
    out_local = site.groups * site.block if site.parallel == "column" else site.out_full[0]
    seq, batch = (4, 6) if layout == "padded" else (24, 1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(seq, batch, site.in_local, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(out_local, site.in_local, generator=g, dtype=torch.float64)
    bias = torch.randn(out_local, generator=g, dtype=torch.float64, requires_grad=True)
    subs = site.subs[::2] if site_name == "qkv" else site.subs  # q and v only: a projection left unplaced
    branches = [_branch(site, subs, 2), _branch(site, site.subs, 3), _branch(site, site.subs, 4),
                _branch(site, site.subs, 5, trainable=False)]
    if layout == "padded":  # rows 0 and 3 of 6 merge into one slice of step 3
        routes = [row_route([0, 3], 6), row_route([1, 2, 5], 6), row_route([4], 6), None]
        assert routes[0] == (slice(0, None, 3),) and len(routes[1]) == 3
    else:
        starts, lengths = [0, 5, 9, 15, 20], [5, 4, 6, 5, 3]  # 23 tokens of 24: a padding token at the end
        routes = [sequence_route([0, 1, 3], starts, lengths), sequence_route([2], starts, lengths),
                  sequence_route([4], starts, lengths), None]
        assert routes[0] == (slice(0, 9), slice(15, 20))
    tokens = seq * batch
    grad_out = torch.randn(seq, batch, out_local, generator=g, dtype=torch.float64)
    params = [p for b in branches for p in b.parameters() if p.requires_grad]

    def grads(out):
        return [out.detach(), *torch.autograd.grad(out, [x, bias, *params], grad_out)]

    def masked(br, route):
        return (lora_delta(br, x, site).reshape(tokens, -1) * _token_mask(route, tokens)).view(seq, batch, -1)

    ref = grads(F.linear(x, weight, bias) + sum(masked(br, route) for br, route in zip(branches, routes)))
    got = grads(lora_linear(x, weight, bias, branches, site, routes=routes))
    slow = grads(add_deltas(F.linear(x, weight, bias), branch_deltas(branches, x, site, routes)))
    for r, o, s in zip(ref, got, slow):
        torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s, r, rtol=1e-12, atol=1e-12)


def test_routed_dropout_fused_equals_the_delta_path():
    """With dropout a routed branch draws its masks for its own tokens; the fused linear and the delta path
    (bf16 base, FP8, TE) draw the same ones, and a replay of the counters redraws them."""
    from test_lora_linear import QKV as site

    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 5, site.in_local, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(site.groups * site.block, site.in_local, generator=g, dtype=torch.float64)
    branches = [_branch(site, site.subs, 2, dropout=0.4), _branch(site, site.subs, 3, dropout=0.4)]
    for b in branches:
        b.train()
    routes = [row_route([0, 2, 3], 5), row_route([1, 4], 5)]
    grad_out = torch.randn(4, 5, site.groups * site.block, generator=g, dtype=torch.float64)
    params = [p for b in branches for p in b.parameters()]

    def run(fn):
        calls = [b.dropout_calls for b in branches]
        out = fn()
        for b, c in zip(branches, calls):
            b.dropout_calls = c
        return [out.detach(), *torch.autograd.grad(out, [x, *params], grad_out)]

    fused = run(lambda: lora_linear(x, weight, None, branches, site, routes=routes))
    again = run(lambda: lora_linear(x, weight, None, branches, site, routes=routes))
    slow = run(lambda: add_deltas(F.linear(x, weight), branch_deltas(branches, x, site, routes)))
    for b in branches:
        b.eval()
    undropped = lora_linear(x, weight, None, branches, site, routes=routes).detach()
    assert (fused[0] - undropped).abs().max() > 1e-3  # dropout did act
    for f, a, s in zip(fused, again, slow):
        assert torch.equal(f, a)
        torch.testing.assert_close(s, f, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ the model: mixed vs per adapter

def _adapters(model, dropout: float = 0.0) -> None:
    """Frozen ``sft`` (on every row) and trainable ``a``, ``b``, ``c``, all with random A and B."""
    model.add_adapter("sft", mlora.LoraConfig(rank=4, alpha=8, seed=11), trainable=False)
    for i, name in enumerate(ROWS):
        model.add_adapter(name, mlora.LoraConfig(rank=4 + 2 * i, alpha=8, dropout=dropout, seed=i))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name in ("sft", *ROWS):
            for p in model.adapter_parameters(name):
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.1)


def _nll(vocab: int):
    """Sum over rows of each row's next-token NLL; the metrics carry the padded-layout logits."""
    def loss_fn(logits, mb):
        logits = unpack_tokens(logits, mb, 0)[..., :vocab].float()
        ids, mask = mb["ids"], mb["mask"]
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        return -(logp * mask[:, 1:]).sum(), {"logits": logits.detach()}
    return loss_fn


def _micro_batch(model, rows, packed: bool, adapter_rows=None):
    ids, mask = right_padded_batch(model.spec.vocab_size, LENS, seed=3)
    rows = torch.tensor(rows)
    mb = micro_batch(ids, mask, rows, {"ids": ids, "mask": mask}, packed, model.mesh.device)
    if adapter_rows is not None:
        mb["adapter_rows"] = adapter_rows
    return mb


def _run(model, mbs, active, train: bool = False):
    """Logits per micro-batch and the gradients of every trainable factor (by parameter name)."""
    for p in model.trainable_parameters():
        p.grad = None
    model.train(train)
    with model.use_adapters(*active):
        outs = model.forward_backward(mbs, _nll(model.spec.vocab_size))
    model.eval()
    grads = {n: p.grad.clone() for n, p in model.gpt.named_parameters() if p.grad is not None}
    return [o["logits"] for o in outs], grads


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _check_mixed(model, tol: float, packed: bool = False) -> None:
    every = sorted(r for rows in ROWS.values() for r in rows)
    (mixed,), mixed_grads = _run(model, [_micro_batch(model, every, packed, ROWS)], ("sft", *ROWS))
    _, mask = right_padded_batch(model.spec.vocab_size, LENS, seed=3)
    refs = {}
    for name, rows in ROWS.items():
        (logits,), grads = _run(model, [_micro_batch(model, rows, packed)], ("sft", name))
        valid = mask[rows].bool()
        refs[name] = logits[valid]
        assert _rel(mixed[rows][valid], logits[valid]) <= tol, name
        names = [n for n, _ in model.gpt.named_parameters() if f".lora.{name}." in n]
        assert names and set(n for n in grads if ".lora." in n) == set(names)
        for n in names:
            assert mixed_grads[n].abs().sum() > 0, n
            assert _rel(mixed_grads[n], grads[n]) <= tol, (n, _rel(mixed_grads[n], grads[n]))
    assert not any(".lora.sft." in n for n in mixed_grads)  # frozen
    assert not ROUTES  # cleared after the call
    # the test can fail: rows of different adapters get clearly different logits
    (both,), _ = _run(model, [_micro_batch(model, ROWS["a"], packed)], ("sft", "b"))
    assert _rel(both[mask[ROWS["a"]].bool()], refs["a"]) > MIN_EFFECT


def test_mixed_micro_batch_float32(model):
    _adapters(model)
    _check_mixed(model, TOL["float32"])


def test_mixed_micro_batch_packed(model):
    _adapters(model)
    _check_mixed(model, TOL["packed"], packed=True)


@pytest.fixture(scope="module")
def mesh1():
    return mlora.init_parallel(tp=1, pp=1)


def test_mixed_micro_batch_bf16_base_float32_lora(tiny_models, mesh1):
    model = mlora.from_pretrained(tiny_models / "llama", mesh1, dtype=torch.bfloat16)
    _adapters(model)
    _check_mixed(model, TOL["bf16"])


def test_mixed_micro_batch_fp8(tiny_models, mesh1):
    model = mlora.from_pretrained(tiny_models / "llama", mesh1, fp8="torch")
    _adapters(model)
    _check_mixed(model, TOL["fp8"])


def test_mixed_micro_batch_te_spec_with_stand_in_te(tiny_models, mesh1, monkeypatch):
    """The Transformer Engine LoRA linears route like the local spec (stand-ins for TE's GEMMs)."""
    from test_fp8_te import _install_stand_ins, _te_model

    from mlora.models import te as fp8_te

    _install_stand_ins(monkeypatch.setattr)
    try:
        model = _te_model(mlora, tiny_models / "llama", mesh1, monkeypatch.setattr)
        assert fp8_te.is_te_lora_linear(model.gpt.decoder.layers[0].mlp.linear_fc1)
        _adapters(model)
        _check_mixed(model, TOL["te"])
    finally:
        fp8_te.te_lora_linear_classes.cache_clear()


def test_unrouted_path_unchanged(model):
    """No ``adapter_rows``, an empty one, and every row named: bit-identical results."""
    _adapters(model)
    every = list(range(len(LENS)))
    base = _run(model, [_micro_batch(model, every, False)], ("sft", "a"))
    for rows in ({}, {"a": every}, {"a": every[::-1], "sft": every}):
        got = _run(model, [_micro_batch(model, every, False, rows)], ("sft", "a"))
        assert torch.equal(got[0][0], base[0][0]) and got[1].keys() == base[1].keys()
        assert all(torch.equal(got[1][n], g) for n, g in base[1].items())


def test_adapter_with_no_rows_applies_nowhere(model):
    """An adapter named with no rows gets no compute and no gradient: as if it were not active."""
    _adapters(model)
    every = list(range(len(LENS)))
    rows = {"a": [0, 2], "b": [1, 3, 4]}
    without = _run(model, [_micro_batch(model, every, False, rows)], ("sft", "a", "b"))
    got = _run(model, [_micro_batch(model, every, False, {**rows, "c": []})], ("sft", "a", "b", "c"))
    assert torch.equal(got[0][0], without[0][0]) and got[1].keys() == without[1].keys()
    assert not any(".lora.c." in n for n in got[1])


def test_routes_replayed_under_recompute_with_dropout(tiny_models, mesh1):
    """Full recompute reruns each layer's forward in the backward, after forward_step cleared the routes:
    the routes (and the dropout counters) travel with megatron's RNG states, so the gradients of two
    differently routed micro-batches with LoRA dropout equal those without recompute."""
    results = []
    for recompute in ("none", "full"):
        model = mlora.from_pretrained(tiny_models / "llama", mesh1, recompute=recompute)
        _adapters(model, dropout=0.3)
        every = list(range(len(LENS)))
        mbs = [_micro_batch(model, every, False, ROWS), _micro_batch(model, every, False, {"a": [4], "c": [0, 1]})]
        results.append(_run(model, mbs, ("sft", *ROWS), train=True))
    (plain_logits, plain), (re_logits, re) = results
    assert plain.keys() == re.keys() and any(".lora.c." in n for n in plain)
    for n, g in plain.items():
        assert _rel(re[n], g) <= 1e-6, n
    for a, b in zip(plain_logits, re_logits):
        assert torch.equal(a, b)


def test_bad_adapter_rows(model):
    _adapters(model)
    every = list(range(len(LENS)))
    cases = [({"zzz": [0]}, r"adapter_rows names adapters \['zzz'\] that are not active; active: \['sft', 'a'\]"),
             ({"b": [0]}, r"names adapters \['b'\] that are not active"),
             ({"a": [5]}, r"adapter_rows\['a'\]: row indices \[5\] are out of range; this micro-batch has 5 rows"),
             ({"a": [-1]}, r"row indices \[-1\] are out of range"),
             ({"a": [1, 1]}, r"row indices repeat"),
             ({"a": [0.5]}, r"row indices must be integers"),
             ([("a", [0])], r"adapter_rows must map adapter names to row indices")]
    for rows, match in cases:
        with model.use_adapters("sft", "a"), pytest.raises(ValueError, match=match):
            model.forward_backward([_micro_batch(model, every, False, rows)], _nll(model.spec.vocab_size))
        assert not ROUTES
    packed = _micro_batch(model, [0, 1, 2], True, {"a": [3]})  # 3 packed sequences
    with model.use_adapters("sft", "a"), pytest.raises(ValueError, match=r"this micro-batch has 3 rows"):
        model.forward_backward([packed], _nll(model.spec.vocab_size))


def test_mixed_adapters_at_tp2_pp2_sp_recompute_and_dp2(tiny_models, tmp_path):
    """One 4-rank launch: TP2xPP2 + SP with full recompute and three micro-batches (1F1B), mixed vs per
    adapter; TP2xDP2 with an adapter routed to rows of DP rank 0 only and one to no row at all, whose
    gradients after finalize_grads are the sum over DP ranks (and none)."""
    from conftest import run_records

    records = run_records(4, "mixed_adapters.py", tmp_path / "out.json", str(tiny_models / "llama"),
                          str(tmp_path / "out.json"))
    checks = {r["check"] for r in records}
    assert {"pp_logits", "pp_grads", "dp_grads", "dp_unrouted"} <= checks, checks
    for r in records:
        if r["check"] in ("pp_logits", "pp_grads", "dp_grads"):
            assert r["count"] > 0 and r["max_rel"] <= 1e-5 and r["min_norm"] > 0, r
            assert not r["missing"], r
        if r["check"] == "dp_unrouted":  # DP rank 1 had no gradient of c before the reduction, d none anywhere
            assert r["with_grad"] == [] and r["had_c"] == (r["dp_rank"] == 0), r
