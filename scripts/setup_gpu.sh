#!/usr/bin/env bash
# Set up mlora on a CUDA machine (Linux x86-64, NVIDIA driver for CUDA 13): .venv with Python 3.11, torch 2.13.0
# (PyPI's CUDA 13.0 build), vLLM 0.32.0 (the version mlora/rollout/vllm_lora_hook.py is written against) and
# Transformer Engine 2.20.2, all pinned in pyproject.toml (the core dependencies and the `gpu` extra), with the
# test and ray extras. One command:
#
#   bash scripts/setup_gpu.sh                 # then: .venv/bin/python -m pytest tests/gpu ... or tests/gpu/run_all.sh
#   bash scripts/setup_gpu.sh --check-pins    # any machine, no GPU, minutes: do the pins resolve together?
#
# Order matters, which is why this is a script and not `pip install .[gpu]` alone: Transformer Engine's torch
# extension (transformer_engine_torch) is a source package built against the torch that is installed, so it is
# installed last with --no-build-isolation (an isolated build would compile it against the newest torch on PyPI).
# Its build first tries the prebuilt wheel TE publishes for this torch/CUDA/Python, else compiles (CUDA 13
# toolkit with nvcc and cuDNN headers needed, tens of minutes). Idempotent: a second run only checks.
# --check-pins resolves everything with `pip install --dry-run` from PyPI's metadata (HTTP range requests: no
# GB downloads) and prints the versions pip would install; it does not build Transformer Engine's extension, whose
# requirements it resolves from the sdist's declared ones (torch>=2.1, transformer_engine_cu13==TE, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python311.sh setup_gpu.sh

# the pins, read from pyproject.toml so that they live in one place
pins=$("$PY" - <<'EOF'
import re, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
core = {re.split(r"[=<>!~\[ ]", r, 1)[0].lower(): r for r in p["dependencies"]}
gpu = p["optional-dependencies"]["gpu"]
vllm = next(r for r in gpu if r.lower().startswith("vllm"))
te = next(r for r in gpu if r.lower().startswith("transformer-engine"))
te_version = te.split("==")[1]
print(core["torch"], vllm, te, te_version, sep="\n")
EOF
)
{ read -r TORCH; read -r VLLM; read -r TE; read -r TE_VERSION; } <<< "$pins"
# transformer_engine_torch's own requirements (its setup.py: build_tools/pytorch.py install_requirements() plus the
# core library for torch's CUDA major), for resolving without building it
TE_TORCH_REQS=("einops" "onnxscript" "onnx" "packaging" "pydantic" "nvdlfw-inspect" "nvidia-cudnn-frontend>=1.29.0"
               "transformer-engine==$TE_VERSION" "transformer-engine-cu13==$TE_VERSION")

# --check-pins resolves against PyPI alone: the build machines' pip configuration points at local CPU wheels
# (torch 2.13.0+cpu), which would stand in for the CUDA torch.
pip_clean() { env -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null "$@"; }

if [ "${1:-}" = "--check-pins" ]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  "$PY" -m venv "$tmp/venv"
  # pip 23.2: --use-feature=fast-deps reads wheel metadata with HTTP range requests (later pips changed that option)
  pip_clean "$tmp/venv/bin/python" -m pip install -q "pip==23.2.1" >/dev/null
  echo "setup_gpu.sh --check-pins: resolving .[test,ray] + $TORCH + $VLLM + $TE's requirements for $("$PY" -V) on $(uname -m)"
  if ! pip_clean "$tmp/venv/bin/python" -m pip install --dry-run --ignore-installed --use-feature=fast-deps \
      --report "$tmp/report.json" -e ".[test,ray]" "$TORCH" "$VLLM" "${TE_TORCH_REQS[@]}" > "$tmp/log" 2>&1; then
    tail -30 "$tmp/log" >&2; echo "setup_gpu.sh: the pins do not resolve together" >&2; exit 1
  fi
  "$PY" - "$tmp/report.json" <<'EOF'
import json, sys
got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]}
keys = ["torch", "vllm", "transformer-engine", "transformer-engine-cu13", "megatron-core", "transformers", "tokenizers",
        "safetensors", "peft", "ray", "numpy", "torchvision", "torchaudio", "triton", "flashinfer-python"]
print(f"setup_gpu.sh: the pins resolve together ({len(got)} packages); " + ", ".join(f"{k} {got[k]}" for k in keys if k in got))
EOF
  exit 0
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
# scripts/setup.sh's CPU venv holds torch 2.13.0+cpu, which satisfies torch==2.13.0: pip would keep it
if .venv/bin/python -c 'import sys, torch; sys.exit(0 if torch.__version__.endswith("+cpu") else 1)' 2>/dev/null; then
  echo "setup_gpu.sh: .venv has the CPU build of torch (scripts/setup.sh's); remove .venv (or use a fresh clone) and rerun" >&2
  exit 1
fi
log=$(mktemp)
run() {  # pip (with this machine's own pip configuration: a user's index mirror is kept), log shown on failure
  if ! .venv/bin/python -m pip "$@" >"$log" 2>&1; then
    tail -40 "$log" >&2; echo "setup_gpu.sh: pip $* failed" >&2; exit 1
  fi
}
run install -q --upgrade "pip>=23.2" "setuptools>=77.0.3" wheel
echo "setup_gpu.sh: torch ($TORCH, CUDA build), mlora[test,ray] and $VLLM (a few GB, once)"
run install -q "$TORCH" -e ".[test,ray]" "$VLLM"
if ! .venv/bin/python -c "import transformer_engine.pytorch" >/dev/null 2>&1; then
  echo "setup_gpu.sh: $TE against the installed torch (--no-build-isolation; a prebuilt wheel or a CUDA build)"
  run install -q --no-build-isolation "$TE"
fi
run install -q -e ".[gpu,test,ray]"  # everything satisfied: proves the environment matches the pins
rm -f "$log"
.venv/bin/python - <<'EOF'
import sys
import torch
problems = []
if not torch.cuda.is_available():
    problems.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: check the NVIDIA driver "
                    f"(nvidia-smi: torch 2.13.0 from PyPI is built for CUDA 13.0 and needs a driver that supports it)")
for module in ("vllm", "transformer_engine.pytorch", "megatron.core", "mlora"):
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001 - report every broken import, not only the first
        problems.append(f"import {module} failed: {type(e).__name__}: {e}")
if problems:
    sys.exit("setup_gpu.sh: the environment is installed but not usable:\n  " + "\n  ".join(problems))
import transformer_engine, vllm
print(f"setup_gpu.sh: ready: torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name()}, "
      f"vllm {vllm.__version__}, transformer_engine {transformer_engine.__version__}")
EOF
