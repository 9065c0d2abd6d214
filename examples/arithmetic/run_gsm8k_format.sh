#!/usr/bin/env bash
# SmolLM2-135M-Instruct learning SkyRL's strict GSM8K answer format ("#### N", scored by skyrl_gym's own
# gsm8k environment) on small-number additions, GRPO + a KL loss on CPU (config smollm2_gsm8k_format; see
# docs/getting-started.md). Extra arguments are Hydra overrides for mlora-train.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
ASSETS=${ASSETS:-runs/gsm8k_format_assets}
RUN_DIR=${RUN_DIR:-runs/mlora/smollm2_gsm8k_format}
MODEL=$("$PY" -m mlora.models.smollm2)
"$PY" -m mlora.demos.arithmetic --out "$ASSETS" --format gsm8k
"$PY" -m torch.distributed.run --nproc_per_node 1 -m mlora.train --config-name smollm2_gsm8k_format \
  demo.dir="$ASSETS" trainer.policy.model.path="$MODEL" trainer.run_dir="$RUN_DIR" "$@"
