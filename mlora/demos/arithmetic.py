"""Assets of the real-model example: SmolLM2-135M-Instruct and small-number addition asked in chat form.

The pretrained model is bad at it (greedy: "What is 14 + 15?" -> "14 + 15 = 20"; about a quarter of
the held-out questions right) and can learn it on two CPU cores in minutes. Rows follow the GSM8K
schema (chat ``prompt``, ``reward_spec.ground_truth``, ``env_class=gsm8k``): the reward is 1 when
the last number of the response is the sum.

    python -m mlora.demos.arithmetic --out DIR     # writes DIR/train.parquet, DIR/val.parquet
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

QUESTION = "What is {a} + {b}? Answer with the number only."
LOW, HIGH = 2, 19  # operands, inclusive: 324 questions
VAL_SIZE = 64  # held out from training


def arithmetic_rows(pairs: list[tuple[int, int]]) -> list[dict]:
    """GSM8K-schema rows for ``(a, b)`` pairs."""
    return [{"prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "env_class": "gsm8k",
             "data_source": "arithmetic", "reward_spec": {"method": "rule", "ground_truth": str(a + b)}}
            for a, b in pairs]


def split_pairs(seed: int = 0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Every ``(a, b)`` with ``LOW <= a, b <= HIGH``, shuffled, as (train, held-out) with no pair in both."""
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs[VAL_SIZE:], pairs[:VAL_SIZE]


def build_arithmetic_data(directory: str | Path, seed: int = 0) -> Path:
    """``<dir>/train.parquet`` and ``<dir>/val.parquet``; idempotent."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    train, val = split_pairs(seed)
    for split, pairs in (("train", train), ("val", val)):
        if not (root / f"{split}.parquet").exists():
            pq.write_table(pa.Table.from_pylist(arithmetic_rows(pairs)), root / f"{split}.parquet")
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for train.parquet and val.parquet")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_arithmetic_data(args.out, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
