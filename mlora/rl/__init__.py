"""RL math as pure tensor functions: advantages, policy/value/KL/entropy losses, aggregation,
vocab-parallel log-probs. Tensors in, tensors out, no hidden state (verl's core_algos style)."""

from mlora.rl.advantages import gae_advantages, grpo_advantages, rloo_advantages
from mlora.rl.kl import AdaptiveKLController, FixedKLController, kl_penalty
from mlora.rl.losses import agg_loss, entropy_from_logits, policy_loss, value_loss
from mlora.rl.vocab_parallel import (
    vocab_parallel_logprobs,
    vocab_parallel_sampling_logprobs,
    vocab_parallel_truncation_logmass,
)

__all__ = [
    "AdaptiveKLController", "FixedKLController", "agg_loss", "entropy_from_logits", "gae_advantages",
    "grpo_advantages", "kl_penalty", "policy_loss", "rloo_advantages", "value_loss", "vocab_parallel_logprobs",
    "vocab_parallel_sampling_logprobs", "vocab_parallel_truncation_logmass",
]
