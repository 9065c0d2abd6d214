"""Prompt datasets in parquet (the schema of SkyRL's and verl's GSM8K preparation)."""

from __future__ import annotations

import json
import os
from pathlib import Path

REQUIRED_COLUMNS = ("prompt", "reward_spec")


def load_prompts(path: str | os.PathLike) -> list[dict]:
    """Rows of a prompt parquet: ``prompt`` (text or chat messages), ``reward_spec`` (dict or JSON),
    optional ``env_class`` and ``data_source``."""
    import pyarrow.parquet as pq

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"data file {str(file)!r} does not exist (prepare GSM8K with "
                                "examples/gsm8k/gsm8k_dataset.py --output_dir DIR)")
    table = pq.read_table(file)
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{file} lacks columns {missing}; expected {list(REQUIRED_COLUMNS)} (+ optional env_class, "
                         f"data_source), found {table.column_names}")
    rows = table.to_pylist()
    for row in rows:
        if isinstance(row["reward_spec"], str):
            row["reward_spec"] = json.loads(row["reward_spec"])
    if not rows:
        raise ValueError(f"{file} has no rows")
    return rows


def prompt_text(row: dict, tokenizer) -> str:
    """The prompt as text: chat messages go through the tokenizer's chat template when it has one."""
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in prompt) + "\n"
