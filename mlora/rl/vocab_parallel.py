"""Log-probs and entropy of chosen tokens from vocab-parallel logits, never gathering the vocabulary.

Each TP rank holds logits ``z[..., v0:v1]`` of its vocabulary shard. Per token only three
scalars cross the TP group: the max (all-reduce max), the sum of exponentials and the chosen
token's logit (all-reduce sum), plus ``Σ p·z`` for the entropy. Gradients flow through the
autograd function to the local logits only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, group, op) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


class _VocabParallelLogProb(torch.autograd.Function):
    """``log p(y) = z_y - logsumexp(z)`` and ``H = logsumexp(z) - Σ p·z`` over the sharded vocab.

    Memory: between forward and backward only per-token scalars are kept (plus the logits,
    which autograd holds anyway); the softmax is recomputed in backward. Logits are the
    largest activation of a language model, so no extra copy of them outlives the forward.
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_valid, group, with_entropy):
        shifted, gmax = _shifted(logits, vocab_valid, group)
        local = target - vocab_start
        in_shard = (local >= 0) & (local < vocab_valid)
        index = local.clamp(0, shifted.shape[-1] - 1)[..., None]
        picked = torch.where(in_shard, shifted.gather(-1, index)[..., 0], torch.zeros_like(gmax))
        exp = shifted.exp()
        stats = [exp.sum(-1), picked]
        if with_entropy:  # Σ exp(s)·s, as a batched dot product (no temporary of the logits' size)
            stats.append((exp.unsqueeze(-2) @ shifted.clamp(min=-1e4).unsqueeze(-1))[..., 0, 0])
        del exp, shifted
        stacked = torch.stack(stats)
        _all_reduce(stacked, group, dist.ReduceOp.SUM)
        sum_exp = stacked[0]
        log_z = sum_exp.log()
        mean_shifted = stacked[2] / sum_exp if with_entropy else torch.zeros_like(sum_exp)  # E_p[z - max]
        ctx.save_for_backward(logits, gmax, sum_exp, mean_shifted, index, in_shard)
        ctx.vocab_valid, ctx.with_entropy = vocab_valid, with_entropy
        entropy = log_z - mean_shifted if with_entropy else torch.zeros_like(log_z)
        return stacked[1] - log_z, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        logits, gmax, sum_exp, mean_shifted, index, in_shard = ctx.saved_tensors
        shifted, _ = _shifted(logits, ctx.vocab_valid, None, gmax)
        probs = shifted.exp().div_(sum_exp[..., None])
        if ctx.with_entropy:
            # dH/dz_j = -p_j (z_j - E_p[z]);  d log p(y)/dz_j = 1[j = y] - p_j
            grad = shifted.clamp_(min=-1e4).sub_(mean_shifted[..., None]).mul_(grad_entropy[..., None])
            grad.add_(grad_logprob[..., None]).mul_(probs).neg_()
        else:
            grad = probs.mul_(-grad_logprob[..., None])
        grad.scatter_add_(-1, index, (grad_logprob * in_shard.to(grad.dtype))[..., None])
        return grad.to(logits.dtype), None, None, None, None, None


def _shifted(logits: torch.Tensor, vocab_valid: int, group, gmax: torch.Tensor | None = None):
    """``z - max_global(z)`` in float32 (or wider), with TP-padding columns at -1e30."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if vocab_valid < z.shape[-1]:
        z = z.clone()
        z[..., vocab_valid:] = -1e30
    if gmax is None:
        gmax = z.max(dim=-1).values
        _all_reduce(gmax, group, dist.ReduceOp.MAX)
    return z - gmax[..., None], gmax


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, vocab_valid: int,
                            group=None, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``target`` (and entropy) from this rank's logits shard ``[..., V/TP]``.

    ``vocab_start`` is the global id of the shard's first column; ``vocab_valid`` how many of its
    columns are real vocabulary (the rest is TP padding). Collective over ``group`` (the TP
    group; None means the logits hold the whole vocabulary and nothing is communicated).
    """
    logprob, entropy = _VocabParallelLogProb.apply(logits, target, vocab_start, vocab_valid, group, with_entropy)
    return logprob, (entropy if with_entropy else None)
