"""Preference and supervised losses: masked token NLL (SFT), Bradley-Terry (reward models), DPO / IPO.

Pure tensor functions in the style of :mod:`mlora.rl.losses`: sequence log-probs or rewards in,
per-example losses (and the quantities trainers log) out. Reductions over a batch are the
caller's, so that a batch split into micro-batches and data-parallel ranks can be normalised by
the global count (see :mod:`mlora.lora.grads`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PREFERENCE_STAGES = ("sft", "rm", "dpo")  # supervised fine-tuning, reward model (Bradley-Terry), DPO
DPO_LOSS_TYPES = ("sigmoid", "ipo")


def sft_nll(logprobs: torch.Tensor, mask: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
    """Masked token negative log-likelihood: ``-Σ_{b,t} log p(y_t)·m_{b,t} / N``.

    ``logprobs`` ``[batch, T]``: log-probs of the target tokens; ``mask`` 1 on response tokens (the
    prompt and padding are 0). ``N`` is ``Σ m`` (the token mean of transformers' causal-LM loss with
    prompt labels set to -100) unless ``normalizer`` replaces it (a mini-batch's token count, so
    that micro-batch losses sum to the mini-batch loss).
    """
    mask = mask.to(logprobs.dtype)
    denom = mask.sum().clamp(min=1) if normalizer is None else max(float(normalizer), 1.0)
    return -(logprobs * mask).sum() / denom


def sequence_logps(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``Σ_t log p(y_t)·m_t`` per row: the log-probability of each response (``[batch]``)."""
    return (logprobs * mask.to(logprobs.dtype)).sum(-1)


def bradley_terry_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                       margin: torch.Tensor | float | None = None) -> torch.Tensor:
    """Pairwise reward-model loss per pair: ``-log σ(r_c - r_r - m)`` (Bradley-Terry; TRL's RewardTrainer,
    the margin of Llama 2's reward model). ``margin`` None means 0; a tensor gives one per pair."""
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff)


def check_dpo_args(beta: float, label_smoothing: float, loss_type: str) -> None:
    """Raise a ValueError naming the bad value for ``beta <= 0``, an unknown ``loss_type`` or a
    ``label_smoothing`` outside [0, 0.5) (or set with IPO)."""
    if not beta > 0:
        raise ValueError(f"DPO beta={beta} must be > 0 (it scales the implicit reward β·log π/π_ref; for IPO it is "
                         "the regularisation τ and the target margin is 1/(2τ))")
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; valid: {', '.join(DPO_LOSS_TYPES)}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"DPO label_smoothing={label_smoothing} must be in [0, 0.5) (the probability that a "
                         "preference label is flipped)")
    if loss_type == "ipo" and label_smoothing:
        raise ValueError(f"label_smoothing={label_smoothing} applies to loss_type='sigmoid' only (IPO has none)")


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, beta: float,
             label_smoothing: float = 0.0, loss_type: str = "sigmoid",
             chosen_lengths: torch.Tensor | None = None, rejected_lengths: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Direct preference optimisation per pair; returns ``(losses, chosen_rewards, rejected_rewards)``.

    With log-ratios ``ρ_c = log π(y_c) - log π_ref(y_c)``, ``ρ_r`` likewise (sequence log-probs):

    - ``sigmoid`` (DPO, Rafailov et al. 2023), with label smoothing ``ε`` (conservative DPO):
      ``ℓ = -(1 - ε)·log σ(β(ρ_c - ρ_r)) - ε·log σ(-β(ρ_c - ρ_r))``; ``ε = 0`` is TRL's ``sigmoid``;
    - ``ipo`` (Azar et al. 2023): ``ℓ = ((ρ_c/|y_c| - ρ_r/|y_r|) - 1/(2β))²`` with the log-ratios
      averaged over the response tokens when ``chosen_lengths`` / ``rejected_lengths`` are given
      (TRL's normalisation), summed otherwise.

    The implicit rewards are ``β·ρ_c`` and ``β·ρ_r`` (detached), TRL's ``rewards/chosen`` and
    ``rewards/rejected``. ``beta <= 0`` is an error.
    """
    check_dpo_args(beta, label_smoothing, loss_type)
    chosen_ratio = policy_chosen_logps - ref_chosen_logps
    rejected_ratio = policy_rejected_logps - ref_rejected_logps
    if loss_type == "sigmoid":
        logits = beta * (chosen_ratio - rejected_ratio)
        losses = -F.logsigmoid(logits) * (1 - label_smoothing)
        if label_smoothing:
            losses = losses - F.logsigmoid(-logits) * label_smoothing
    else:
        c, r = chosen_ratio, rejected_ratio
        if chosen_lengths is not None:
            c = c / chosen_lengths.to(c.dtype).clamp(min=1)
        if rejected_lengths is not None:
            r = r / rejected_lengths.to(r.dtype).clamp(min=1)
        losses = (c - r - 1 / (2 * beta)) ** 2
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
