"""Rollout correction: the trainer learns from samples drawn by the engine's distribution μ (vLLM, bf16 or a
stale adapter) while PPO's ratio assumes they came from π_old (the trainer's own log-probs at the start of
the step). Per token ``ρ_t = π_old(a_t|s_t) / μ(a_t|s_t)``; the functions here turn ``ρ`` into loss
weights (truncated importance sampling, TIS) and masks, under SkyRL's names
(``trainer.algorithm.off_policy_correction``) and meanings, and SkyRL's ``rollout_is`` policy loss.

All functions are pure: per-token log-probs ``[B, T]`` and the response mask in, tensors and float metrics
out. The mask functions take the raw per-token ``log ρ_t`` and clamp where SkyRL does
(``off_policy_correction_utils.py``): each token's ratio is ``exp(clamp(log ρ_t, ±20))``, a sequence's is
``exp(clamp(Σ_t log ρ_t, ±20))``, the sum of the unclamped log-ratios clamped once. The engine passes the
log-probs of the sampled tokens only, which every TP rank already has after the vocab-parallel log-softmax
(:mod:`mlora.rl.vocab_parallel`): nothing here depends on the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlora.rl.kl import kl_penalty
from mlora.rl.losses import agg_loss
from mlora.rl.masked import masked_mean, masked_std, safe_exp
from mlora.rl.policy_losses import PolicyLossParams, token_policy_loss

TIS_RATIO_TYPES = ("token", "sequence")
SEQUENCE_MASK_METRICS = ("product", "geometric")


@dataclass(frozen=True)
class OffPolicyCorrection:
    """SkyRL's ``off_policy_correction`` settings (same names, same defaults); all off by default."""

    tis_ratio_type: str | None = None  # None | token | sequence
    token_tis_ratio_clip_high: float = 2.0
    sequence_tis_ratio_clip_high: float = 5.0
    sequence_mask_metric: str | None = None  # None | product | geometric
    geo_mask_high: float = 1.01
    geo_mask_low: float = 0.99
    product_mask_high: float = 2.0
    product_mask_low: float = 0.5
    outlier_token_is_threshold_low: float | None = None
    outlier_token_is_threshold_high: float | None = None
    token_mask_is_threshold_low: float | None = None
    token_mask_is_threshold_high: float | None = None

    def __post_init__(self) -> None:
        if self.tis_ratio_type not in (None,) + TIS_RATIO_TYPES:
            raise ValueError(f"off_policy_correction.tis_ratio_type={self.tis_ratio_type!r}; valid: null, "
                             f"{', '.join(TIS_RATIO_TYPES)}")
        if self.sequence_mask_metric not in (None,) + SEQUENCE_MASK_METRICS:
            raise ValueError(f"off_policy_correction.sequence_mask_metric={self.sequence_mask_metric!r}; valid: "
                             f"null, {', '.join(SEQUENCE_MASK_METRICS)}")
        for name in ("token_tis_ratio_clip_high", "sequence_tis_ratio_clip_high"):
            if not getattr(self, name) > 0:
                raise ValueError(f"off_policy_correction.{name}={getattr(self, name)} must be > 0")
        for low, high in (("geo_mask_low", "geo_mask_high"), ("product_mask_low", "product_mask_high"),
                          ("outlier_token_is_threshold_low", "outlier_token_is_threshold_high"),
                          ("token_mask_is_threshold_low", "token_mask_is_threshold_high")):
            lo, hi = getattr(self, low), getattr(self, high)
            if lo is not None and hi is not None and not lo < hi:
                raise ValueError(f"off_policy_correction.{low}={lo} must be below {high}={hi}")
        if (self.token_mask_is_threshold_low is None) != (self.token_mask_is_threshold_high is None):
            raise ValueError("off_policy_correction.token_mask_is_threshold_low and token_mask_is_threshold_high "
                             "work together (tokens outside [low, high] are masked): set both or neither")

    @property
    def outlier_mask(self) -> bool:
        return self.outlier_token_is_threshold_low is not None or self.outlier_token_is_threshold_high is not None

    @property
    def token_mask(self) -> bool:
        return self.token_mask_is_threshold_low is not None

    @property
    def enabled(self) -> bool:
        """Whether any correction applies (TIS, a sequence, outlier or token mask)."""
        return (self.tis_ratio_type is not None or self.sequence_mask_metric is not None or self.outlier_mask
                or self.token_mask)


def log_ratio(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor) -> torch.Tensor:
    """``log ρ_t = log π_old - log μ``, unclamped: a sequence's ratio sums these before its one clamp."""
    return old_logprob - rollout_logprob


def token_tis_weights(log_rho: torch.Tensor, mask: torch.Tensor, cap: float) -> tuple[torch.Tensor, dict]:
    """Token TIS: ``w_t = min(ρ_t, C)``, ``ρ_t = exp(clamp(log ρ_t, ±20))`` (Yao et al. 2025). Metric: the
    share of response tokens capped."""
    rho = safe_exp(log_rho)
    capped = (rho > cap) & (mask > 0)
    return rho.clamp(max=cap), {"tis_token_clip_high_ratio": float(capped.sum() / (mask > 0).sum().clamp(min=1))}


def sequence_tis_weights(log_rho: torch.Tensor, mask: torch.Tensor, cap: float) -> tuple[torch.Tensor, dict]:
    """Sequence TIS: ``w = min(exp(clamp(Σ_t log ρ_t·m_t, ±20)), C)`` per sequence, ``[B, 1]`` (Liu et al.
    2025): the unclamped token log-ratios summed, the sum clamped once (SkyRL's ``compute_tis_ratio``). Metric:
    the share of sequences capped."""
    rho = safe_exp((log_rho * mask).sum(-1, keepdim=True))
    return rho.clamp(max=cap), {"tis_seq_clip_high_ratio": float((rho > cap).float().mean())}


def sequence_mask(log_rho: torch.Tensor, mask: torch.Tensor, metric: str, low: float, high: float
                  ) -> tuple[torch.Tensor, dict]:
    """``[B, 1]``: 1 where the sequence's ratio is in ``[low, high]``, else 0. ``metric="product"``:
    ``exp(clamp(Σ_t log ρ_t·m_t, ±20))``; ``"geometric"``: ``exp(clamp(Σ_t log ρ_t·m_t / T, ±20))`` over the
    sequence's ``T`` response tokens, the unclamped log-ratios summed (SkyRL's ``compute_sequence_mask``).
    Metrics: the shares of sequences masked, over ``high`` and under ``low`` (SkyRL's names)."""
    total = (log_rho * mask).sum(-1, keepdim=True)
    if metric == "geometric":
        total = total / mask.sum(-1, keepdim=True).clamp(min=1)
    elif metric != "product":
        raise ValueError(f"sequence_mask_metric={metric!r}; valid: {', '.join(SEQUENCE_MASK_METRICS)}")
    rho = safe_exp(total)
    over, under = rho > high, rho < low
    keep = ~over & ~under
    name = "geo" if metric == "geometric" else "product"
    return keep.to(mask.dtype), {f"{name}_sequence_mask_masked_ratio": float((~keep).float().mean()),
                                 f"{name}_sequence_mask_over_high_ratio": float(over.float().mean()),
                                 f"{name}_sequence_mask_under_low_ratio": float(under.float().mean())}


def outlier_token_mask(log_rho: torch.Tensor, mask: torch.Tensor, low: float | None, high: float | None
                       ) -> tuple[torch.Tensor, dict]:
    """``[B, 1]``: 0 for a sequence in which any response token has ``ρ_t < low`` or ``ρ_t > high`` (either
    bound may be None: no bound), else 1; ``ρ_t = exp(clamp(log ρ_t, ±20))``."""
    rho, valid = safe_exp(log_rho), mask > 0
    over = (rho > high) & valid if high is not None else torch.zeros_like(valid)
    under = (rho < low) & valid if low is not None else torch.zeros_like(valid)
    keep = ~(over | under).any(-1, keepdim=True)
    return keep.to(mask.dtype), {"outlier_seq_masked_ratio": float((~keep).float().mean()),
                                 "outlier_seq_over_high_ratio": float(over.any(-1).float().mean()),
                                 "outlier_seq_under_low_ratio": float(under.any(-1).float().mean())}


def token_mask(log_rho: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> tuple[torch.Tensor, dict]:
    """Per-token mask (IcePop): ``m_t = 1`` if ``low ≤ ρ_t ≤ high`` else 0, ``ρ_t = exp(clamp(log ρ_t, ±20))``.
    Metric: the share of response tokens masked."""
    rho, valid = safe_exp(log_rho), mask > 0
    inside = (rho >= low) & (rho <= high)
    return (inside | ~valid).to(mask.dtype), {
        "token_mask_ratio": float((~inside & valid).sum() / valid.sum().clamp(min=1))}


def off_policy_correction(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor,
                          cfg: OffPolicyCorrection) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token factor ``f`` the policy-gradient loss is multiplied by, and the step's metrics.

    ``f = w · M_outlier · M_token · M_seq`` with ``w`` the token or sequence TIS weight (1 without TIS) and
    each mask 1 where that check is off. The masks are computed in SkyRL's order (outlier, token, then TIS and
    the sequence mask on what is left), so a token another mask removed counts as absent for the later ones.
    Masked terms are zeroed, not dropped: the loss's normalizer (token or sequence count) stays the
    uncorrected one, as in SkyRL. ``f`` carries no gradient (``ρ`` does not depend on the weights trained).

    Metrics (also when no correction is on, so a run sees its mismatch), of ``ρ_t = exp(clamp(log ρ_t, ±20))``
    over response tokens: ``is_ratio_mean``, ``is_ratio_std`` (unbiased), ``is_ratio_max``, ``is_ratio_min``
    (SkyRL's ``compute_off_policy_correction`` takes std, max and min of ``ρ·m`` over every position, padding
    as zeros, so its min is 0 once a row is padded: here padding is left out); ``rollout_kl_k3``
    (``KL(μ ‖ π_old)`` by k3 over response tokens), and each enabled check's shares.
    """
    mask = mask.to(old_logprob.dtype)
    log_rho = log_ratio(old_logprob, rollout_logprob).detach()
    rho, valid = safe_exp(log_rho), mask > 0
    metrics = {"is_ratio_mean": float(masked_mean(rho, mask)),
               "is_ratio_std": float(masked_std(rho, mask)),
               "is_ratio_max": float(rho[valid].max()) if valid.any() else 1.0,
               "is_ratio_min": float(rho[valid].min()) if valid.any() else 1.0,
               "rollout_kl_k3": float(masked_mean(kl_penalty(rollout_logprob, old_logprob, "k3"), mask))}
    factor = torch.ones_like(log_rho)
    if cfg.outlier_mask:
        m, more = outlier_token_mask(log_rho, mask, cfg.outlier_token_is_threshold_low,
                                     cfg.outlier_token_is_threshold_high)
        mask, factor = mask * m, factor * m
        metrics.update(more)
    if cfg.token_mask:
        m, more = token_mask(log_rho, mask, cfg.token_mask_is_threshold_low, cfg.token_mask_is_threshold_high)
        mask, factor = mask * m, factor * m
        metrics.update(more)
    if cfg.tis_ratio_type == "token":
        w, more = token_tis_weights(log_rho, mask, cfg.token_tis_ratio_clip_high)
        factor = factor * w
        metrics.update(more)
    elif cfg.tis_ratio_type == "sequence":
        w, more = sequence_tis_weights(log_rho, mask, cfg.sequence_tis_ratio_clip_high)
        factor = factor * w
        metrics.update(more)
    if cfg.sequence_mask_metric is not None:
        geo = cfg.sequence_mask_metric == "geometric"
        m, more = sequence_mask(log_rho, mask, cfg.sequence_mask_metric,
                                cfg.geo_mask_low if geo else cfg.product_mask_low,
                                cfg.geo_mask_high if geo else cfg.product_mask_high)
        factor = factor * m
        metrics.update(more)
    return factor, metrics


def rollout_is_loss(logprob: torch.Tensor, rollout_logprob: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                    token_weights: torch.Tensor | None = None, agg_mode: str = "token-mean",
                    normalizer: float | None = None, max_seq_len: int | None = None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SkyRL's ``rollout_is`` policy loss (GLM-5 §4.1.2; :func:`mlora.rl.policy_losses.rollout_is`):
    ``r_t = exp(clamp(log π - log μ, ±20))``, ``f(r) = r`` if ``1 - ε_low < r < 1 + ε_high`` else 0, per token
    ``ℓ_t = -sg(f(r_t)) · A_t · log π_t`` (times ``token_weights``, e.g. :func:`off_policy_correction`'s factor),
    aggregated by :func:`~mlora.rl.losses.agg_loss`. Its gradient is ``-f(r_t)·A_t·∇log π_t``: the policy gradient
    with the sampling distribution's ratio, tokens outside the region contributing nothing. Metric ``clipfrac``:
    the share of response tokens outside the region."""
    params = PolicyLossParams(eps_clip_low=clip_low, eps_clip_high=clip_high)
    loss, metrics = token_policy_loss("rollout_is", logprob, rollout_logprob, advantages, mask, params, rollout_logprob)
    if token_weights is not None:
        loss = loss * token_weights
    return agg_loss(loss, mask.to(loss.dtype), agg_mode, normalizer, max_seq_len), metrics
