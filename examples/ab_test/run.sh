#!/usr/bin/env bash
# An A/B test on one base (docs/experiments.md): SmolLM2-135M-Instruct learns small-number
# addition with GRPO under two KL coefficients side by side in one job (config smollm2_ab_kl); prints the
# comparison table at the end (also in $RUN_DIR/experiments.md, the plot in $RUN_DIR/metrics.png).
# Extra arguments are Hydra overrides for mlora-train (e.g. trainer.total_steps=20).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
ASSETS=${ASSETS:-runs/arithmetic_assets}
RUN_DIR=${RUN_DIR:-runs/mlora/smollm2_ab_kl}
MODEL=$("$PY" -m mlora.models.smollm2)
"$PY" -m mlora.demos.arithmetic --out "$ASSETS"
"$PY" -m torch.distributed.run --nproc_per_node 1 -m mlora.train --config-name smollm2_ab_kl \
  demo.dir="$ASSETS" trainer.policy.model.path="$MODEL" trainer.run_dir="$RUN_DIR" "$@"
