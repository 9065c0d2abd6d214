"""torchrun worker (4 ranks): tools/convert_checkpoint.py hf-to-mcore for the tiny models, through the
script's own main(), in one launch.

Usage: torchrun --nproc_per_node=4 mcore_convert.py MODELS_DIR OUT_DIR
llama and qwen2 (tied embeddings on a separate last stage) at TP2xPP2, mistral at TP1xPP4; the dist
checkpoints go to OUT_DIR/<name>. Rank 0 writes OUT_DIR/records.json: each run's exit status.
"""

from __future__ import annotations

import argparse
from pathlib import Path

LAYOUTS = (("llama", 2, 2), ("qwen2", 2, 2), ("mistral", 1, 4))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models_dir", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    # imported here, not at the top: megatron's save spawns a helper process that re-imports this file
    from common import convert_tool, write_records_and_exit

    from mlora.parallel import reset_parallel

    tool = convert_tool()
    records = []
    for name, tp, pp in LAYOUTS:
        code = tool.main(["hf-to-mcore", "--hf", str(args.models_dir / name), "--out", str(args.out / name),
                          "--tp", str(tp), "--pp", str(pp), "--quiet"])
        records.append({"model": name, "tp": tp, "pp": pp, "exit": code})
        reset_parallel()  # the next layout builds its own groups
    write_records_and_exit(records, args.out / "records.json")


if __name__ == "__main__":
    main()
