#!/usr/bin/env bash
# The whole test suite, as CI runs it (README's test command, on a fresh machine):
#   0. set-up: `scripts/setup.sh --test` (the runtime, the [test] extra, Azurite; seconds when already in place);
#   1. the default suite in this interpreter (CPU; `slow`, `sglang` and `slurm` tests excluded);
#   2. the `sglang` tests inside the SGLang virtualenv (scripts/ci/ci_sglang.sh builds/reuses it; ~11 GB, ~7 min cold);
#   3. the `slurm` tests against a one-node Slurm cluster started for them (scripts/ci/ci_slurm.sh).
# Skip 2 or 3 locally with DSPINE_TEST_SKIP="sglang slurm".
#
#   bash scripts/ci/test.sh           everything above
#   bash scripts/ci/test.sh --quick   a contributor's check before a commit: set-up, ruff, and the default suite's
#                                     core (tests/house, inputs, requests, run, outdir, ops, stages, the CLI's help and main commands; stops
#                                     at the first failure); no SGLang, Slurm or Azurite (az:// tests skip)
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
skip=" ${DSPINE_TEST_SKIP:-} "
quick=0
[ "${1:-}" = --quick ] && quick=1
if [ "$quick" = 1 ]; then
  DSPINE_SKIP_AZURITE=1 DSPINE_SKIP_PROMETHEUS=1 bash scripts/setup.sh --test || exit 1
  "$PY" -m ruff check . || exit 1
  exec "$PY" -m pytest -q -x -m "not slow and not sglang and not slurm" -p no:cacheprovider \
    tests/house tests/inputs tests/requests tests/run tests/outdir tests/ops tests/stages tests/cli/test_cli.py tests/cli/test_help.py
fi
bash scripts/setup.sh --test || exit 1
fail=0
run() {
  echo "=== $*"
  "$@" || { echo "=== FAILED: $*" >&2; fail=1; }
}
# the az:// tests fail (not skip) without Azurite here: scripts/setup.sh installed it (scripts/ci/install_azurite.sh)
export DSPINE_REQUIRE_AZURITE=${DSPINE_REQUIRE_AZURITE:-1}
# and the metrics tests without Prometheus and its Pushgateway (scripts/ci/install_prometheus.sh)
export DSPINE_REQUIRE_PROMETHEUS=${DSPINE_REQUIRE_PROMETHEUS:-1}
# --durations: the 30 slowest tests listed at the end, so a run shows where the suite's time goes (it should stay
# well under 30 minutes on a 2-core machine)
# pytest exits 5 when it collects nothing: that is a failure for the default suite too
# a hang ends as a failure with the stacks (faulthandler after 5 min in one test; the whole suite after 55 min,
# about twice what it takes on a quiet 2-core machine), not as CI's own time-out with nothing to read
run timeout -k 30 "${DSPINE_SUITE_LIMIT:-3300}" "$PY" -m pytest -q -m "not slow and not sglang and not slurm" \
  -p no:cacheprovider -o faulthandler_timeout=300 --durations=30
[[ $skip == *" sglang "* ]] || run bash scripts/ci/ci_sglang.sh -q
[[ $skip == *" slurm "* ]] || { [ -f scripts/ci/ci_slurm.sh ] && run bash scripts/ci/ci_slurm.sh; }
exit $fail
