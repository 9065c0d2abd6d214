#!/usr/bin/env bash
# All GPU checks in one prepared command, for a lent GPU machine (tests/gpu/README.md). Never run yet.
#
# Here, once:   bash tests/gpu/run_all.sh --download      (wheels into tests/gpu/wheels, ~60 MB: no vLLM, no TE)
# On the GPU:   run(command="bash tests/gpu/run_all.sh", carry=["tests/gpu/wheels"], timeout_s=540)
#
# Writes $OUT/gpu_checks.json (correctness vs transformers/PEFT on CUDA) and $OUT/gpu_bench.json (LoRA
# tokens/s vs PEFT on a ~1B-shaped Llama in bf16 and with fp8="torch", the SDPA kernel, the planner's peak vs
# torch.cuda.max_memory_allocated). Each part has its own time limit so that one slow part leaves the others'.
set -uo pipefail
cd "$(dirname "$0")/../.."
WHEELS=tests/gpu/wheels
PKGS="megatron-core==0.16.1 transformers==5.19.0 tokenizers==0.23.3 safetensors==0.8.0 peft==0.21.2 huggingface_hub accelerate"
if [[ "${1:-}" == "--download" ]]; then
    .venv/bin/pip download --no-deps -d "$WHEELS" $PKGS
    exit $?
fi
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
echo "run_all.sh: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)"
python -m pip install -q --no-index --find-links "$WHEELS" megatron-core transformers tokenizers safetensors peft \
    huggingface_hub accelerate || { echo "run_all.sh: installing the carried wheels failed"; exit 2; }
python -m pip install -q --no-deps -e . || { echo "run_all.sh: installing mlora failed"; exit 2; }
status=0
OUT="$OUT" timeout 180 torchrun --nproc_per_node 1 tests/gpu/check_gpu.py || { echo "check_gpu.py: exit $?"; status=1; }
OUT="$OUT" timeout 300 torchrun --nproc_per_node 1 tests/gpu/bench_gpu.py || { echo "bench_gpu.py: exit $?"; status=1; }
echo "run_all.sh: results in $OUT (gpu_checks.json, gpu_bench.json)"
exit $status
