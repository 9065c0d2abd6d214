"""RL math as pure tensor functions: advantages, policy/value/KL/entropy losses, aggregation,
vocab-parallel log-probs; SFT, Bradley-Terry and DPO/IPO losses. Tensors in, tensors out, no hidden
state (verl's core_algos style)."""

from mlora.rl.advantages import gae_advantages, grpo_advantages, rloo_advantages
from mlora.rl.kl import AdaptiveKLController, FixedKLController, kl_penalty
from mlora.rl.losses import agg_loss, entropy_from_logits, policy_loss, value_loss
from mlora.rl.preference import bradley_terry_loss, dpo_loss, sequence_logps, sft_nll
from mlora.rl.vocab_parallel import (
    vocab_parallel_logprobs,
    vocab_parallel_sampling_logprobs,
    vocab_parallel_truncation_logmass,
)

__all__ = [
    "AdaptiveKLController", "FixedKLController", "agg_loss", "bradley_terry_loss", "dpo_loss", "entropy_from_logits",
    "gae_advantages", "grpo_advantages", "kl_penalty", "policy_loss", "rloo_advantages", "sequence_logps", "sft_nll",
    "value_loss", "vocab_parallel_logprobs", "vocab_parallel_sampling_logprobs", "vocab_parallel_truncation_logmass",
]
