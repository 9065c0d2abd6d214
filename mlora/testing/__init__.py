"""Helpers for tests and demos: tiny HF models built locally (no hub needed), padded batches."""

from mlora.testing.batches import right_padded_batch
from mlora.testing.tiny_models import TINY_ARCHS, build_tiny_model, load_checkpoint_tensors, train_tokenizer

__all__ = ["TINY_ARCHS", "build_tiny_model", "load_checkpoint_tensors", "right_padded_batch", "train_tokenizer"]
