#!/usr/bin/env bash
# GPU check of the reference engine (PyTorch only, no SGLang): lossless AR-vs-speculative parity on a tiny
# random Qwen3.5-style hybrid (and SmolLM2 when present) and tau-independent round costs on a
# Qwen3.8-27B-shaped random model at batch 1 and 8. Prints one JSON line (the summary) on stdout; exit 0 iff
# parity holds. Budget: <= 8 minutes (hard timeout below). Needs torch (CUDA), safetensors, numpy;
# transformers optional (the tiny hybrid is then built directly).
#
#   bash scripts/gpu_check.sh                         # on the GPU machine
#   bash scripts/gpu_check.sh --device cpu --tiny     # CPU smoke run of the same code
#   bash scripts/gpu_check.sh --layers 16             # fewer target layers if memory/time is short
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
exec timeout --signal=INT --kill-after=15 "${GPU_CHECK_TIMEOUT:-470}" "$PY" scripts/gpu_check.py "$@"
