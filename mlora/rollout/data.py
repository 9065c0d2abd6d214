"""Prompt datasets in parquet (the schema of SkyRL's and verl's GSM8K preparation)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

REQUIRED_COLUMNS = ("prompt",)  # SkyRL's: the rest of a row is the environment's extras


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
                         f"data_source, reward_spec and the environment's extras), found {table.column_names}")
    rows = table.to_pylist()
    for row in rows:
        if isinstance(row.get("reward_spec"), str):
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


def prompt_ids(row: dict, tokenizer) -> list[int]:
    """The prompt's tokens. Chat messages are tokenized by the chat template itself (SkyRL's way): the special
    tokens the template writes (a BOS in Llama-3's or Gemma's) appear once, where rendering to text and
    tokenizing that with special tokens adds a second BOS. Text prompts, and messages without a template, get
    the tokenizer's special tokens."""
    prompt = row["prompt"]
    if not isinstance(prompt, str) and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                                  return_dict=False))
    return tokenizer(prompt_text(row, tokenizer), add_special_tokens=True)["input_ids"]


@dataclass
class Prompt:
    """One prompt row, its tokens (chat template applied) and the environment that scores it."""

    row: dict
    token_ids: list[int]
    env_class: str

    @property
    def group(self) -> str:
        """The name its evaluation metrics go under: ``data_source`` if the row has one, else the env."""
        return str(self.row.get("data_source") or self.env_class)


def load_prompt_set(paths: list[str], tokenizer, max_prompt_length: int, default_env: str, what: str
                    ) -> tuple[list[Prompt], int]:
    """Rows of every file, tokenized; prompts longer than ``max_prompt_length`` tokens are dropped (as
    SkyRL's PromptDataset does). Returns the prompts and how many were dropped."""
    prompts, dropped = [], 0
    for path in paths:
        try:
            rows = load_prompts(path)
        except (ValueError, FileNotFoundError) as exc:
            raise type(exc)(f"{what}: {exc}") from None
        for row in rows:
            ids = prompt_ids(row, tokenizer)
            if len(ids) > max_prompt_length:
                dropped += 1
                continue
            prompts.append(Prompt(row, ids, str(row.get("env_class") or default_env)))
    if paths and not prompts:
        raise ValueError(f"{what}: all {dropped} prompts are longer than trainer.max_prompt_length="
                         f"{max_prompt_length} tokens")
    return prompts, dropped


def epoch_batches(n_prompts: int, batch_size: int, seed: int, total_steps: int, start_step: int = 0):
    """``(epoch, step, indices)`` for steps ``start_step + 1 .. total_steps``: each epoch a fresh seeded
    shuffle of the prompts, cut into whole batches (the remainder is dropped, as SkyRL's train loader
    does). The order depends only on (seed, epoch), so a run resumed after step ``start_step`` sees
    exactly the batches an uninterrupted run would have."""
    import torch

    per_epoch = n_prompts // batch_size
    if per_epoch < 1:
        raise ValueError(f"the training data has {n_prompts} prompts (after filtering), fewer than "
                         f"trainer.train_batch_size={batch_size}")
    epoch = start_step // per_epoch
    step = epoch * per_epoch
    while step < total_steps:
        order = torch.randperm(n_prompts, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        for b in range(per_epoch):
            if step == total_steps:
                return
            step += 1
            if step > start_step:
                yield epoch, step, order[b * batch_size:(b + 1) * batch_size]
        epoch += 1
