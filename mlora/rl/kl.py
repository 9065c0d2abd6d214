"""KL estimators between the policy and the reference, and the KL-in-reward controllers."""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
KL_CONTROLLERS = ("fixed", "adaptive")  # FixedKLController, AdaptiveKLController


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of ``KL(π ‖ π_ref)`` from log-probs of sampled tokens (Schulman's estimators).

    With ``d = log π - log π_ref``:

    - ``k1 = d`` (unbiased, high variance, can be negative)
    - ``k2 = ½ d²``
    - ``k3 = exp(-d) - 1 + d`` (unbiased, low variance, ≥ 0; "low_var_kl"), as SkyRL's ``compute_approx_kl``:
      ``-d`` clamped to ±20 first (a finite value and gradient however far the policies are apart), the result
      to [-10, 10]
    - ``abs = |d|``
    """
    d = logprob - ref_logprob
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        neg = torch.clamp(-d, min=-20, max=20)
        return torch.clamp(torch.exp(neg) - neg - 1, min=-10, max=10)
    if estimator == "abs":
        return d.abs()
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


class FixedKLController:
    """KL-in-reward coefficient that never changes: ``r_t ← r_t - β·KL_t``."""

    def __init__(self, coef: float) -> None:
        self.value = coef

    def update(self, current_kl: float, n_steps: int) -> None:
        return None


class AdaptiveKLController:
    """Ziegler et al. adaptive coefficient: ``β ← β·(1 + clip(KL/target - 1, ±0.2)·n/horizon)``."""

    def __init__(self, init_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
        self.value, self.target, self.horizon = init_coef, target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


def apply_kl_in_reward(token_rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """``r_t - β·KL_t`` on response tokens."""
    return (token_rewards - coef * kl) * mask

