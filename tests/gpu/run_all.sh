#!/usr/bin/env bash
# All GPU checks as one prepared command for the lent GPU machine (tests/gpu/README.md).
#
#   bash tests/gpu/run_all.sh --wheels   here, once: the wheelhouse tests/gpu/wheels (~48 MiB, CPython 3.12
#                                        manylinux, this venv's versions; no torch, vLLM or TE), checked complete
#   bash tests/gpu/run_all.sh --dry      here or in CI: the wheelhouse (built or reused) resolved offline for the
#                                        device, then every check script with CUDA hidden: each says "SKIP no CUDA"
#   bash tests/gpu/run_all.sh --rehearse here, minutes: as --dry without the wheelhouse, but the scripts written for
#                                        it run their code on the CPU with small shapes (no GPU figure; a code check)
#   bash tests/gpu/run_all.sh            on the device:
#       run(command="bash tests/gpu/run_all.sh", carry=["tests/gpu/wheels"], timeout_s=540)
#
# The device has Python 3.12 and a CUDA torch 2.11 but no network: the carried wheels are installed with
# pip --no-index (or, where pip is unusable, unzipped onto PYTHONPATH) and mlora runs from this tree through
# PYTHONPATH (its pyproject says Python 3.11, so it is not pip-installed there). The scripts run cheap ones first,
# each under its own time limit, all within RUN_ALL_BUDGET seconds (default 465: under 8 minutes with the
# install); a script that is not there yet prints "check <name>: SKIP script missing". Each prints one
# "check <name>: <figure> PASS|FAIL|SKIP <note>" line per check into $OUT/logs/<script>.log and writes
# $OUT/<report>.json; run_summary.py ends with $OUT/run_all.json and the totals. Exit 0: no check failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
WHEELS=${RUN_ALL_WHEELS:-tests/gpu/wheels}  # RUN_ALL_WHEELS: another wheelhouse (a simulation on another Python)
MODE=device
case "${1:-}" in
    "") ;;
    --wheels) MODE=wheels ;;
    --dry) MODE=dry ;;
    --rehearse) MODE=rehearse ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "run_all.sh: unknown argument '$1' (valid: --wheels, --dry, --rehearse, none on the device)" >&2; exit 2 ;;
esac
# Name, time limit (s): cheap first, so that a slow one at the end leaves the others their figures.
CHECKS=(
    "check_fp8_shapes.py 60"      # torch._scaled_mm on odd shard shapes, float32 output; mlora's decision
    "check_fp8_te.py 60"          # fp8="te": exits 3 (SKIP) without Transformer Engine, as on the device
    "check_engine_fork.py 90"     # fault 3: the fork check
    "check_engine_memory.py 90"   # fault 2: the memory headroom decision
    "check_gpu.py 120"            # tiny Llama: float32 = transformers / PEFT; mixed adapters; LoRA stack overhead
    "check_plan_gpu.py 120"       # planner peak vs torch.cuda.max_memory_allocated, one PPO step, ~1B Llama
    "check_logits.py 150"         # bf16 logits vs CPU float32 and vs transformers on CUDA: tiny and ~1B Llama
    "bench_gpu.py 150"            # LoRA fwd+bwd tokens/s vs PEFT (goal >= 1.2x), fp8="torch", SDPA kernels
)
BUDGET=${RUN_ALL_BUDGET:-465}  # RUN_ALL_ONLY (below): run only the scripts it names
SUMMARY_RESERVE=10

venv_python() {  # the CPU venv's interpreter (3.11) for building and resolving the wheelhouse
    local py=${PYTHON:-.venv/bin/python}
    [[ -x "$py" ]] || { echo "run_all.sh: $py not found: run scripts/setup.sh first (or set PYTHON)" >&2; exit 2; }
    echo "$py"
}

if [[ $MODE == wheels ]]; then
    PY=$(venv_python) || exit 2
    "$PY" tests/gpu/wheelhouse.py build && "$PY" tests/gpu/wheelhouse.py verify
    exit $?
fi

OUT="${OUT:-$ROOT/gpu_out}"
mkdir -p "$OUT/logs"
: > "$OUT/run_all.tsv"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/mlora_gpu.XXXXXX")  # random models (GBs): never under $OUT, which comes back
trap 'rm -rf "$WORK"' EXIT
export OUT MLORA_GPU_WORK="$WORK" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1 \
    TOKENIZERS_PARALLELISM=false PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
start=$SECONDS

if [[ $MODE == rehearse ]]; then
    PY=$(venv_python) || exit 2
    export CUDA_VISIBLE_DEVICES=""
    BUDGET=${RUN_ALL_BUDGET:-3600}  # CPU: minutes per script
    echo "run_all.sh --rehearse: the scripts' code on the CPU with small shapes; no figure below is a GPU figure"
elif [[ $MODE == dry ]]; then
    PY=$(venv_python) || exit 2
    export CUDA_VISIBLE_DEVICES=""  # dry means no GPU, even on a machine that has one
    echo "run_all.sh --dry: the wheelhouse, then every check script without CUDA"
    t0=$SECONDS
    if "$PY" tests/gpu/wheelhouse.py build && "$PY" tests/gpu/wheelhouse.py verify; then
        printf 'wheelhouse_install\tverified\t%s\t0\n' $((SECONDS - t0)) >> "$OUT/run_all.tsv"
    else
        printf 'wheelhouse_install\tfailed\t%s\t0\n' $((SECONDS - t0)) >> "$OUT/run_all.tsv"
        "$PY" tests/gpu/run_summary.py "$OUT" "$MODE"
        exit 2
    fi
else
    PY=${PYTHON:-$(command -v python3 || command -v python)}
    echo "run_all.sh: $("$PY" -c 'import sys, torch; print(f"Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), " + (torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"))' 2>&1 | tail -1)"
    [[ -f $WHEELS/requirements.txt ]] || {
        echo "run_all.sh: $WHEELS/requirements.txt missing: build it here with 'bash tests/gpu/run_all.sh --wheels' and pass carry=[\"$WHEELS\"]" >&2
        exit 2
    }
    t0=$SECONDS
    log=$OUT/logs/wheelhouse_install.log
    # PIP_BREAK_SYSTEM_PACKAGES: the device's Python may be marked externally managed; the machine is thrown away
    if PIP_BREAK_SYSTEM_PACKAGES=1 "$PY" -m pip install -q --no-index --no-compile --find-links "$WHEELS" \
            -r "$WHEELS/requirements.txt" > "$log" 2>&1 &&
       PIP_BREAK_SYSTEM_PACKAGES=1 "$PY" -m pip install -q --no-index --no-deps --no-compile --find-links "$WHEELS" \
            -r "$WHEELS/nodeps.txt" >> "$log" 2>&1; then
        how=pip
    else
        echo "run_all.sh: pip install --no-index failed ($(tail -1 "$log")); unzipping the wheels onto PYTHONPATH"
        site=$WORK/site
        mkdir -p "$site"
        how=unzip
        for whl in "$WHEELS"/*.whl; do "$PY" -m zipfile -e "$whl" "$site" >> "$log" 2>&1 || how=failed; done
        export PYTHONPATH="$site:$PYTHONPATH"
    fi
    printf 'wheelhouse_install\t%s\t%s\t0\n' "$how" $((SECONDS - t0)) >> "$OUT/run_all.tsv"
    echo "run_all.sh: wheelhouse installed ($how) in $((SECONDS - t0)) s"
    if ! "$PY" -c "import megatron.core, transformers, peft, safetensors, tokenizers, skyrl_gym, mlora" >> "$log" 2>&1; then
        echo "run_all.sh: the trainer's packages do not import after the install:"; tail -5 "$log"
        "$PY" tests/gpu/run_summary.py "$OUT" "$MODE"
        exit 2
    fi
fi

for entry in "${CHECKS[@]}"; do
    read -r script limit <<< "$entry"
    # RUN_ALL_ONLY="check_a.py check_b.py": a rerun of some scripts (the others are not run and not reported)
    if [[ -n ${RUN_ALL_ONLY:-} && " $RUN_ALL_ONLY " != *" $script "* ]]; then
        continue
    fi
    stem=${script%.py}
    short=${stem#check_}
    if [[ ! -f tests/gpu/$script ]]; then
        echo "check $short: SKIP script missing (tests/gpu/$script)"
        printf '%s\tmissing\t0\t%s\n' "$script" "$limit" >> "$OUT/run_all.tsv"
        continue
    fi
    left=$((BUDGET - (SECONDS - start) - SUMMARY_RESERVE))
    if ((left < 20)); then
        echo "check $short: SKIP out of run_all.sh's time budget ($left s left)"
        printf '%s\tout-of-time\t0\t%s\n' "$script" "$left" >> "$OUT/run_all.tsv"
        continue
    fi
    args=()
    if [[ $MODE == rehearse ]]; then
        limit=900
        grep -q -- "--rehearse" "tests/gpu/$script" && args=(--rehearse)
    fi
    ((limit > left)) && limit=$left
    echo "run_all.sh: $script ${args[*]:+${args[*]} }(limit ${limit} s)"
    t0=$SECONDS
    timeout -k 10 "$limit" "$PY" "tests/gpu/$script" ${args[@]+"${args[@]}"} 2>&1 | tee "$OUT/logs/$stem.log"
    rc=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\t%s\n' "$script" "$rc" $((SECONDS - t0)) "$limit" >> "$OUT/run_all.tsv"
    if ((rc == 124 || rc == 137)); then
        echo "run_all.sh: $script ran out of its ${limit} s"
    elif ((rc != 0)); then
        echo "run_all.sh: $script exit $rc in $((SECONDS - t0)) s"
    fi
done
"$PY" tests/gpu/run_summary.py "$OUT" "$MODE"
status=$?
echo "run_all.sh: $MODE mode done in $((SECONDS - start)) s; figures in $OUT (*.json, logs/)"
exit $status
