"""PPO policy loss, clipped value loss, entropy, and loss aggregation modes."""

from __future__ import annotations

import torch

from mlora.rl.masked import masked_mean
from mlora.rl.policy_losses import PolicyLossParams, token_policy_loss

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
                  "token-mean-legacy", "prompt-mean")


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
             normalizer: float | None = None, max_seq_len: int | None = None) -> torch.Tensor:
    """Reduce a ``[batch, response_len]`` per-token loss to a scalar; ``B`` = rows, ``m`` = the mask.

    - ``token-mean``: ``Σ_{b,t} ℓ·m / Σ m`` (every token weighs the same)
    - ``seq-mean-token-sum``: ``Σ_b Σ_t ℓ·m / B'`` with ``B'`` the rows that have a token (verl's
      ``seq-mean-token-sum``, which leaves fully masked rows out)
    - ``seq-mean-token-mean``: ``Σ_b (Σ_t ℓ·m / max(Σ_t m, 1)) / B`` (SkyRL's ``sequence_mean``)
    - ``seq-mean-token-sum-norm``: ``Σ_b (Σ_t ℓ·m / L) / B`` with the constant ``L = max_seq_len``
      (Dr. GRPO; SkyRL's ``seq_mean_token_sum_norm``): no per-sequence length bias, and the
      scale does not change with the batch's lengths.

      For the two SkyRL modes ``B`` counts every row, empty ones too (a response whose loss mask overlong
      filtering zeroed is still one of the mini-batch's sequences): SkyRL divides by the mini-batch's
      ``batch_size`` (``ppo_utils.py``: ``apply_loss_reduction_to_advantages_minibatch``).
    - ``token-mean-legacy``: ``(Σ ℓ·m / Σ m) / n`` per micro-batch, ``n`` = ``normalizer``, the number
      of micro-batches the mini-batch was cut into (over DP too): summed over them, the mean of their token
      means (SkyRL's ``token_mean_legacy``, its former ``token_mean``; ``None``: one micro-batch).

    ``normalizer`` replaces the denominator (token count or sequence count) so that a loss split
    into micro-batches sums to the mini-batch loss: pass the mini-batch's :func:`loss_normalizer`.
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "prompt-mean":
        raise ValueError("loss aggregation 'prompt-mean' needs the mini-batch's prompt groups: scale the advantages "
                         "with reduction_scale(..., group_size=n) and sum")
    if mode == "token-mean":
        denom = mask.sum().clamp(min=1) if normalizer is None else max(float(normalizer), 1.0)
        return (loss_mat * mask).sum() / denom
    if mode == "token-mean-legacy":
        return (loss_mat * mask).sum() / mask.sum().clamp(min=1) / (1.0 if normalizer is None else float(normalizer))
    if mode == "seq-mean-token-sum":
        per_seq = (loss_mat * mask).sum(-1)
    elif mode == "seq-mean-token-mean":
        per_seq = (loss_mat * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        if max_seq_len is None or max_seq_len < 1:
            raise ValueError(f"loss aggregation 'seq-mean-token-sum-norm' needs max_seq_len >= 1, got {max_seq_len}")
        per_seq = (loss_mat * mask).sum(-1) / max_seq_len
    else:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    # an empty row's per_seq is 0 in every mode: only the divisor tells the modes apart
    denom = loss_normalizer(mask, mode) if normalizer is None else float(normalizer)
    return per_seq.sum() / max(denom, 1.0)


def loss_normalizer(mask: torch.Tensor, mode: str, micro_batch_size: int | None = None) -> float:
    """The denominator :func:`agg_loss` uses for the ``[B, T]`` mask of a whole mini-batch (all DP ranks'
    rows), to pass as its ``normalizer`` for each micro-batch so that their losses sum to the mini-batch's:

    - ``token-mean``: ``Σ m`` (response tokens)
    - ``seq-mean-token-sum``: the rows with at least one response token (verl)
    - ``seq-mean-token-mean``, ``seq-mean-token-sum-norm``: ``B``, every row (SkyRL's ``batch_size``)
    - ``token-mean-legacy``: ``B // micro_batch_size``, the number of micro-batches (``None``: 1)
    """
    if mode == "token-mean":
        return float(mask.sum())
    if mode == "token-mean-legacy":
        return float(mask.shape[0] // micro_batch_size) if micro_batch_size else 1.0
    if mode == "seq-mean-token-sum":
        return float((mask.sum(-1) > 0).sum())
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        return float(mask.shape[0])
    raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")


def reduction_scale(mask: torch.Tensor, mode: str, micro_batch_size: int | None = None,
                    max_seq_len: int | None = None, group_size: int = 1) -> torch.Tensor:
    """``[B, 1]`` factors ``w`` for one mini-batch's ``[B, T]`` loss mask such that ``Σ ℓ·m·w`` is the loss
    reduced by ``mode``; SkyRL multiplies the advantages by them (``apply_loss_reduction_to_advantages_minibatch``)
    and sums every policy loss:

    - ``token-mean``: ``1 / Σ m``
    - ``token-mean-legacy``: ``1 / (Σ m_c · n)`` for chunk ``c`` of ``micro_batch_size`` rows, ``n`` chunks
    - ``seq-mean-token-mean``: ``1 / (B · Σ_t m_b)`` (SkyRL's ``sequence_mean``)
    - ``seq-mean-token-sum-norm``: ``1 / (B · max_seq_len)`` (Dr. GRPO)
    - ``seq-mean-token-sum``: ``1 / B'``, ``B'`` the rows with a token (verl)
    - ``prompt-mean``: ``1 / (P · Σ m_p)`` for the ``P`` prompt groups of ``group_size`` adjacent rows (SkyRL's
      ``prompt_mean``: a token mean within each prompt, then a mean over prompts)

    Counts are clamped at 1, so an empty row or group contributes 0 and still counts in ``B`` (or ``P``)."""
    m = mask.float()
    b = m.shape[0]
    per_row = m.sum(-1)
    if mode == "token-mean":
        w = torch.full((b,), 1.0) / per_row.sum().clamp(min=1)
    elif mode == "token-mean-legacy":
        size = micro_batch_size or b
        if b % size:
            raise ValueError(f"a mini-batch of {b} rows is not a whole number of micro-batches of {size}")
        chunks = per_row.view(-1, size).sum(-1).clamp(min=1)
        w = (1.0 / (chunks * (b // size))).repeat_interleave(size)
    elif mode == "seq-mean-token-mean":
        w = 1.0 / (b * per_row.clamp(min=1))
    elif mode == "seq-mean-token-sum-norm":
        if max_seq_len is None or max_seq_len < 1:
            raise ValueError(f"loss aggregation 'seq-mean-token-sum-norm' needs max_seq_len >= 1, got {max_seq_len}")
        w = torch.full((b,), 1.0 / (b * max_seq_len))
    elif mode == "seq-mean-token-sum":
        w = torch.full((b,), 1.0) / (per_row > 0).sum().clamp(min=1)
    elif mode == "prompt-mean":
        if b % group_size:
            raise ValueError(f"a mini-batch of {b} rows is not a whole number of prompt groups of {group_size}")
        groups = per_row.view(-1, group_size).sum(-1).clamp(min=1)
        w = (1.0 / (groups * (b // group_size))).repeat_interleave(group_size)
    else:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    return w[:, None].to(mask.dtype if mask.is_floating_point() else torch.float32)


def sequence_mean_term(x: torch.Tensor, mask: torch.Tensor, rows: int) -> torch.Tensor:
    """SkyRL's KL loss term: each row's token mean, summed over this micro-batch's rows and divided by the
    mini-batch's ``rows``: over the micro-batches (and DP ranks) it sums to ``mean_b mean_t x``, whatever
    ``loss_reduction`` says (``worker.py``: ``masked_mean(kl, loss_mask, dim=-1).mean()``)."""
    return masked_mean(x, mask.to(x.dtype), dim=-1).sum() / max(rows, 1)


def micro_batch_token_mean_term(x: torch.Tensor, mask: torch.Tensor, rows: int) -> torch.Tensor:
    """SkyRL's entropy loss term: this micro-batch's token mean weighted by its share of the mini-batch's
    ``rows`` (``worker.py``: ``masked_mean(entropy, loss_mask) · microbatch_weight``), whatever
    ``loss_reduction`` says."""
    return masked_mean(x, mask.to(x.dtype)) * (x.shape[0] / max(rows, 1))


def policy_loss(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                agg_mode: str = "token-mean", normalizer: float | None = None, max_seq_len: int | None = None,
                token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (SkyRL's ``regular``; ``dual_clip`` when ``dual_clip`` is set,
    :func:`mlora.rl.policy_losses.ppo_clip`) aggregated by :func:`agg_loss`; ``token_weights`` multiplies each
    token's loss first (rollout correction). Returns the loss and metrics (``clipfrac``, ``ppo_kl``)."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip} must be > 1")
    params = PolicyLossParams(eps_clip_low=clip_low, eps_clip_high=clip_high, clip_ratio_c=dual_clip or 3.0)
    loss, metrics = token_policy_loss("regular" if dual_clip is None else "dual_clip", logprob, old_logprob,
                                      advantages, mask, params)
    if token_weights is not None:
        loss = loss * token_weights
    return agg_loss(loss, mask, agg_mode, normalizer, max_seq_len), metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_range: float | None = 0.2, agg_mode: str = "token-mean", normalizer: float | None = None,
               max_seq_len: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: ``½·max((V - R)², (V_old + clip(V - V_old, ±ε) - R)²)``; ``clip_range`` None:
    ``½·(V - R)²`` (SkyRL's ``ppo_critic_loss`` with ``value_clip`` null)."""
    unclipped = (values - returns).square()
    if clip_range is None:
        return agg_loss(0.5 * unclipped, mask, agg_mode, normalizer, max_seq_len), {"vf_clipfrac": torch.zeros(())}
    clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    clipped = (clipped_values - returns).square()
    loss = 0.5 * torch.maximum(unclipped, clipped)
    metrics = {"vf_clipfrac": masked_mean((clipped > unclipped).to(loss.dtype), mask.to(loss.dtype)).detach()}
    return agg_loss(loss, mask, agg_mode, normalizer, max_seq_len), metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``H = logsumexp(z) - Σ softmax(z)·z`` over the last dim (full vocabulary)."""
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)
