#!/usr/bin/env bash
# The whole test suite, as CI runs it (after scripts/setup.sh):
#   1. the default suite in this interpreter (CPU; `slow`, `sglang` and `slurm` tests excluded);
#   2. the `sglang` tests inside the SGLang virtualenv (scripts/ci/ci_sglang.sh builds/reuses it; ~11 GB, ~7 min cold);
#   3. the `slurm` tests against a one-node Slurm cluster started for them (scripts/ci/ci_slurm.sh).
# Skip 2 or 3 locally with DSPINE_TEST_SKIP="sglang slurm".
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
skip=" ${DSPINE_TEST_SKIP:-} "
fail=0
run() {
  echo "=== $*"
  "$@" || { echo "=== FAILED: $*" >&2; fail=1; }
}
# the az:// tests fail (not skip) without Azurite here: scripts/setup.sh installed it (scripts/ci/install_azurite.sh)
export DSPINE_REQUIRE_AZURITE=${DSPINE_REQUIRE_AZURITE:-1}
# pytest exits 5 when it collects nothing: that is a failure for the default suite too
run "$PY" -m pytest -q -m "not slow and not sglang and not slurm" -p no:cacheprovider
[[ $skip == *" sglang "* ]] || run bash scripts/ci/ci_sglang.sh -q
[[ $skip == *" slurm "* ]] || { [ -f scripts/ci/ci_slurm.sh ] && run bash scripts/ci/ci_slurm.sh; }
exit $fail
