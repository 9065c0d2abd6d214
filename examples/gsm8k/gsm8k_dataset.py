"""Prepare GSM8K as prompt parquet files for mlora-train (the schema SkyRL's LoRA example uses).

    python examples/gsm8k/gsm8k_dataset.py --output_dir ~/data/gsm8k
    python examples/gsm8k/gsm8k_dataset.py --output_dir DIR --from-file train.jsonl --from-file test.jsonl

Writes ``train.parquet`` and ``validation.parquet`` with columns ``data_source``, ``prompt`` (chat
messages), ``env_class`` ("gsm8k"), ``reward_spec`` ({"method": "rule", "ground_truth": N}) and
``extra_info``. Downloads ``openai/gsm8k`` (config "main") from the Hugging Face Hub when the
network allows; ``--from-file`` takes local copies in the raw schema (``question``, ``answer``),
as JSON lines or parquet: the first file becomes train, the second validation (or a split of the
first when only one is given).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from mlora.rollout.envs import gsm8k_reference  # noqa: E402

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
HUB_FILES = {"train": "main/train-00000-of-00001.parquet", "validation": "main/test-00000-of-00001.parquet"}


def read_raw(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"--from-file {str(path)!r} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows):
        if "question" not in row or "answer" not in row:
            raise ValueError(f"{path} row {i} lacks 'question'/'answer' (the raw GSM8K schema); has {sorted(row)}")
    return rows


def download() -> dict[str, list[dict]]:
    try:
        from huggingface_hub import hf_hub_download

        return {split: read_raw(Path(hf_hub_download("openai/gsm8k", file, repo_type="dataset")))
                for split, file in HUB_FILES.items()}
    except Exception as exc:  # offline machines: say what to do instead
        raise SystemExit(f"could not download openai/gsm8k ({type(exc).__name__}: {exc}); "
                         "pass local copies with --from-file TRAIN [--from-file VALIDATION]") from exc


def convert(rows: list[dict], split: str) -> list[dict]:
    return [{
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
        "env_class": "gsm8k",
        "reward_spec": {"method": "rule", "ground_truth": gsm8k_reference(row["answer"])},
        "extra_info": {"split": split, "index": i, "question": row["question"], "answer": row["answer"]},
    } for i, row in enumerate(rows)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output_dir", required=True, type=Path)
    ap.add_argument("--from-file", action="append", type=Path, default=[])
    args = ap.parse_args(argv)
    if args.from_file:
        train = read_raw(args.from_file[0])
        if len(args.from_file) > 1:
            validation = read_raw(args.from_file[1])
        else:
            cut = max(1, len(train) // 10)
            train, validation = train[cut:], train[:cut]
        raw = {"train": train, "validation": validation}
    else:
        raw = download()
    import pyarrow as pa
    import pyarrow.parquet as pq

    args.output_dir.mkdir(parents=True, exist_ok=True)
    for split, rows in raw.items():
        out = args.output_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(convert(rows, split)), out)
        print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
