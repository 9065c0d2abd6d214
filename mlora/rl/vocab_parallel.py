"""Log-probs and entropy of chosen tokens from vocab-parallel logits, never gathering the vocabulary.

Each TP rank holds logits ``z[..., v0:v1]`` of its vocabulary shard. Per token only three
scalars cross the TP group: the max (all-reduce max), the sum of exponentials and the chosen
token's logit (all-reduce sum), plus ``Σ p·z`` for the entropy. Gradients flow through the
autograd function to the local logits only.

Sampling temperature ``T``: every quantity is of ``softmax(z / T)``, the distribution vLLM samples
from before truncation. :func:`vocab_parallel_truncation_logmass` adds vLLM's min-p / top-k /
top-p truncation (for comparing with the engine's processed log-probs), again with per-token
scalars only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, group, op) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


class _VocabParallelLogProb(torch.autograd.Function):
    """``log p(y) = u_y - logsumexp(u)`` and ``H = logsumexp(u) - Σ p·u`` over the sharded vocab,
    with ``u = z / T`` (``p = softmax(u)``; the gradient w.r.t. ``z`` is the one w.r.t. ``u`` over ``T``).

    Memory: between forward and backward only per-token scalars are kept (plus the logits,
    which autograd holds anyway); the softmax is recomputed in backward. Logits are the
    largest activation of a language model, so no extra copy of them outlives the forward.
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_valid, group, with_entropy, temperature):
        multi = target.dim() == logits.dim()  # K targets per position ([..., K]): K log-probs, one normaliser
        shifted, gmax = _shifted(logits, vocab_valid, group, temperature=temperature)
        local = target - vocab_start
        in_shard = (local >= 0) & (local < vocab_valid)
        index = local.clamp(0, shifted.shape[-1] - 1)
        if not multi:
            index, in_shard = index[..., None], in_shard[..., None]
        picked = torch.where(in_shard, shifted.gather(-1, index), torch.zeros_like(index, dtype=shifted.dtype))
        exp = shifted.exp()
        stats = [exp.sum(-1, keepdim=True), picked]
        if with_entropy:  # Σ exp(s)·s, as a batched dot product (no temporary of the logits' size)
            stats.append((exp.unsqueeze(-2) @ shifted.clamp(min=-1e4).unsqueeze(-1))[..., 0])
        del exp, shifted
        stacked = torch.cat(stats, -1)  # one all-reduce for every per-token scalar
        _all_reduce(stacked, group, dist.ReduceOp.SUM)
        sum_exp = stacked[..., 0]
        log_z = sum_exp.log()
        mean_shifted = stacked[..., -1] / sum_exp if with_entropy else torch.zeros_like(sum_exp)  # E_p[z - max]
        ctx.save_for_backward(logits, gmax, sum_exp, mean_shifted, index, in_shard)
        ctx.vocab_valid, ctx.with_entropy, ctx.temperature, ctx.multi = vocab_valid, with_entropy, temperature, multi
        entropy = log_z - mean_shifted if with_entropy else torch.zeros_like(log_z)
        logprob = stacked[..., 1:1 + index.shape[-1]] - log_z[..., None]
        return (logprob if multi else logprob[..., 0]), entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        logits, gmax, sum_exp, mean_shifted, index, in_shard = ctx.saved_tensors
        if not ctx.multi:
            grad_logprob = grad_logprob[..., None]
        shifted, _ = _shifted(logits, ctx.vocab_valid, None, gmax, ctx.temperature)
        probs = shifted.exp().div_(sum_exp[..., None])
        total = grad_logprob.sum(-1)  # each target's log-prob shares the normaliser: d/dz_j of it is -p_j
        if ctx.with_entropy:
            # dH/dz_j = -p_j (z_j - E_p[z]);  d log p(y)/dz_j = 1[j = y] - p_j
            grad = shifted.clamp_(min=-1e4).sub_(mean_shifted[..., None]).mul_(grad_entropy[..., None])
            grad.add_(total[..., None]).mul_(probs).neg_()
        else:
            grad = probs.mul_(-total[..., None])
        grad.scatter_add_(-1, index, grad_logprob * in_shard.to(grad.dtype))
        if ctx.temperature != 1.0:  # d/dz = (d/du) / T
            grad.div_(ctx.temperature)
        return grad.to(logits.dtype), None, None, None, None, None, None


def _shifted(logits: torch.Tensor, vocab_valid: int, group, gmax: torch.Tensor | None = None,
             temperature: float = 1.0):
    """``(z - max_global(z)) / T`` in float32 (or wider), with TP-padding columns at -1e30.

    ``gmax`` is the max of the untempered logits (``max(z / T) = max(z) / T`` for ``T > 0``); the
    division happens in place on the one temporary, so temperature costs no extra memory."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if vocab_valid < z.shape[-1]:
        z = z.clone()
        z[..., vocab_valid:] = -1e30
    if gmax is None:
        gmax = z.max(dim=-1).values
        _all_reduce(gmax, group, dist.ReduceOp.MAX)
    shifted = z - gmax[..., None]
    if temperature != 1.0:
        shifted.div_(temperature)
    return shifted, gmax


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0 (log-probs of greedy decoding are not defined)")


def next_token_logits(logits: torch.Tensor) -> torch.Tensor:
    """``logits[:, :-1]`` of batch-major ``[b, s, V]`` logits that are a transposed view of megatron's
    sequence-major ``[s, b, V]`` output, sliced through that sequence-major layout.

    Same values as ``logits[:, :-1]``. The slice's backward then builds its zero-padded gradient
    sequence-major, so the output layer's backward gets a contiguous ``[s, b, V]`` gradient and folds
    it into one GEMM. Sliced batch-major, the gradient arrives strided and torch's CPU matmul falls
    back to a bmm with the ``[V, h]`` weight expanded over the ``s`` batches (on SmolLM2, 4 DPO pairs
    of 192 tokens in bf16: 10.9 GB copied, 13 s of a step).
    """
    return logits.transpose(0, 1)[:-1].transpose(0, 1)


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, vocab_valid: int,
                            group=None, with_entropy: bool = False, temperature: float = 1.0
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``target`` (and entropy) under ``softmax(z / T)``, from this rank's logits shard ``[..., V/TP]``.

    ``target`` is ``[...]`` (one token per position) or ``[..., K]`` (K tokens per position, e.g. a teacher's top-K:
    the log-probs are ``[..., K]``, one normaliser per position).

    ``log p(y) = z_y / T - logsumexp(z / T)``; ``H = -Σ p log p``. ``vocab_start`` is the global id
    of the shard's first column; ``vocab_valid`` how many of its columns are real vocabulary (the
    rest is TP padding). Collective over ``group`` (the TP group; None means the logits hold the
    whole vocabulary and nothing is communicated).
    """
    _check_temperature(temperature)
    logprob, entropy = _VocabParallelLogProb.apply(logits, target, vocab_start, vocab_valid, group, with_entropy,
                                                   float(temperature))
    return logprob, (entropy if with_entropy else None)


# ---------------------------------------------------------------------- vLLM's truncated distribution

_NEG_INF_KEY = -2139095041  # _order_keys(-inf): every finite float32 has a larger key
_CHUNK_ELEMENTS = 1 << 24  # local logits per sort: bounds the temporaries (~20 bytes each) of one chunk


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered like the float32 values ``x``: the IEEE bits, with the magnitude bits of
    negative numbers flipped. Consecutive keys are consecutive floats, so a bisection over keys
    ends on an exact float32 (at most 32 halvings)."""
    bits = x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _key_values(keys: torch.Tensor) -> torch.Tensor:
    """The float32 values of :func:`_order_keys` keys (its inverse)."""
    return torch.where(keys < 0, keys ^ 0x7FFFFFFF, keys).to(torch.int32).view(torch.float32)


def vocab_parallel_truncation_logmass(logits: torch.Tensor, vocab_valid: int, group=None, temperature: float = 1.0,
                                      top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """``log M``: the log of the probability mass that vLLM's sampling filters keep, per token.

    With ``u = z / T`` (float32, as vLLM's ``logits.div_(temperature)``) and ``p = softmax(u)`` over
    the real vocabulary, vLLM 0.32 (``Sampler.sample`` then ``apply_top_k_top_p_pytorch``, the
    native path) keeps, in this order:

    1. min-p: tokens with ``p_i ≥ min_p · max_j p_j`` (``min_p = 0``: all);
    2. top-k: tokens with ``u_i ≥`` the k-th largest remaining ``u`` (ties at the k-th value
       kept; ``top_k ≤ 0`` or ``≥ V``: all);
    3. top-p: with ``p'`` the renormalised distribution of the survivors, token ``i`` is kept
       iff ``Σ_{u_j > u_i} p'_j < top_p`` (vLLM: ascending cumsum ``> 1 - top_p``; the largest
       token is always kept; ``top_p ≥ 1``: all).

    Every step keeps ``{i: u_i ≥ θ}`` for a threshold ``θ``, so ``M = Σ_{u_i ≥ θ} p_i`` and the
    processed log-prob vLLM reports for a sampled token ``y`` (``logprobs_mode=
    "processed_logprobs"``: ``log_softmax`` of the masked logits) is ``log p(y) - log M``.

    Vocab-parallel, never gathering the vocabulary: each TP rank sorts its shard (in chunks of
    tokens) and keeps suffix sums of ``exp(u - max u)`` in float64; ``θ`` of top-k (count of
    ``u ≥ t``) and of top-p (mass of ``u > t``) is found by bisection over the float32 values
    ``t`` (at most 32 steps each, exact), each step one all-reduce of one scalar per token. The
    only difference from vLLM is rounding at the boundary: vLLM decides top-p on float32
    cumulative sums (and splits exact ties by sort order), here float64 sums decide, so a token
    whose cumulative mass lies within float32 rounding of ``1 - top_p`` may fall on the other side.
    """
    _check_temperature(temperature)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p={min_p} must be in [0, 1]")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    width = max(flat.shape[-1], 1)
    step = max(1, _CHUNK_ELEMENTS // width)  # the same on every TP rank: equal shard widths and token counts
    out = [_truncation_logmass_chunk(flat[i:i + step], vocab_valid, group, float(temperature), int(top_k),
                                     float(top_p), float(min_p)) for i in range(0, flat.shape[0], step)]
    return (torch.cat(out) if out else flat.new_zeros(0, dtype=torch.float32)).reshape(lead)


@torch.no_grad()
def _truncation_logmass_chunk(logits: torch.Tensor, vocab_valid: int, group, temperature: float, top_k: int,
                              top_p: float, min_p: float) -> torch.Tensor:
    """:func:`vocab_parallel_truncation_logmass` of ``[N, V/TP]`` logits (one chunk of tokens)."""
    u = logits.to(torch.float32) / temperature  # same rounding as vLLM's in-place division
    if vocab_valid < u.shape[-1]:
        u[:, vocab_valid:] = float("-inf")  # TP padding: never kept, no mass
    umax = u.max(dim=-1).values
    _all_reduce(umax, group, dist.ReduceOp.MAX)
    rel = u - umax[:, None]
    total = rel.double().exp().sum(-1)
    _all_reduce(total, group, dist.ReduceOp.SUM)
    if min_p > 0:  # vLLM: p_i < min_p · p_max  <=>  exp(u_i - max u) < min_p
        u.masked_fill_(rel.exp() < min_p, float("-inf"))
    del rel
    ascending = u.sort(dim=-1).values
    del u
    # suffix sums: mass[:, j] = Σ_{i ≥ j} exp(ascending_i - max u); mass[:, n] = 0
    mass = (ascending.double() - umax.double()[:, None]).exp().flip(-1).cumsum(-1).flip(-1)
    mass = torch.cat([mass, mass.new_zeros(mass.shape[0], 1)], dim=-1)
    n = ascending.shape[-1]

    def reduced(t: torch.Tensor) -> torch.Tensor:
        _all_reduce(t, group, dist.ReduceOp.SUM)
        return t

    def count_at_least(key: torch.Tensor) -> torch.Tensor:  # Σ_ranks #{u ≥ t}
        below = torch.searchsorted(ascending, _key_values(key)[:, None], right=False)[:, 0]
        return reduced((n - below).to(torch.float64))

    def mass_above(key: torch.Tensor, strict: bool) -> torch.Tensor:  # Σ_ranks Σ_{u > t (or ≥ t)} exp(u - max)
        idx = torch.searchsorted(ascending, _key_values(key)[:, None], right=strict)
        return reduced(mass.gather(-1, idx)[:, 0].clone())

    top = _order_keys(umax)
    theta = torch.full_like(top, _NEG_INF_KEY)  # keep every finite value
    if 0 < top_k:
        # largest t with #{u ≥ t} ≥ k: the k-th largest value (k ≥ V: every value, nothing cut)
        lo, hi = theta.clone(), top + 1
        while bool((active := hi - lo > 1).any()):  # the same on every TP rank: lo, hi come from all-reduces
            mid = lo + (hi - lo) // 2
            ok = count_at_least(mid) >= top_k
            lo, hi = torch.where(active & ok, mid, lo), torch.where(active & ~ok, mid, hi)
        theta = lo
    if top_p < 1.0:
        # smallest t ≥ θ with Σ_{u > t} p' < top_p, i.e. mass(u > t) < top_p · mass(u ≥ θ); the max
        # always qualifies (no mass above it), so at least one token is kept
        limit = top_p * mass_above(theta, strict=False)
        lo, hi = theta - 1, top
        while bool((active := hi - lo > 1).any()):
            mid = lo + (hi - lo) // 2
            ok = mass_above(mid, strict=True) < limit
            lo, hi = torch.where(active & ~ok, mid, lo), torch.where(active & ok, mid, hi)
        theta = hi
    kept = mass_above(theta, strict=False)
    return (kept.log() - total.log()).to(torch.float32)


def vocab_parallel_sampling_logprobs(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, vocab_valid: int,
                                     group=None, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                                     min_p: float = 0.0) -> torch.Tensor:
    """Log-prob of ``target`` under the distribution vLLM samples from: ``log p_T(y) - log M``.

    ``p_T = softmax(z / T)``; ``M`` is the mass kept by min-p, top-k and top-p (see
    :func:`vocab_parallel_truncation_logmass`). For a token the filters drop (which vLLM cannot
    have sampled: it happens only when the rollout policy differs from this one, or at a
    rounding tie on the boundary) the value stays finite, ``log p_T(y) - log M``, rather than
    ``-inf``, so that a gap metric over many tokens is not swamped by one. No gradient.
    """
    with torch.no_grad():
        logprob, _ = vocab_parallel_logprobs(logits, target, vocab_start, vocab_valid, group, False, temperature)
        if top_k <= 0 and top_p >= 1.0 and min_p <= 0.0:
            return logprob
        return logprob - vocab_parallel_truncation_logmass(logits, vocab_valid, group, temperature, top_k, top_p,
                                                           min_p)
