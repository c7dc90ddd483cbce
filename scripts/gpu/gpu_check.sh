#!/usr/bin/env bash
# GPU check of the reference engine (PyTorch only, no SGLang): lossless AR-vs-speculative parity on a tiny
# random Qwen3.5-style hybrid (and SmolLM2 when present) and tau-independent round costs on a
# Qwen3.8-27B-shaped random model at batch 1 and 8. Prints one JSON line (the summary) on stdout; exit 0 iff
# parity holds. Budget: <= 8 minutes (hard timeout below). Needs torch (CUDA), safetensors, numpy;
# transformers optional (the tiny hybrid is then built directly).
#
#   bash scripts/gpu/gpu_check.sh                         # on the GPU machine
#   bash scripts/gpu/gpu_check.sh --device cpu --tiny     # CPU smoke run of the same code
#   bash scripts/gpu/gpu_check.sh --layers 16             # fewer target layers if memory/time is short
#   bash scripts/gpu/gpu_check.sh --sglang                # the SGLang leg's end-to-end tests, on the GPU
#
# --sglang runs tests/sglang_plugin/test_sglang_e2e.py and tests/cli/test_sglang_cli.py (the code path CI runs on CPU through
# SGLang's CPU test path) in the sglang venv (DSPINE_SGLANG_VENV, built by scripts/setup_sglang_venv.sh) on
# CUDA: CUDA graphs (target and draft, the selector folded into the draft graph), triton attention, the CUDA
# sampling/verify kernels, `dspine-batch generate --engine sglang` exactly as scripts/slurm/gpu-sglang.sbatch
# runs it. Not covered there: fa3/flashinfer attention and the Triton GDN/ReplaySSM kernels (hybrid targets):
# scripts/gpu/sglang_gpu_check.py --model <a Qwen3.5 checkpoint> checks those with the seed command's flags.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = "--sglang" ]; then
  shift
  VENV=${DSPINE_SGLANG_VENV:-${DSPINE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dspine}/venv-sglang}
  exec timeout --signal=INT --kill-after=15 "${GPU_CHECK_TIMEOUT:-1200}" "$VENV/bin/python" -m pytest -m sglang \
    -p no:cacheprovider -W ignore::DeprecationWarning -q "$@" tests/sglang_plugin/test_sglang_e2e.py tests/cli/test_sglang_cli.py
fi
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
exec timeout --signal=INT --kill-after=15 "${GPU_CHECK_TIMEOUT:-470}" "$PY" scripts/gpu/gpu_check.py "$@"
