#!/usr/bin/env bash
# GPU smoke test of the local backend (bench/gpu_smoke.py: the checks, one JSON report), then
# bench/backend.py on CUDA. No network needed; well under 5 minutes on one GPU.
# Usage: bash bench/gpu_smoke.sh            (RETOOL_SMOKE_ALLOW_CPU=1 runs the same checks on CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PWD}/src${PYTHONPATH:+:$PYTHONPATH}"
DEVICE=cuda
if [[ "${RETOOL_SMOKE_ALLOW_CPU:-0}" == "1" ]]; then DEVICE=cpu; fi
python bench/gpu_smoke.py --device "$DEVICE" "$@"
if [[ "$DEVICE" == "cuda" ]]; then
  python bench/backend.py --device cuda --size demo --samples 64 --tokens 128 --datums 64 --threads 4
fi
