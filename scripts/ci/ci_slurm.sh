#!/usr/bin/env bash
# CI for Slurm: start a private one-node cluster (scripts/ci/local-cluster.sh, which installs
# slurmctld/slurmd/munge with apt-get if missing), run the `slurm`-marked tests against it, stop it on exit.
#
#   bash scripts/ci/ci_slurm.sh [pytest args...]
#
# Environment: LOCAL_SLURM_DIR (instance dir, default /tmp/local-slurm), LOCAL_SLURM_CPUS (CPUs the node
# advertises, default 8 so a 4-task array runs at once; more than the real cores is fine),
# DSPINE_SLURM_KEEP=1 leaves the cluster running afterwards (for debugging). Needs root (the daemons run as
# root). Safe to run twice: `local-cluster.sh start` is idempotent, and a cluster that was already up in
# LOCAL_SLURM_DIR before this script started is used and left running (only a cluster started here is stopped).
# Exit status: pytest's, except that "no tests collected" (5) or all-skipped is an error: the tests must run.
set -euo pipefail
cd "$(dirname "$0")/../.."
cluster=scripts/ci/local-cluster.sh
export LOCAL_SLURM_DIR=${LOCAL_SLURM_DIR:-/tmp/local-slurm}
export LOCAL_SLURM_CPUS=${LOCAL_SLURM_CPUS:-8}

preexisting=0
if [ -s "$LOCAL_SLURM_DIR/env.sh" ] && command -v sinfo >/dev/null && bash "$cluster" status "$LOCAL_SLURM_DIR" 2>/dev/null; then
    preexisting=1
    echo "[ci_slurm] a cluster is already running in $LOCAL_SLURM_DIR: using it, and leaving it up" >&2
fi

cleanup() {
    local rc=$?
    if [ "$preexisting" = 1 ]; then
        :
    elif [ "${DSPINE_SLURM_KEEP:-0}" = 1 ]; then
        echo "[ci_slurm] leaving the cluster up: source $LOCAL_SLURM_DIR/env.sh; stop: $cluster stop $LOCAL_SLURM_DIR" >&2
    else
        bash "$cluster" stop "$LOCAL_SLURM_DIR" >&2 || echo "[ci_slurm] warning: $cluster stop failed" >&2
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

t0=$(date +%s)
env_lines=$(bash "$cluster" start "$LOCAL_SLURM_DIR")
eval "$env_lines"
echo "[ci_slurm] cluster up in $(( $(date +%s) - t0 ))s (SLURM_CONF=$SLURM_CONF)"
sinfo

report=$(mktemp /tmp/ci_slurm_pytest.XXXXXX)
set +e
"${PYTHON:-python3}" -m pytest -q -m slurm -p no:cacheprovider -rs "$@" tests/ops/test_slurm.py 2>&1 | tee "$report"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" = 0 ] && grep -qE '(^| )[0-9]+ skipped' "$report" && ! grep -qE '(^| )[0-9]+ passed' "$report"; then
    echo "[ci_slurm] every slurm test was skipped: the cluster is not usable" >&2
    rc=1
fi
rm -f "$report"
if [ "$rc" = 5 ]; then
    echo "[ci_slurm] no slurm tests ran" >&2
    rc=1
fi
echo "[ci_slurm] done in $(( $(date +%s) - t0 ))s, exit $rc"
exit "$rc"
