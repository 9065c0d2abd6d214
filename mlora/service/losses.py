"""Tinker's built-in losses as pure functions: learner log-probs and the datum's inputs in, a summed loss out.

Position ``i`` of a datum's ``model_input`` predicts ``target_tokens[i]``; every input tensor has the
datum's length N. Losses are sums over tokens (Tinker's convention: the client normalises through
``weights`` or ``advantages``), so a batch's loss is the sum of its datums'. With ``r = exp(logp - q)``
(``q``: the sampler's log-probs, input ``logprobs``) and advantages ``A``:

- ``cross_entropy``: ``-Σ w·logp``
- ``importance_sampling``: ``-Σ r·A``
- ``ppo``: ``-Σ min(r·A, clip(r, lo, hi)·A)``
- ``cispo``: ``-Σ sg(clip(r, lo, hi))·A·logp`` (the clipped ratio is a constant weight)

``lo``/``hi``: ``loss_fn_config`` keys ``clip_low_threshold`` (default 0.8) and ``clip_high_threshold`` (1.2).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def cross_entropy(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    """``-Σ weights · logp``."""
    return -(logp * inputs["weights"]).sum()


def importance_sampling(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
                        ) -> torch.Tensor:
    """``-Σ exp(logp - q) · A``."""
    return -(torch.exp(logp - inputs["logprobs"]) * inputs["advantages"]).sum()


def ppo(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    """``-Σ min(r·A, clip(r, lo, hi)·A)``."""
    ratio, adv = torch.exp(logp - inputs["logprobs"]), inputs["advantages"]
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * adv, clipped * adv).sum()


def cispo(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    """``-Σ sg(clip(r, lo, hi)) · A · logp``."""
    ratio = torch.exp(logp - inputs["logprobs"]).detach()
    weight = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -(weight * inputs["advantages"] * logp).sum()


LOSSES: dict[str, tuple[Callable, tuple[str, ...], dict[str, float]]] = {
    # name -> (function, required inputs besides target_tokens, config keys with their defaults)
    "cross_entropy": (cross_entropy, ("weights",), {}),
    "importance_sampling": (importance_sampling, ("logprobs", "advantages"), {}),
    "ppo": (ppo, ("logprobs", "advantages"), CLIP_DEFAULTS),
    "cispo": (cispo, ("logprobs", "advantages"), CLIP_DEFAULTS),
}


def check_loss(name: str, config: Mapping[str, object], input_names: set[str]) -> dict[str, float]:
    """The loss's config with defaults filled in; ValueError naming a bad loss, config key or missing input."""
    if name not in LOSSES:
        raise ValueError(f"loss_fn {name!r} is not supported; valid: {', '.join(LOSSES)}")
    _, needs, defaults = LOSSES[name]
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        valid = ", ".join(defaults) or "none"
        raise ValueError(f"loss_fn_config keys {unknown} do not apply to loss_fn {name!r}; valid keys: {valid}")
    missing = sorted({"target_tokens", *needs} - input_names)
    if missing:
        raise ValueError(f"loss_fn {name!r} needs loss_fn_inputs {missing}; got {sorted(input_names)}")
    out = dict(defaults)
    for key, value in config.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"loss_fn_config[{key!r}] must be a number, got {value!r}")
        out[key] = float(value)
    if "clip_low_threshold" in out and not 0 <= out["clip_low_threshold"] <= 1 <= out["clip_high_threshold"]:
        raise ValueError(f"clip thresholds must satisfy 0 <= clip_low_threshold <= 1 <= clip_high_threshold; got "
                         f"{out['clip_low_threshold']} and {out['clip_high_threshold']}")
    return out


def datum_loss(name: str, logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
               ) -> torch.Tensor:
    """Loss ``name`` of one datum (``logp``, ``inputs``: ``[N]``; ``config`` as :func:`check_loss` returns it)."""
    return LOSSES[name][0](logp, inputs, config)
