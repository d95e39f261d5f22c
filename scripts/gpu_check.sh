#!/usr/bin/env bash
# One-shot GPU check of leanopt: the suite's CUDA cases, step time beside the peers
# on TinyLlama-1.1B shapes, accuracy and the sparse-gradient hazard on the GPU.
#
#   bash scripts/gpu_check.sh [--wheels DIR] [--dry-run] [--out DIR] [--only STAGE,...]
#
#   --wheels DIR  install what is missing (bitsandbytes, torchao, torch-optimi, triton) from the
#                 .whl files in DIR, offline (pip --no-index --no-deps --target <tmp>)
#   --dry-run     the same stages on the CPU at toy sizes, Triton under its interpreter (<= 3 min)
#   --out DIR     results folder (default: $OUT if set, else ./gpu_check_out)
#   --only LIST   some stages only: env,tests,timing_float32,timing_bfloat16,accuracy,plan_check,host_step,offload,twins,muon
#
# Writes results.json, results.md, gpu_check.log and cuda_tests.xml to the results folder.
# leanopt itself is used from src/ (PYTHONPATH): nothing is built or fetched. Exit status 0
# when every stage ran and passed, 1 otherwise. See docs/gpu_check.md.
set -u
GPU_CHECK_T0="$(date +%s.%N)"
export GPU_CHECK_T0
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PYTHON="${PYTHON:-python3}"
# Found, not imported (an import costs seconds; the env stage imports it and reports why it fails).
if ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" 2>/dev/null; then
    echo "gpu_check: $PYTHON has no torch" >&2
    exit 2
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
