"""Prompt sets of the multi-turn environments (:mod:`mlora.rollout.tool_envs`), in the GSM8K schema.

``calculator``: two-step sums in words ("a plus b minus c", two-digit numbers) asked in chat form, with the calculator's
instructions in the system message and one worked exchange (a one-step sum, its call, the result, the
answer) before the question (``reward_spec``: ``ground_truth`` and the question's
``expression``); ``guess_number``: a hidden number in a small range.

    python -m mlora.demos.tool_tasks --task calculator --out DIR    # DIR/train.parquet, DIR/val.parquet
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

CALCULATOR_SYSTEM = ("You can use a calculator. To use it, write <tool>EXPRESSION</tool>, for example "
                     "<tool>12 + 7</tool>, and you will get <result>VALUE</result>. When you know the answer, "
                     "write #### ANSWER.")
GUESS_QUESTION = "I am thinking of a whole number from {low} to {high}. Guess it: answer with one number."
TASKS = ("calculator", "guess_number")


# one worked exchange before the question: the format shown once (a one-step sum in words; the questions have
# two steps, which the model must turn into one expression, or two calls)
CALCULATOR_EXAMPLE = [{"role": "user", "content": "What is 12 plus 7?"},
                      {"role": "assistant", "content": "<tool>12 + 7</tool>"},
                      {"role": "user", "content": "<result>19</result>"},
                      {"role": "assistant", "content": "#### 19"}]
CALCULATOR_QUESTION = "What is {a} plus {b} minus {c}?"


def calculator_rows(triples: list[tuple[int, int, int]]) -> list[dict]:
    return [{"prompt": [{"role": "system", "content": CALCULATOR_SYSTEM}, *CALCULATOR_EXAMPLE,
                        {"role": "user", "content": CALCULATOR_QUESTION.format(a=a, b=b, c=c)}],
             "env_class": "calculator", "data_source": "calculator",
             "reward_spec": {"method": "rule", "ground_truth": str(a + b - c), "expression": f"{a} + {b} - {c}"}}
            for a, b, c in triples]


def guess_rows(targets: list[int], low: int, high: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": GUESS_QUESTION.format(low=low, high=high)}],
             "env_class": "guess_number", "data_source": "guess_number",
             "reward_spec": {"target": t, "low": low, "high": high}} for t in targets]


def tool_task_rows(task: str, n_train: int = 256, n_val: int = 32, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, held-out) rows of ``task``; calculator questions never repeat between the two."""
    rng = random.Random(seed)
    if task == "calculator":
        triples = sorted({(rng.randint(20, 99), rng.randint(10, 99), rng.randint(2, 19))
                          for _ in range(4 * (n_train + n_val))})
        rng.shuffle(triples)
        return calculator_rows(triples[n_val:n_val + n_train]), calculator_rows(triples[:n_val])
    if task == "guess_number":
        low, high = 1, 4
        return (guess_rows([rng.randint(low, high) for _ in range(n_train)], low, high),
                guess_rows([rng.randint(low, high) for _ in range(n_val)], low, high))
    raise ValueError(f"task={task!r}; valid: {', '.join(TASKS)}")


def build_tool_task(directory: str | Path, task: str, n_train: int = 256, n_val: int = 32, seed: int = 0) -> Path:
    """``<dir>/train.parquet`` and ``<dir>/val.parquet`` of ``task``; idempotent."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    train, val = tool_task_rows(task, n_train, n_val, seed)
    for split, rows in (("train", train), ("val", val)):
        if not (root / f"{split}.parquet").exists():
            pq.write_table(pa.Table.from_pylist(rows), root / f"{split}.parquet")
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=TASKS, required=True)
    parser.add_argument("--out", required=True, help="directory for train.parquet and val.parquet")
    parser.add_argument("--train", type=int, default=256)
    parser.add_argument("--val", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_tool_task(args.out, args.task, args.train, args.val, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
