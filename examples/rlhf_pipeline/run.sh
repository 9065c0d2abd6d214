#!/usr/bin/env bash
# SFT -> reward model -> PPO with the reward adapter, TP2xPP2 on 4 CPU ranks (see docs/rlhf.md).
# Extra arguments go to pipeline.py (e.g. --out DIR --ppo-steps 30 --tp 1 --pp 1).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
exec "$PYTHON" examples/rlhf_pipeline/pipeline.py "$@"
