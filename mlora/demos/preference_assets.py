"""A deterministic synthetic preference task for the SFT / reward-model / DPO stages on CPU.

Prompts are a few random words. A response is 3–6 words; the preferred ("chosen") one is made of
words from one set (apples, pens, books), the other ("rejected") from another (coins, cards, eggs) — a property of the response alone that a
reward model must detect from the last token's hidden state and that DPO must learn to favour.
Held-out pairs use other prompts and other word combinations.

Files (``<dir>/``): ``tiny-llama`` (a random tiny Llama, as the RL demo's), ``pairs_train.parquet`` and
``pairs_val.parquet`` (``prompt``, ``chosen``, ``rejected``), ``sft_train.parquet`` (``prompt``,
``response`` = the chosen response).
"""

from __future__ import annotations

import random
from pathlib import Path

# single tokens of the tiny models' tokenizer (mlora.testing.tiny_models), so sequences stay short
PROMPT_WORDS = ["Ann", "Bob", "Cid", "Dee", "Eve", "Fay", "Gus", "Hal", "has", "gets", "does", "have"]
GOOD_WORDS = ["apples", "pens", "books"]  # chosen responses
BAD_WORDS = ["coins", "cards", "eggs"]  # rejected responses


def preference_rows(count: int, seed: int) -> list[dict]:
    """``count`` pairs ``{"prompt", "chosen", "rejected"}``, a pure function of ``seed``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        prompt = " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randint(2, 5))) + ":"
        chosen = " " + " ".join(rng.choice(GOOD_WORDS) for _ in range(rng.randint(3, 6)))
        rejected = " " + " ".join(rng.choice(BAD_WORDS) for _ in range(rng.randint(3, 6)))
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def build_preference_assets(directory: str | Path, n_train: int = 256, n_val: int = 64, seed: int = 0) -> Path:
    """Write the tiny model and the parquet files into ``directory`` if missing (idempotent)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mlora.testing import build_tiny_model

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "tiny-llama" / "config.json").exists():
        build_tiny_model("llama", root / "tiny-llama", seed=seed, initializer_range=0.1)
    splits = {"train": preference_rows(n_train, seed), "val": preference_rows(n_val, seed + 1)}
    for split, rows in splits.items():
        if not (root / f"pairs_{split}.parquet").exists():
            pq.write_table(pa.Table.from_pylist(rows), root / f"pairs_{split}.parquet")
    if not (root / "sft_train.parquet").exists():
        sft = [{"prompt": r["prompt"], "response": r["chosen"]} for r in splits["train"]]
        pq.write_table(pa.Table.from_pylist(sft), root / "sft_train.parquet")
    return root
