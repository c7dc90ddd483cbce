#!/usr/bin/env bash
# CI for the SGLang backend: set up (or reuse) the sglang venv and run the `sglang`-marked tests in it.
#
# The venv (~11 GB: torch 2.14.1 CUDA build + sglang 0.5.23 pins) lives where setup_sglang_venv.sh puts it:
# $DSPINE_SGLANG_VENV, default venv-sglang in the dspine cache (${DSPINE_CACHE_DIR:-~/.cache/dspine}), outside the
# work tree, so CI on a reused machine (a fresh clone each run) keeps it; setup_sglang_venv.sh re-installs only what
# is missing and re-points the editable install at this checkout. Cold: ~7 min; warm: seconds.
#
# The end-to-end tests run the real sglang.Engine on the CPU (dspine.sglang.cpu: SGLang's CPU test path), on
# tiny checkpoints built in fixtures (dense Qwen3 and Qwen3.5 hybrid targets), with SGLang's overlap scheduler on as
# on a GPU, and DFlash's draft-graph branch (the selector sampler a GPU captures) run eagerly: 15 engine starts of
# about a minute each on a small CPU. Then the plugin's end-to-end tests that make the request contract (greedy
# identity, penalties, min_tokens, logit_bias, grammars, suffix proposals, per-source stats) run again with the
# plain scheduler loop and the eager selector (DSPINE_SGLANG_OVERLAP=0 DSPINE_SGLANG_GRAPH_TWIN=0): 6 more engine
# starts, ~7 min.
#
# Exit status: pytest's, except that "no tests collected" (5) is an error here too: the sglang tests must run.
set -euo pipefail
cd "$(dirname "$0")/../.."
export DSPINE_SGLANG_VENV=${DSPINE_SGLANG_VENV:-${DSPINE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dspine}/venv-sglang}
t0=$(date +%s)
bash scripts/setup_sglang_venv.sh
echo "[ci_sglang] venv ready in $(( $(date +%s) - t0 ))s at $DSPINE_SGLANG_VENV ($(du -sh "$DSPINE_SGLANG_VENV" 2>/dev/null | cut -f1))"
unset SGLANG_PLUGINS  # the tests set it where they need it
# A hang must end as a failure with every thread's stack, not as CI's own time-out: faulthandler prints the stacks
# of a test (its fixtures included) still running after 10 min, and each pass has a hard limit (about 2.5x what it
# takes on a quiet 2-core machine; DSPINE_SGLANG_PASS_LIMIT scales both, in seconds for the first).
limit=${DSPINE_SGLANG_PASS_LIMIT:-1800}
PYTEST=("$DSPINE_SGLANG_VENV/bin/python" -m pytest -m sglang -p no:cacheprovider -W ignore::DeprecationWarning
        -o faulthandler_timeout=600)
set +e
timeout -k 30 "$limit" "${PYTEST[@]}" "$@" \
  tests/sglang_plugin/test_sglang_plugin.py tests/sglang_plugin/test_sglang_e2e.py \
  tests/sglang_plugin/test_sglang_requests.py tests/cli/test_sglang_cli.py tests/engines/test_sglang_engine.py
rc=$?
if [ "$rc" = 0 ]; then
  echo "[ci_sglang] the request contract again: plain scheduler loop, eager selector"
  DSPINE_SGLANG_OVERLAP=0 DSPINE_SGLANG_GRAPH_TWIN=0 timeout -k 30 $(( limit / 2 )) "${PYTEST[@]}" "$@" tests/sglang_plugin/test_sglang_requests.py \
    tests/sglang_plugin/test_sglang_e2e.py -k "test_sglang_requests or (not hybrid and (greedy_dspine or \
custom_logit or suffix_proposals_keep or no_round_reads or retraction or branch_a_gpu))"
  rc=$?
fi
set -e
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  echo "[ci_sglang] a pass ran past its limit (DSPINE_SGLANG_PASS_LIMIT=$limit s): a hang; the stacks are above" >&2
  exit 1
fi
if [ "$rc" = 5 ]; then
  echo "[ci_sglang] no sglang tests ran" >&2
  exit 1
fi
exit "$rc"
