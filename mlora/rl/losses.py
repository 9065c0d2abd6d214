"""PPO policy loss, clipped value loss, entropy, and loss aggregation modes."""

from __future__ import annotations

import torch

from mlora.rl.masked import masked_mean, safe_exp

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
                  "token-mean-legacy")


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


def policy_loss(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                agg_mode: str = "token-mean", normalizer: float | None = None, max_seq_len: int | None = None,
                token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with separate low/high clip (DAPO's clip-higher) and optional dual clip.

    ``ρ = exp(clamp(log π - log π_old, -20, 20))`` (SkyRL's ``ppo_policy_loss`` with ``safe_exp_delta``: a
    ratio past ``e^±20`` is held there, and its gradient is zero); per token
    ``ℓ = max(-A·ρ, -A·clip(ρ, 1 - ε_low, 1 + ε_high))``; with dual clip ``c > 1`` and ``A < 0``
    the loss is further capped: ``ℓ = min(ℓ, -A·c)`` (Ye et al., 2020). ``token_weights`` multiplies
    each ``ℓ`` before aggregation (rollout correction: :func:`mlora.rl.rollout_correction.off_policy_correction`'s
    TIS weights and masks). Returns the aggregated loss and metrics (clip fraction, approximate KL to the
    old policy).
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip} must be > 1")
    log_ratio = logprob - old_logprob
    ratio = safe_exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"clipfrac": masked_mean((clipped > unclipped).to(loss.dtype), mask.to(loss.dtype)).detach(),
               "ppo_kl": masked_mean(-log_ratio, mask.to(loss.dtype)).detach()}
    if dual_clip is not None:
        capped = torch.minimum(loss, -advantages * dual_clip)
        loss = torch.where(advantages < 0, capped, loss)
        metrics["dual_clipfrac"] = masked_mean(((advantages < 0) & (capped < torch.maximum(unclipped, clipped)))
                                               .to(loss.dtype), mask.to(loss.dtype)).detach()
    if token_weights is not None:
        loss = loss * token_weights
    return agg_loss(loss, mask, agg_mode, normalizer, max_seq_len), metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_range: float = 0.2, agg_mode: str = "token-mean", normalizer: float | None = None,
               max_seq_len: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: ``½·max((V - R)², (V_old + clip(V - V_old, ±ε) - R)²)``."""
    clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    unclipped = (values - returns).square()
    clipped = (clipped_values - returns).square()
    loss = 0.5 * torch.maximum(unclipped, clipped)
    metrics = {"vf_clipfrac": masked_mean((clipped > unclipped).to(loss.dtype), mask.to(loss.dtype)).detach()}
    return agg_loss(loss, mask, agg_mode, normalizer, max_seq_len), metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``H = logsumexp(z) - Σ softmax(z)·z`` over the last dim (full vocabulary)."""
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)
