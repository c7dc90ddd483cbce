#!/usr/bin/env bash
# GPU recipe for the embedded draft (issue 14 item 4): on one CUDA GPU, in under 9 minutes, join the SmolLM2
# GGUF from its parts, regenerate training data with the reference engine on CUDA, train the DSpine draft
# (warm-started from the shipped one) and report its held-out greedy tau. Needs torch (CUDA), safetensors and
# tokenizers; gguf, numpy, jinja2, markupsafe and tqdm come from BUNDLE/wheels when the machine lacks them.
#
# Build the bundle here (GGUF parts <= 50 MB, prompts with reference answers, small wheels), upload it with
# the repo, run there:
#   bash scripts/train/gpu_bundle.sh out/gpu_bundle
#   bash scripts/train/gpu_train.sh --bundle out/gpu_bundle                 # on the GPU machine (~8 min)
#   bash scripts/train/gpu_train.sh --bundle out/gpu_bundle --device cpu --tiny   # CPU smoke run of the same path
#   bash scripts/train/gpu_train.sh --bundle out/gpu_bundle --dry-run       # print the commands only
# Stage budgets (seconds): --data-s (regeneration, resumable), --train-s (training, paces the lr schedule);
# conversion (~20 s) and the tau eval (~1 min) come on top. Prints tau.json last; WORK/draft is the draft.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
BUNDLE=out/gpu_bundle WORK=out/gpu_train DEVICE=cuda TINY=0 DRY=0 DATA_S=180 TRAIN_S=200 SOURCE=regen INIT=shipped
usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; echo "options: --bundle DIR --work DIR --device cuda|cpu --tiny --dry-run --data-s N --train-s N --data-source regen|teacher-forced|mix --fresh"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) BUNDLE=${2:?--bundle needs a directory}; shift 2 ;;
    --work) WORK=${2:?--work needs a directory}; shift 2 ;;
    --device) DEVICE=${2:?--device needs cuda or cpu}; shift 2 ;;
    --data-s) DATA_S=${2:?--data-s needs seconds}; shift 2 ;;
    --train-s) TRAIN_S=${2:?--train-s needs seconds}; shift 2 ;;
    --data-source) SOURCE=${2:?--data-source needs regen, teacher-forced or mix}; shift 2 ;;
    --tiny) TINY=1; shift ;;
    --dry-run) DRY=1; shift ;;
    --fresh) INIT=none; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_train.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu_train.sh: --device must be cuda or cpu, not $DEVICE" >&2; exit 2 ;; esac
case "$SOURCE" in regen|teacher-forced|mix) ;; *) echo "gpu_train.sh: --data-source must be regen, teacher-forced or mix" >&2; exit 2 ;; esac
for n in "$DATA_S" "$TRAIN_S"; do
  case "$n" in ''|*[!0-9]*) echo "gpu_train.sh: --data-s/--train-s take whole seconds, not '$n'" >&2; exit 2 ;; esac
done
MANIFEST=$(ls "$BUNDLE"/*.parts.json 2>/dev/null | head -n 1 || true)
if [ "$DRY" = 0 ]; then
  [ -n "$MANIFEST" ] || { echo "gpu_train.sh: no *.parts.json in $BUNDLE (build it with scripts/train/gpu_bundle.sh)" >&2; exit 2; }
  [ -f "$BUNDLE/prompts.jsonl" ] || { echo "gpu_train.sh: $BUNDLE/prompts.jsonl missing (scripts/train/gpu_bundle.sh)" >&2; exit 2; }
fi
MANIFEST=${MANIFEST:-$BUNDLE/MODEL.parts.json}

# Sizes: the GPU run regenerates in big batches and trains with bigger batches under bf16 autocast; --tiny only
# proves the path end to end (a few prompts, a few steps).
if [ "$TINY" = 1 ]; then
  SIZE=(--prompts-per-dataset 2 --eval-per-dataset 2 --max-new-tokens 12 --tau-max-new-tokens 12 --regen-batch 4
        --steps 2 --batch-size 2 --anchors 4 --save-every 1)
  DATA_S=60 TRAIN_S=60
else
  SIZE=(--max-new-tokens 160 --tau-max-new-tokens 96 --regen-batch 128 --steps 6000 --batch-size 16 --anchors 64
        --save-every 200 --lr 5e-4 --gamma 4)
fi
if [ "$INIT" = shipped ]; then  # a further stage on fresh data, as the model card's stages 3 and 4
  TRAIN_OPTS=(--capture-dtype bfloat16 --init-draft dspine/embedded/assets/smollm2-dspine --replacement-probability 0)
else
  TRAIN_OPTS=(--capture-dtype bfloat16 --layers 2 --block-size 8 --draft-vocab 8192)
fi
if [ "$DEVICE" = cuda ]; then TRAIN_OPTS+=(--autocast bfloat16); fi
COMMON=(--work "$WORK" --model "$WORK/model.gguf" --prompts "$BUNDLE/prompts.jsonl" --device "$DEVICE"
        --data-source "$SOURCE" --threads "${THREADS:-4}" "${SIZE[@]}")

run() {
  echo "+ $*" >&2
  [ "$DRY" = 1 ] || "$@"
}
T0=$(date +%s)
stamp() { echo "[gpu_train] $1 at +$(( $(date +%s) - T0 ))s" >&2; }
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

# 1. what the machine lacks comes from the bundle's wheels (no package index there)
for mod in gguf:gguf numpy:numpy jinja2:jinja2 markupsafe:markupsafe tqdm:tqdm; do
  name=${mod%%:*}
  if ! "$PY" -c "import ${mod#*:}" 2>/dev/null; then
    whl=$(find "$BUNDLE/wheels" -maxdepth 1 -iname "$name-*.whl" 2>/dev/null | head -n 1 || true)
    if [ -n "$whl" ]; then run "$PY" -m pip install -q --no-index --no-deps "$whl"
    elif [ "$DRY" = 0 ]; then echo "gpu_train.sh: python module $name missing and no $BUNDLE/wheels/$name-*.whl" >&2; exit 2
    fi
  fi
done
[ "$DEVICE" = cpu ] || [ "$DRY" = 1 ] || "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "gpu_train.sh: torch sees no CUDA device (use --device cpu for a smoke run)" >&2; exit 2; }
[ "$DRY" = 1 ] || mkdir -p "$WORK"
# 2. the GGUF, joined from its parts and verified (sha256 per part and whole)
run "$PY" scripts/train/file_parts.py join "$MANIFEST" "$WORK/model.gguf"
stamp "joined"
# 3. data (resumable; regeneration stops at the budget), 4. training (time-boxed; resumable), 5. held-out tau
run "$PY" scripts/train/train_embedded.py "${COMMON[@]}" --stages data --data-time-budget "$DATA_S"
stamp "data"
run "$PY" scripts/train/train_embedded.py "${COMMON[@]}" --stages train --time-budget "$TRAIN_S" --resume "${TRAIN_OPTS[@]}"
stamp "train"
run "$PY" scripts/train/train_embedded.py "${COMMON[@]}" --stages tau
stamp "tau"
[ "$DRY" = 1 ] || cat "$WORK/tau.json"
