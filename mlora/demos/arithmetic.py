"""Assets of the real-model example: SmolLM2-135M-Instruct and small-number addition asked in chat form.

The pretrained model is bad at it (greedy: "What is 14 + 15?" -> "14 + 15 = 20"; about a quarter of
the held-out questions right) and can learn it on two CPU cores in minutes. Rows follow the GSM8K
schema (chat ``prompt``, ``reward_spec.ground_truth``) with ``env_class=arithmetic``: the reward is 1 when
the last number of the response is the sum.

``--format gsm8k`` writes the same split asking for SkyRL's strict GSM8K answer format instead, a last line
``#### N``, with ``env_class=gsm8k``: skyrl_gym's ``GSM8kEnv``, reward 1 only when ``#### N`` (exactly one
space) carries the sum. The format is shown once, in a worked example turn before the question: asked in
the question alone, the base model wrote ``#### N`` in at most 1 of 32 sampled answers (T = 1); with the
example turn in about two thirds of them, and about half of the held-out questions are right greedily.

    python -m mlora.demos.arithmetic --out DIR     # writes DIR/train.parquet, DIR/val.parquet
    python -m mlora.demos.arithmetic --out DIR --format gsm8k
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

QUESTION = "What is {a} + {b}? Answer with the number only."
LOW, HIGH = 2, 19  # operands, inclusive: 324 questions
VAL_SIZE = 64  # held out from training
FORMATS = ("last_number", "gsm8k")  # the reply's scoring: mlora's ``arithmetic`` env, or SkyRL's strict ``gsm8k``
GSM8K_QUESTION = "What is {a} + {b}? End your answer with a line '#### N' where N is the number."
# the worked example turn before each strict-format question; its operands are outside LOW..HIGH and its
# sum (40) is no question's answer, so copying it is never rewarded
GSM8K_SHOT = [{"role": "user", "content": GSM8K_QUESTION.format(a=20, b=20)},
              {"role": "assistant", "content": "20 + 20 = 40\n#### 40"}]


def arithmetic_rows(pairs: list[tuple[int, int]], format: str = "last_number") -> list[dict]:
    """GSM8K-schema rows for ``(a, b)`` pairs, asking for ``format`` (one of :data:`FORMATS`)."""
    if format == "last_number":
        return [{"prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "env_class": "arithmetic",
                 "data_source": "arithmetic", "reward_spec": {"method": "rule", "ground_truth": str(a + b)}}
                for a, b in pairs]
    if format == "gsm8k":
        return [{"prompt": [*GSM8K_SHOT, {"role": "user", "content": GSM8K_QUESTION.format(a=a, b=b)}],
                 "env_class": "gsm8k", "data_source": "arithmetic_gsm8k",
                 "reward_spec": {"method": "rule", "ground_truth": str(a + b)}}
                for a, b in pairs]
    raise ValueError(f"unknown format {format!r}; one of {', '.join(FORMATS)}")


def split_pairs(seed: int = 0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Every ``(a, b)`` with ``LOW <= a, b <= HIGH``, shuffled, as (train, held-out) with no pair in both."""
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs[VAL_SIZE:], pairs[:VAL_SIZE]


def build_arithmetic_data(directory: str | Path, seed: int = 0, format: str = "last_number") -> Path:
    """``<dir>/train.parquet`` and ``<dir>/val.parquet`` asking for ``format`` (:data:`FORMATS`; the split
    does not depend on it); idempotent (existing files are kept, so give each format its own directory)."""
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; one of {', '.join(FORMATS)}")
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    train, val = split_pairs(seed)
    for split, pairs in (("train", train), ("val", val)):
        if not (root / f"{split}.parquet").exists():
            pq.write_table(pa.Table.from_pylist(arithmetic_rows(pairs, format)), root / f"{split}.parquet")
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for train.parquet and val.parquet")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", choices=FORMATS, default="last_number",
                        help="last_number: 'Answer with the number only.', env_class=arithmetic (default); "
                             "gsm8k: SkyRL's strict '#### N' answer, env_class=gsm8k")
    args = parser.parse_args(argv)
    print(build_arithmetic_data(args.out, args.seed, args.format))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
