"""Bytes of the vocab-parallel logits and their float32 temporaries on the last pipeline stage.

What :mod:`mlora.rl.vocab_parallel` and megatron's output layer hold for one micro-batch of ``b``
sequences of ``s`` tokens, with ``V`` vocabulary columns on this TP rank (never gathered):

- the output layer writes ``[s, b, V]`` and megatron returns a contiguous ``[b, s, V]`` copy: two
  logits tensors for a moment; the copy is what the loss keeps for backward (``L`` bytes);
- log-probs of the ``s - 1`` predicted positions work in float32 (``L1`` bytes each): the logits
  upcast (only when the dtype is narrower), a clone when this rank's shard has TP-padding columns,
  ``z - max``, ``exp``, and for the actor's entropy a clamped copy;
- backward recomputes ``z - max`` and the probabilities (two ``L1``), casts the gradient to the
  dtype, then autograd scatters it into a zero ``[b, s, V]`` gradient (``L``).

The critic never builds logits (its passes stop at the final hidden states), so this term is the
actor's and the log-prob passes'.
"""

from __future__ import annotations

F32 = 4


def _sizes(batch: int, seq: int, vocab_local: int, item: int) -> tuple[int, int, int]:
    logits = batch * seq * vocab_local * item
    f32 = batch * (seq - 1) * vocab_local * F32
    cast = batch * (seq - 1) * vocab_local * item
    return logits, f32, cast


def _shifted_peak(logits: int, f32: int, item: int, padded: bool) -> int:
    """Inside ``_shifted``: the upcast (dtype narrower than float32) and the padding clone overlap for a
    moment; then one of them lives on while ``z - max`` is written."""
    upcast, clone = (f32 if item != F32 else 0), (f32 if padded else 0)
    source = f32 if (upcast or clone) else 0
    return logits + max(upcast + clone, source + f32)


def logits_forward_only(batch: int, seq: int, vocab_local: int, item: int, padded: bool) -> int:
    """Peak bytes of logits and their temporaries in a no-grad log-prob pass (old or reference log-probs)."""
    logits, f32, _ = _sizes(batch, seq, vocab_local, item)
    return max(2 * logits, _shifted_peak(logits, f32, item, padded), logits + 2 * f32)


def logits_training(batch: int, seq: int, vocab_local: int, item: int, padded: bool, entropy: bool = True) -> int:
    """Peak bytes of logits and their temporaries in the actor's forward + backward of one micro-batch
    (the engine always computes the entropy, whatever its coefficient)."""
    logits, f32, cast = _sizes(batch, seq, vocab_local, item)
    forward = max(2 * logits, _shifted_peak(logits, f32, item, padded), logits + (3 if entropy else 2) * f32)
    gradient = cast if item != F32 else f32  # the returned gradient: a dtype copy, or z - max reused
    backward = max(_shifted_peak(logits, f32, item, padded),
                   logits + 2 * f32 + (cast if item != F32 else 0),
                   gradient + logits)  # autograd's zero-filled [b, s, V] gradient of the slice
    return max(forward, backward)
