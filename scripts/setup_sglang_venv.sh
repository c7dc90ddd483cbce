#!/usr/bin/env bash
# Creates (idempotently) the virtualenv for the SGLang backend: torch==2.14.1 (CUDA build, from local disk where
# available), sglang==0.5.23 with its exact pins, then this package in editable mode without deps plus our light
# deps and the test tools. ~11 GB, ~5 min on a cold pip cache; seconds when already set up.
#
#   DSPINE_SGLANG_VENV   where (default: venv-sglang in the dspine cache, the one place scripts and CI look:
#                        ${DSPINE_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/dspine}/venv-sglang)
#   PYTHON               interpreter used to create the venv (default: python3; needs >= 3.11)
#   DSPINE_SGLANG_FORCE=1  reinstall even when the versions already match
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${DSPINE_SGLANG_VENV:-${DSPINE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dspine}/venv-sglang}
mkdir -p "$(dirname "$VENV")"
PY=${PYTHON:-python3}
TORCH_VERSION=2.14.1
SGLANG_VERSION=0.5.23
# Light deps of dspine/dspine_batch (pyproject's `dependencies` minus torch) and the test tools. transformers and
# tokenizers come pinned by sglang; we do not name them so the resolver keeps sglang's pins.
LIGHT_DEPS=(safetensors numpy click click-option-group gguf pyarrow tqdm pytest hypothesis ninja)

log() { printf '[setup_sglang_venv] %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV with $("$PY" --version 2>&1)"
  "$PY" -m venv "$VENV"
fi
VPY="$(cd "$VENV" && pwd)/bin/python"

# Versions as installed (metadata only: no import of torch, which takes seconds).
have() {
  "$VPY" - "$@" <<'PYEOF'
import sys
from importlib.metadata import version, PackageNotFoundError
ok = True
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    try:
        got = version(name).split("+")[0]
    except PackageNotFoundError:
        got = None
    if got != want:
        ok = False
sys.exit(0 if ok else 1)
PYEOF
}

# Editable install of this checkout points at ROOT? (a moved/cloned checkout needs a re-run of `-e .`)
ours_ok() {  # run from / so the checkout's own directory on sys.path cannot answer for the venv
  (cd / && "$VPY" -c "import dspine, dspine_batch, os, sys; sys.exit(0 if os.path.dirname(os.path.dirname(os.path.abspath(dspine.__file__))) == os.path.abspath(sys.argv[1]) else 1)" "$ROOT" 2>/dev/null \
    && "$VPY" -c "from importlib.metadata import entry_points as e; import sys; sys.exit(0 if any(x.name == 'dspine' for x in e(group='sglang.srt.plugins')) else 1)" 2>/dev/null)
}

PIP=("$VPY" -m pip install --disable-pip-version-check)
FORCE=${DSPINE_SGLANG_FORCE:-0}

if [ "$FORCE" = 1 ] || ! have "torch==$TORCH_VERSION"; then
  log "installing torch==$TORCH_VERSION"
  "${PIP[@]}" -q "torch==$TORCH_VERSION"
else
  log "torch==$TORCH_VERSION already installed"
fi

if [ "$FORCE" = 1 ] || ! have "sglang==$SGLANG_VERSION" "torch==$TORCH_VERSION"; then
  log "installing sglang==$SGLANG_VERSION (keeps torch==$TORCH_VERSION)"
  "${PIP[@]}" -q "sglang==$SGLANG_VERSION" "torch==$TORCH_VERSION"
else
  log "sglang==$SGLANG_VERSION already installed"
fi

if [ "$FORCE" = 1 ] || ! ours_ok || ! "$VPY" -c "import safetensors, click, click_option_group, gguf, pyarrow, pytest, hypothesis, ninja" 2>/dev/null; then
  log "installing dspine-batch (editable, --no-deps) and light deps"
  "${PIP[@]}" -q "${LIGHT_DEPS[@]}" "torch==$TORCH_VERSION" "sglang==$SGLANG_VERSION"
  "${PIP[@]}" -q --no-deps -e .
else
  log "dspine-batch already installed in $VENV"
fi

"$VPY" - <<PYEOF
from importlib.metadata import version
print("[setup_sglang_venv] ready:", "$VENV", "torch", version("torch"), "sglang", version("sglang"),
      "transformers", version("transformers"))
PYEOF
