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
    """``log p(y) = z_y - logsumexp(z)`` and ``H = logsumexp(z) - Σ p·z`` over the sharded vocab."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_valid, group, with_entropy):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if vocab_valid < z.shape[-1]:  # padding columns of the last shard never count
            z = z.clone()
            z[..., vocab_valid:] = float("-inf")
        gmax = z.max(dim=-1).values
        _all_reduce(gmax, group, dist.ReduceOp.MAX)
        shifted = torch.nan_to_num(z - gmax[..., None], neginf=-1e30)
        exp = shifted.exp()
        local = target - vocab_start
        in_shard = (local >= 0) & (local < vocab_valid)
        index = local.clamp(0, z.shape[-1] - 1)[..., None]
        picked = torch.where(in_shard, shifted.gather(-1, index)[..., 0], torch.zeros_like(gmax))
        stats = [exp.sum(-1), picked] + ([(exp * shifted.clamp(min=-1e4)).sum(-1)] if with_entropy else [])
        stacked = torch.stack(stats)
        _all_reduce(stacked, group, dist.ReduceOp.SUM)
        sum_exp = stacked[0]
        log_z = sum_exp.log()
        logprob = stacked[1] - log_z
        probs = exp / sum_exp[..., None]
        ctx.with_entropy, ctx.dtype = with_entropy, logits.dtype
        if not with_entropy:
            ctx.save_for_backward(probs, index, in_shard)
            return logprob, torch.zeros_like(logprob)
        mean_shifted = stacked[2] / sum_exp  # E_p[z - max]
        ctx.save_for_backward(probs, index, in_shard, shifted.clamp(min=-1e4), mean_shifted)
        return logprob, log_z - mean_shifted  # H = log Z - E_p[z - max]

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        if ctx.with_entropy:
            probs, index, in_shard, shifted, mean_shifted = ctx.saved_tensors
        else:
            probs, index, in_shard = ctx.saved_tensors
        # d log p(y) / dz_j = 1[j = y] - p_j
        grad = -probs * grad_logprob[..., None]
        grad.scatter_add_(-1, index, (grad_logprob * in_shard.to(grad.dtype))[..., None])
        if ctx.with_entropy:
            # dH/dz_j = -p_j (z_j - E_p[z])
            grad = grad - probs * (shifted - mean_shifted[..., None]) * grad_entropy[..., None]
        return grad.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, vocab_valid: int,
                            group=None, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``target`` (and entropy) from this rank's logits shard ``[..., V/TP]``.

    ``vocab_start`` is the global id of the shard's first column; ``vocab_valid`` how many of its
    columns are real vocabulary (the rest is TP padding). Collective over ``group`` (the TP
    group; None means the logits hold the whole vocabulary and nothing is communicated).
    """
    logprob, entropy = _VocabParallelLogProb.apply(logits, target, vocab_start, vocab_valid, group, with_entropy)
    return logprob, (entropy if with_entropy else None)
