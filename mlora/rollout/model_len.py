"""The context length (``max_model_len``) a vLLM engine is started with, from the run's own lengths.

vLLM sizes an engine for the model's whole context unless told otherwise (SmolLM2: 8,192 tokens) and
refuses to start when one sequence of that length does not fit the KV cache it was given
(``generator.kv_cache_memory_bytes``): a real model would need ``+generator.engine_init_kwargs.
max_model_len=...`` by hand. A run never needs more than its longest prompt plus its longest
response: ``trainer.max_prompt_length`` (longer prompts are dropped when the data loads) plus the
largest ``max_generate_length`` of training and evaluation sampling. That, capped by the model's own
limit, is what the engines and the printed serve command get; an explicit
``generator.engine_init_kwargs.max_model_len`` wins.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

# config.json keys that bound a model's context, as vLLM reads them (the smallest present one wins)
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                 "max_seq_length", "seq_len")


def model_context_limit(config: Mapping) -> int | None:
    """The longest sequence an HF ``config`` (dict of ``config.json``) allows; None when it names none.

    The smallest of :data:`POSITION_KEYS` present, in the config or its ``text_config`` (multimodal
    checkpoints keep the language model's limit there)."""
    found = []
    for section in (config, config.get("text_config") or {}):
        found += [int(section[k]) for k in POSITION_KEYS if isinstance(section.get(k), int) and section[k] > 0]
    return min(found) if found else None


def read_context_limit(model_dir: str | os.PathLike) -> int | None:
    """:func:`model_context_limit` of the ``config.json`` in ``model_dir`` (None without one)."""
    file = Path(model_dir) / "config.json"
    return model_context_limit(json.loads(file.read_text())) if file.is_file() else None


def run_max_model_len(max_prompt_length: int, max_generate_lengths: Iterable[int | None],
                      model_limit: int | None) -> int:
    """``max_prompt_length`` + the largest of ``max_generate_lengths`` (None entries are skipped),
    capped by ``model_limit`` (None: no cap). Raises a ValueError naming a length that is not >= 1."""
    if max_prompt_length < 1:
        raise ValueError(f"trainer.max_prompt_length={max_prompt_length} must be >= 1")
    lengths = [n for n in max_generate_lengths if n is not None]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"max_generate_length values {lengths} must be given and >= 1")
    need = max_prompt_length + max(lengths)
    return need if model_limit is None else min(need, model_limit)
