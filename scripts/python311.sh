# Sourced by scripts/setup.sh and scripts/setup_gpu.sh: sets PY to a Python 3.11 interpreter ($PYTHON when given,
# else python3.11 or python3 if it is 3.11); megatron-core 0.16.1 and mlora's pins need 3.11. $1: the caller's name.
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PY=$cand; break
    fi
  done
fi
[ -n "$PY" ] || { echo "$1: Python 3.11 is required (megatron-core 0.16.1); set PYTHON=/path/to/python3.11" >&2; exit 1; }
