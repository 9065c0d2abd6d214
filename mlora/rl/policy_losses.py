"""SkyRL's policy losses (``trainer.algorithm.policy_loss_type``) as per-token functions.

Each loss takes the current log-probs ``log π`` (with gradient), the old policy's ``log π_old``, the
advantages ``A`` (already scaled by the loss reduction: :func:`reduction_scale`), the response mask and the
settings, and returns the per-token loss ``ℓ [B, T]`` and metrics. The step's loss is ``Σ ℓ·m`` (times the
rollout-correction weights where the loss takes them), which is how SkyRL reduces every policy loss
(``ppo_utils.py``: ``reduce_loss`` after ``apply_loss_reduction_to_advantages_minibatch``): scaling ``A``
per row instead of ``ℓ`` matters for the losses whose token selection reads ``A`` (``clip_cov``, ``kl_cov``).

The formulas are SkyRL's (``skyrl`` 0.3.0, ``skyrl/backends/skyrl_train/utils/ppo_utils.py``), checked
against it in ``tests/test_skyrl_oracle.py``. Where SkyRL's HEAD (a956457) differs from 0.3.0, HEAD is followed:
CISPO's defaults (``cispo_eps_clip_low`` 1.0, ``cispo_eps_clip_high`` 4.0; 0.3.0: 0.0, 5.0) and its
``cispo_anchor`` (``rollout``: the ratio to the engine's log-probs; 0.3.0 has only ``old``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mlora.rl.masked import masked_mean, safe_exp

DPPO_TYPES = ("binary_tv", "binary_kl")
CISPO_ANCHORS = ("old", "rollout")


@dataclass(frozen=True)
class PolicyLossParams:
    """The settings SkyRL's losses read (SkyRL's names and defaults; ``trainer.algorithm.*`` and its
    ``sapo``, ``cispo``, ``dppo``, ``clip_cov``, ``kl_cov`` sections)."""

    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual_clip's bound on a negative advantage's loss
    tau_pos: float = 1.0  # sapo
    tau_neg: float = 1.05
    cispo_eps_clip_low: float = 1.0  # SkyRL HEAD's defaults (0.3.0: 0.0 and 5.0)
    cispo_eps_clip_high: float = 4.0
    cispo_anchor: str = "old"  # old: ratio to π_old | rollout: to the engine's μ (SkyRL HEAD)
    dppo_type: str = "binary_tv"
    delta_low: float = 0.2
    delta_high: float = 0.2
    clip_cov_ratio: float = 0.0002  # clip_cov.clip_ratio
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_frac: float = 0.2
    ppo_kl_coef: float = 1.0

    def __post_init__(self) -> None:
        if self.cispo_anchor not in CISPO_ANCHORS:
            raise ValueError(f"cispo.cispo_anchor={self.cispo_anchor!r}; valid: {', '.join(CISPO_ANCHORS)}")
        if self.dppo_type not in DPPO_TYPES:
            raise ValueError(f"dppo.dppo_type={self.dppo_type!r}; valid: {', '.join(DPPO_TYPES)}")
        if not self.clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c={self.clip_ratio_c} must be > 1 (the dual-clip bound)")
        for name in ("tau_pos", "tau_neg"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sapo.{name}={getattr(self, name)} must be > 0")
        if not 0.0 <= self.kl_cov_frac <= 1.0:
            raise ValueError(f"kl_cov.kl_cov_frac={self.kl_cov_frac} must be in [0, 1]")
        if not 0.0 <= self.clip_cov_ratio <= 1.0:
            raise ValueError(f"clip_cov.clip_ratio={self.clip_cov_ratio} must be in [0, 1]")


Metrics = dict[str, torch.Tensor]


def _clipfrac(hit: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(hit.to(mask.dtype), mask).detach()


def ppo_clip(logprob, old_logprob, advantages, mask, p: PolicyLossParams, dual: bool = False,
             rollout_logprob=None) -> tuple[torch.Tensor, Metrics]:
    """``regular`` / ``dual_clip``: ``ρ = exp(clamp(log π - log π_old, ±20))``,
    ``ℓ = -min(ρ·A, clip(ρ, 1 - ε_low, 1 + ε_high)·A)``; dual clip (Ye et al., 2020) caps a negative advantage's
    loss: ``ℓ = min(ℓ, -A·c)`` where ``A < 0``."""
    ratio = safe_exp(logprob - old_logprob)
    surr1, surr2 = ratio * advantages, ratio.clamp(1 - p.eps_clip_low, 1 + p.eps_clip_high) * advantages
    loss = -torch.min(surr1, surr2)
    metrics = {"clipfrac": _clipfrac(-surr2 > -surr1, mask)}
    if dual:
        loss = torch.where(advantages < 0, torch.min(-advantages * p.clip_ratio_c, loss), loss)
    return loss, metrics


def gspo(logprob, old_logprob, advantages, mask, p: PolicyLossParams, rollout_logprob=None):
    """GSPO-token (Zheng et al., 2025): the sequence's importance weight ``s = exp(mean_t(log π - log π_old))``
    on every token, ``s_t = sg(s)·π_t / sg(π_t)`` (log clamped at 10), then PPO's clipped surrogate."""
    seq = masked_mean(logprob - old_logprob, mask, dim=-1).unsqueeze(-1)
    ratio = torch.exp(torch.clamp(logprob - logprob.detach() + seq.detach(), max=10))
    surr1, surr2 = ratio * advantages, ratio.clamp(1 - p.eps_clip_low, 1 + p.eps_clip_high) * advantages
    return -torch.min(surr1, surr2), {"clipfrac": _clipfrac(-surr2 > -surr1, mask)}


def sapo(logprob, old_logprob, advantages, mask, p: PolicyLossParams, rollout_logprob=None):
    """SAPO (Gao et al., 2025): a soft gate instead of the clip, ``ℓ = -f(ρ)·A`` with
    ``f(ρ) = σ(τ·(ρ - 1))·4/τ``, ``τ = tau_pos`` where ``A > 0`` else ``tau_neg``; ``ρ`` from a ±20 log clamp."""
    ratio = torch.exp(torch.clamp(logprob - old_logprob, -20.0, 20.0))
    tau = torch.where(advantages > 0, torch.as_tensor(p.tau_pos, dtype=advantages.dtype),
                      torch.as_tensor(p.tau_neg, dtype=advantages.dtype))
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -gates * advantages, {"clipfrac": torch.zeros(())}


def cispo(logprob, old_logprob, advantages, mask, p: PolicyLossParams, rollout_logprob=None):
    """CISPO (MiniMax-M1): the clipped ratio as a constant weight of the policy gradient,
    ``ℓ = -A·sg(clip(ρ, 1 - ε_low, 1 + ε_high))·log π`` (``cispo.cispo_eps_clip_*``); ``ρ`` to ``π_old``, or with
    ``cispo_anchor=rollout`` to the engine's ``μ`` (SkyRL HEAD: the clamped counterpart of ``rollout_is``)."""
    if p.cispo_anchor == "rollout":
        if rollout_logprob is None:
            raise ValueError("cispo.cispo_anchor='rollout' needs the engine's log-probs of the sampled tokens")
        old_logprob = rollout_logprob
    ratio = safe_exp(logprob - old_logprob)
    lo, hi = 1 - p.cispo_eps_clip_low, 1 + p.cispo_eps_clip_high
    loss = -advantages * ratio.clamp(lo, hi).detach() * logprob
    return loss, {"clipfrac": _clipfrac((ratio < lo) | (ratio > hi), mask)}


def rollout_is(logprob, old_logprob, advantages, mask, p: PolicyLossParams, rollout_logprob=None):
    """``rollout_is`` (GLM-5 §4.1.2): ``r = exp(clamp(log π - log μ, ±20))`` against the engine's ``μ``,
    ``f(r) = r`` inside ``(1 - ε_low, 1 + ε_high)`` else 0, ``ℓ = -sg(f(r))·A·log π``."""
    if rollout_logprob is None:
        raise ValueError("policy_loss_type='rollout_is' needs the engine's log-probs of the sampled tokens")
    ratio = safe_exp(logprob - rollout_logprob)
    inside = (ratio > 1 - p.eps_clip_low) & (ratio < 1 + p.eps_clip_high)
    loss = -(torch.where(inside, ratio, torch.zeros_like(ratio)).detach() * advantages * logprob)
    return loss, {"clipfrac": _clipfrac(~inside, mask)}


def dppo(logprob, old_logprob, advantages, mask, p: PolicyLossParams, rollout_logprob=None):
    """DPPO (arXiv 2602.04879), binary TV or binary KL: ``ℓ = -ρ·A·M`` with ``ρ`` against the behaviour
    policy ``μ`` (the engine's log-probs, else ``π_old``) and ``M`` zeroing tokens whose probability moved past
    ``delta_high`` (``A > 0``) or ``delta_low`` (``A < 0``) in the advantage's direction."""
    mu = rollout_logprob if rollout_logprob is not None else old_logprob
    ratio = safe_exp(logprob - mu)
    with torch.no_grad():
        cur, mu_p = torch.exp(logprob), torch.exp(mu)
        diff = cur - mu_p
        keep = torch.ones_like(advantages)
        if p.dppo_type == "binary_tv":
            keep[(advantages > 0) & (diff > p.delta_high)] = 0.0
            keep[(advantages < 0) & (-diff > p.delta_low)] = 0.0
        else:
            eps = 1e-8
            kl = mu_p * (mu - logprob) + (1 - mu_p) * torch.log((1 - mu_p + eps) / (1 - cur + eps))
            keep[(advantages > 0) & (diff > 0) & (kl > p.delta_high)] = 0.0
            keep[(advantages < 0) & (diff < 0) & (kl > p.delta_low)] = 0.0
    return -(ratio * advantages * keep), {"clipfrac": _clipfrac(keep == 0, mask)}


def clip_cov(logprob, old_logprob, advantages, mask, p: PolicyLossParams, rollout_logprob=None,
             generator: torch.Generator | None = None):
    """Clip-Cov (Cui et al., 2025): PPO's clipped loss (unclamped ratio) with the gradient cut on a random
    ``clip_cov.clip_ratio`` share of the tokens (at least one) whose centred ``A·log π`` covariance lies in
    ``(clip_cov_lb, clip_cov_ub)`` and that PPO's clip left alone. ``generator`` draws them (every TP rank
    passes one seeded alike, so that the ranks cut the same tokens); None: torch's global generator."""
    ratio = torch.exp(logprob - old_logprob)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1 - p.eps_clip_low, 1 + p.eps_clip_high)
    clipped = (pg2 > pg1) & (mask > 0)
    cov = (advantages - masked_mean(advantages, mask)) * (logprob - masked_mean(logprob.detach(), mask))
    cov = cov.detach().masked_fill((mask == 0) | clipped, -torch.inf)
    n_clip = max(int(p.clip_cov_ratio * mask.sum().item()), 1)
    candidates = torch.nonzero((cov < p.clip_cov_ub) & (cov > p.clip_cov_lb) & (mask > 0))
    corr = torch.ones_like(advantages)
    if len(candidates) > 0:
        chosen = candidates[torch.randperm(len(candidates), generator=generator)[:min(n_clip, len(candidates))]]
        corr[chosen[:, 0], chosen[:, 1]] = 0
    return torch.maximum(pg1, pg2) * corr, {"clipfrac": _clipfrac(corr == 0, mask)}


def kl_cov(logprob, old_logprob, advantages, mask, p: PolicyLossParams, rollout_logprob=None):
    """KL-Cov (Cui et al., 2025): ``ℓ = -A·ρ`` (unclamped), plus ``ppo_kl_coef·|log π - log π_old|`` on the
    ``kl_cov_frac`` share of the tokens (at least one) with the largest centred ``A·log π`` covariance."""
    log_ratio = logprob - old_logprob
    ratio = torch.exp(log_ratio)
    loss = -advantages * ratio
    valid = mask > 0
    flat = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    if len(flat) > 0:
        adv, lp = advantages[valid].detach(), logprob[valid].detach()
        cov = (adv - adv.mean()) * (lp - lp.mean())
        k = min(max(1, int(len(cov) * p.kl_cov_frac)), len(cov))
        top = flat[torch.topk(cov, k, largest=True).indices]
        rows, cols = top // advantages.shape[1], top % advantages.shape[1]
        loss = loss.index_put((rows, cols), loss[rows, cols] + p.ppo_kl_coef * log_ratio.abs()[rows, cols])
    return loss, {"clipfrac": torch.zeros(())}


def cross_entropy(logprob, old_logprob, advantages, mask, p: PolicyLossParams, rollout_logprob=None):
    """``cross_entropy``: the negative log-likelihood ``ℓ = -log π`` (advantages unused: SkyRL sums it over the
    masked tokens, Tinker's supervised loss)."""
    return -logprob, {"clipfrac": torch.zeros(())}


def importance_sampling(logprob, old_logprob, advantages, mask, p: PolicyLossParams, rollout_logprob=None):
    """``importance_sampling`` (Tinker's): ``ℓ = -exp(log π - log π_old)·A``, the ratio unclamped and unclipped."""
    return -(torch.exp(logprob - old_logprob) * advantages), {"clipfrac": torch.zeros(())}


def _dual_clip(*args, **kwargs):
    return ppo_clip(*args, dual=True, **kwargs)


LossFn = Callable[..., tuple[torch.Tensor, Metrics]]
# name -> (per-token loss, whether SkyRL applies off_policy_correction's weights and masks to it)
POLICY_LOSSES: dict[str, tuple[LossFn, bool]] = {
    "regular": (ppo_clip, True),
    "dual_clip": (_dual_clip, True),
    "gspo": (gspo, True),
    "sapo": (sapo, True),
    "cispo": (cispo, True),
    "rollout_is": (rollout_is, True),
    "dppo": (dppo, True),
    "clip_cov": (clip_cov, False),
    "kl_cov": (kl_cov, False),
    "cross_entropy": (cross_entropy, False),
    "importance_sampling": (importance_sampling, False),
}


def ratio_to_rollout(name: str, params: PolicyLossParams) -> bool:
    """Whether loss ``name``'s ratio is to the engine's log-probs μ rather than π_old: rollout_is (which needs
    them), dppo (which falls back to π_old without them), cispo with ``cispo_anchor=rollout`` (which needs them).
    SkyRL's fully-async trainer takes only these; the engine hands μ to every loss when it has it, as SkyRL."""
    return name in ("rollout_is", "dppo") or (name == "cispo" and params.cispo_anchor == "rollout")


def token_policy_loss(name: str, logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, params: PolicyLossParams, rollout_logprob: torch.Tensor | None = None,
                      generator: torch.Generator | None = None) -> tuple[torch.Tensor, Metrics]:
    """Policy loss ``name``'s per-token ``ℓ [B, T]`` and metrics (``clipfrac``, ``ppo_kl``); the loss of the
    step is ``Σ ℓ·m`` with ``advantages`` scaled by :func:`mlora.rl.losses.reduction_scale`."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy_loss_type {name!r}; valid: {', '.join(POLICY_LOSSES)}")
    fn = POLICY_LOSSES[name][0]
    mask = mask.to(logprob.dtype)
    extra = {"generator": generator} if fn is clip_cov else {}
    loss, metrics = fn(logprob, old_logprob, advantages, mask, params, rollout_logprob=rollout_logprob, **extra)
    behaviour = rollout_logprob if ratio_to_rollout(name, params) and rollout_logprob is not None else old_logprob
    metrics["ppo_kl"] = masked_mean((behaviour - logprob).detach(), mask)
    return loss, metrics
