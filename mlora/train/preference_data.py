"""Supervised and preference data: parquet rows -> token ids -> right-padded batches.

Columns are TRL's / OpenRLHF's: ``prompt`` + ``response`` for SFT (``completion`` is accepted as
TRL's name for the response); ``prompt`` + ``chosen`` + ``rejected`` for preference pairs. Each
field is text or chat messages (``[{"role": ..., "content": ...}]``). Tokenisation follows TRL's
DPOTrainer: text responses get the EOS token appended; the response starts where the tokenised
prompt and the tokenised prompt + response diverge; chat messages go through the tokenizer's chat
template (the prompt with the generation prompt, prompt + response without).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

SFT_COLUMNS = ("prompt", "response")
PAIR_COLUMNS = ("prompt", "chosen", "rejected")


@dataclass
class Example:
    """One tokenised example: the prompt's ids and one (SFT) or two (pairs) responses' ids."""

    prompt: list[int]
    responses: tuple[list[int], ...]


@dataclass
class SequenceBatch:
    """Right-padded ``prompt + response`` rows; for pairs, rows ``[0, B)`` are chosen and ``[B, 2B)``
    the rejected responses of the same prompts (one forward of 2B rows)."""

    input_ids: torch.Tensor  # [R, S]
    attention_mask: torch.Tensor  # [R, S]
    response_mask: torch.Tensor  # [R, S]: 1 on response tokens
    pairs: bool = False

    def __post_init__(self) -> None:
        empty = (self.action_mask.sum(-1) == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"responses of length zero in rows {empty[:8]}: every example needs at least one "
                             "response token")
        if self.pairs and self.input_ids.shape[0] % 2:
            raise ValueError(f"a pair batch needs an even number of rows (chosen then rejected), got "
                             f"{self.input_ids.shape[0]}")

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def size(self) -> int:
        """Examples: pairs for a pair batch, rows otherwise."""
        return self.rows // 2 if self.pairs else self.rows

    @property
    def action_mask(self) -> torch.Tensor:
        """``[R, S - 1]`` float: 1 where position ``t`` predicts a response token."""
        return (self.response_mask[:, 1:] * self.attention_mask[:, 1:]).float()

    def example_rows(self, start: int, stop: int) -> torch.Tensor:
        """Row indices of examples ``[start, stop)`` (for pairs: their chosen rows, then rejected)."""
        idx = torch.arange(start, stop)
        return torch.cat([idx, idx + self.size]) if self.pairs else idx


def read_rows(path: str | os.PathLike, columns: Sequence[str], what: str) -> list[dict]:
    """Rows of a parquet or JSON-lines file with the required ``columns``; a clear error otherwise."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{what}: data file {str(file)!r} does not exist")
    if file.suffix in (".jsonl", ".json"):
        import json

        rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
        names = sorted({k for r in rows for k in r})
    else:
        import pyarrow.parquet as pq

        table = pq.read_table(file)
        rows, names = table.to_pylist(), table.column_names
    required = list(columns)
    if "response" in required and "response" not in names and "completion" in names:
        rows = [{**r, "response": r["completion"]} for r in rows]  # TRL's prompt-completion name
        names = list(names) + ["response"]
    missing = [c for c in required if c not in names]
    if missing:
        kind = "preference pairs" if "chosen" in required else "SFT examples"
        raise ValueError(f"{what}: {file} lacks columns {missing}; {kind} need columns {required} (text or chat "
                         f"messages), found {list(names)}")
    if not rows:
        raise ValueError(f"{what}: {file} has no rows")
    return rows


def _is_chat(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _ids(tokenizer, value, generation_prompt: bool = False) -> list[int]:
    if _is_chat(value):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat-format messages need a tokenizer with a chat template; this one has none (give "
                             "the columns as text instead)")
        out = tokenizer.apply_chat_template(value, tokenize=True, add_generation_prompt=generation_prompt)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    return tokenizer(value, add_special_tokens=True)["input_ids"]


def tokenize_example(tokenizer, prompt, responses: Sequence, where: str) -> Example:
    """Prompt and response ids as TRL's DPOTrainer makes them (see the module docstring)."""
    chat = _is_chat(prompt)
    prompt_ids = _ids(tokenizer, prompt, generation_prompt=True)
    fulls = []
    for resp in responses:
        if chat != _is_chat(resp):
            raise ValueError(f"{where}: the prompt and the responses must both be text or both chat messages")
        if not chat:
            if not isinstance(resp, str):
                raise ValueError(f"{where}: a response must be text or chat messages, got {type(resp).__name__}")
            if not resp:
                raise ValueError(f"{where}: a response of length zero")
            eos = tokenizer.eos_token or ""
            fulls.append(_ids(tokenizer, prompt + (resp if resp.endswith(eos) else resp + eos)))
        else:
            if not resp:
                raise ValueError(f"{where}: a response of length zero (no messages)")
            fulls.append(_ids(tokenizer, list(prompt) + list(resp)))
    start = min(_common_prefix(prompt_ids, f) for f in fulls)
    outs = tuple(f[start:] for f in fulls)
    for o in outs:
        if not o:
            raise ValueError(f"{where}: a response of length zero (after tokenization)")
    return Example(prompt_ids[:start], outs)


def load_examples(paths: Sequence[str], tokenizer, pairs: bool, max_length: int, what: str
                  ) -> tuple[list[Example], int]:
    """Tokenised examples of every file; examples longer than ``max_length`` tokens (prompt + longest
    response) are dropped, as TRL does. A chosen response identical to its rejected one is an error."""
    out, dropped = [], 0
    for path in paths:
        rows = read_rows(path, PAIR_COLUMNS if pairs else SFT_COLUMNS, what)
        for i, row in enumerate(rows):
            where = f"{what}: {path} row {i}"
            if pairs:
                if row["chosen"] == row["rejected"]:
                    raise ValueError(f"{where}: chosen is identical to rejected ({str(row['chosen'])[:80]!r}); a "
                                     "preference pair needs two different responses")
                ex = tokenize_example(tokenizer, row["prompt"], (row["chosen"], row["rejected"]), where)
            else:
                ex = tokenize_example(tokenizer, row["prompt"], (row["response"],), where)
            if len(ex.prompt) + max(len(r) for r in ex.responses) > max_length:
                dropped += 1
                continue
            out.append(ex)
    if paths and not out:
        raise ValueError(f"{what}: all {dropped} examples are longer than max_length={max_length} tokens")
    return out, dropped


def collate(examples: Sequence[Example], pad_id: int, pairs: bool) -> SequenceBatch:
    """Right-padded rows (for pairs: every chosen, then every rejected; one length for all)."""
    seqs = [(ex.prompt, ex.responses[k]) for k in range(2 if pairs else 1) for ex in examples]
    length = max(len(p) + len(r) for p, r in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    attn = torch.zeros(len(seqs), length, dtype=torch.long)
    resp = torch.zeros(len(seqs), length, dtype=torch.long)
    for i, (p, r) in enumerate(seqs):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r)
        attn[i, :n] = 1
        resp[i, len(p):n] = 1
    return SequenceBatch(ids, attn, resp, pairs)


def split_held_out(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """``(train, held_out)``: a seeded shuffle, the last ``fraction`` held out."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_out = int(round(len(examples) * fraction))
    keep = sorted(order[:len(order) - n_out])
    out = sorted(order[len(order) - n_out:])
    return [examples[i] for i in keep], [examples[i] for i in out]
