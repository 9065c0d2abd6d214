"""Tinker's built-in losses as pure functions: learner log-probs and the datum's inputs in, a summed loss out.

Position ``i`` of a datum's ``model_input`` predicts ``target_tokens[i]``; every input tensor has the datum's
length N, or is ``(N, K)`` like ``target_tokens`` when a position has K targets (top-K distillation: each target
its own log-prob, weight, advantage). Losses are sums over tokens (Tinker's convention: the client normalises
through ``weights`` or ``advantages``), so a batch's loss is the sum of its datums'. With ``r = exp(logp - q)``
(``q``: the sampler's log-probs, input ``logprobs``) and advantages ``A``, as Tinker's loss pages give them
(tinker-docs.thinkingmachines.ai/tinker/losses/<name>):

- ``cross_entropy``: ``-Σ w·logp``
- ``importance_sampling``: ``-Σ r·A``
- ``ppo``: ``-Σ min(r·A, clip(r, lo, hi)·A)``
- ``cispo``: ``-Σ sg(clip(r, lo, hi))·A·logp`` (the clipped ratio is a constant weight)
- ``gspo`` (GSPO-token): ``s = exp(mean over M of (sg(logp) - q))`` with ``M`` the positions
  ``sequence_ratio_mask`` marks; each token's ratio ``s_t = s · exp(logp - sg(logp))`` (s's value, its own
  gradient); ``-Σ min(s_t·A, clip(s_t, lo, hi)·A)``
- ``dro``: ``-Σ (logp·A - ½·β·(logp - q)²)`` (the penalty applies at every position: DRO has no mask input)

``lo``/``hi``: ``loss_fn_config`` keys ``clip_low_threshold`` (default 0.8) and ``clip_high_threshold`` (1.2;
Tinker: "currently fixed to 0.2"). ``β``: key ``beta``, which DRO's page sets only in its example (0.05) and
gives no default for, so it must be passed. ``stable_reinforce`` is refused by name: its page (alpha) does not
publish the objective, only that it uses information Tinker's sampler records.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
REQUIRED = object()  # a config key with no default: the request must set it
UNPUBLISHED = {
    "stable_reinforce": "Tinker's StableReinforce is in alpha and its page does not publish the objective (only that "
                        "it uses stability information Tinker's sampler records at sampling time), so it cannot be "
                        "reproduced here; for off-policy or async data use a clipped loss: loss_fn='ppo' or 'gspo'",
}


def cross_entropy(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    """``-Σ weights · logp``."""
    return -(logp * inputs["weights"]).sum()


def importance_sampling(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
                        ) -> torch.Tensor:
    """``-Σ exp(logp - q) · A``."""
    return -(torch.exp(logp - inputs["logprobs"]) * inputs["advantages"]).sum()


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, config: Mapping[str, float]) -> torch.Tensor:
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * adv, clipped * adv).sum()


def ppo(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    """``-Σ min(r·A, clip(r, lo, hi)·A)``."""
    return _clipped_surrogate(torch.exp(logp - inputs["logprobs"]), inputs["advantages"], config)


def cispo(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    """``-Σ sg(clip(r, lo, hi)) · A · logp``."""
    ratio = torch.exp(logp - inputs["logprobs"]).detach()
    weight = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -(weight * inputs["advantages"] * logp).sum()


def gspo(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    """GSPO-token: ``-Σ min(s_t·A, clip(s_t, lo, hi)·A)``, ``s_t = exp(mean_M(sg(logp) - q) + logp - sg(logp))``."""
    in_ratio = inputs["sequence_ratio_mask"] != 0
    log_ratio = (logp.detach() - inputs["logprobs"])[in_ratio].mean()
    ratio = torch.exp(log_ratio + logp - logp.detach())
    return _clipped_surrogate(ratio, inputs["advantages"], config)


def dro(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    """``-Σ (logp·A - ½·β·(logp - q)²)``."""
    return -(logp * inputs["advantages"] - 0.5 * config["beta"] * (logp - inputs["logprobs"]) ** 2).sum()


LOSSES: dict[str, tuple[Callable, tuple[str, ...], dict[str, object]]] = {
    # name -> (function, required inputs besides target_tokens, config keys with their defaults)
    "cross_entropy": (cross_entropy, ("weights",), {}),
    "importance_sampling": (importance_sampling, ("logprobs", "advantages"), {}),
    "ppo": (ppo, ("logprobs", "advantages"), CLIP_DEFAULTS),
    "cispo": (cispo, ("logprobs", "advantages"), CLIP_DEFAULTS),
    "gspo": (gspo, ("logprobs", "advantages", "sequence_ratio_mask"), CLIP_DEFAULTS),
    "dro": (dro, ("logprobs", "advantages"), {"beta": REQUIRED}),
}
PER_SEQUENCE = {"sequence_ratio_mask"}  # inputs of one value per position even when targets are (N, K)
SEQUENCE_LOSSES = {"gspo"}  # a ratio over the sequence: one target per position only


def check_loss(name: str, config: Mapping[str, object], input_names: set[str]) -> dict[str, float]:
    """The loss's config with defaults filled in; ValueError naming a bad loss, config key, missing or unexpected
    input."""
    if name in UNPUBLISHED:
        raise ValueError(f"loss_fn {name!r} is not supported: {UNPUBLISHED[name]}")
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
    extra = sorted(input_names - {"target_tokens", *needs})
    if extra:  # Tinker refuses them too (e.g. weights with dro): a silently ignored input would be a wrong loss
        raise ValueError(f"loss_fn {name!r} takes loss_fn_inputs {sorted({'target_tokens', *needs})}; "
                         f"{extra} do not apply to it")
    out = {}
    for key, default in defaults.items():
        value = config.get(key, default)
        if value is REQUIRED:
            raise ValueError(f"loss_fn {name!r} needs loss_fn_config[{key!r}] (Tinker documents no default; its "
                             f"example passes {{'beta': 0.05}})")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"loss_fn_config[{key!r}] must be a number, got {value!r}")
        out[key] = float(value)
    if "clip_low_threshold" in out and not 0 <= out["clip_low_threshold"] <= 1 <= out["clip_high_threshold"]:
        raise ValueError(f"clip thresholds must satisfy 0 <= clip_low_threshold <= 1 <= clip_high_threshold; got "
                         f"{out['clip_low_threshold']} and {out['clip_high_threshold']}")
    if out.get("beta", 0.0) < 0:
        raise ValueError(f"loss_fn_config['beta']={out['beta']} must be >= 0")
    return out


def check_shapes(name: str, n: int, inputs: Mapping[str, torch.Tensor]) -> int:
    """K, the targets per position of a datum of ``n`` tokens (0: ``target_tokens`` is ``[N]``); ValueError naming
    an input whose shape does not match."""
    target = inputs["target_tokens"]
    if target.dim() not in (1, 2) or target.shape[0] != n or (target.dim() == 2 and target.shape[1] < 1):
        raise ValueError(f"loss_fn_inputs['target_tokens'] has shape {list(target.shape)}; this datum of {n} tokens "
                         f"takes [{n}] or [{n}, K]")
    k = target.shape[1] if target.dim() == 2 else 0
    if k and name in SEQUENCE_LOSSES:
        raise ValueError(f"loss_fn {name!r} takes one target per position ([{n}]); target_tokens is {list(target.shape)}")
    for key, t in inputs.items():
        want = [n] if key in PER_SEQUENCE else list(target.shape)
        if list(t.shape) != want:
            raise ValueError(f"loss_fn_inputs[{key!r}] has shape {list(t.shape)}; with target_tokens of shape "
                             f"{list(target.shape)} it must be {want}")
    if name in SEQUENCE_LOSSES and not bool((inputs["sequence_ratio_mask"] != 0).any()):
        raise ValueError("sequence_ratio_mask marks no position: the sequence ratio needs at least one")
    return k


def datum_loss(name: str, logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
               ) -> torch.Tensor:
    """Loss ``name`` of one datum (``logp`` and ``inputs``: ``[N]`` or ``[N, K]``; ``config`` as :func:`check_loss`
    returns it)."""
    return LOSSES[name][0](logp, inputs, config)
