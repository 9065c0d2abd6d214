#!/usr/bin/env bash
# The learned-reward RLHF study on SmolLM2-135M-Instruct (issue 50, in progress; see pipeline.py): SFT -> pairs
# labelled by a gold program with noise -> reward model -> PPO arms side by side, gold and proxy against KL.
# Extra arguments go to pipeline.py (--quick: a few steps of every stage; --out DIR; --flip 0.25).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
exec "$PYTHON" examples/rlhf_smollm2/pipeline.py "$@"
