#!/usr/bin/env bash
# submit-nightly.sh JOB.toml BASE_DIR [extra generate flags...]
# Submits JOB.toml as a Slurm array job into BASE_DIR/<YYYY-MM-DD> with a per-night seed, plus the finalize job
# (afterok). Run from cron (see jobs/cron.example). Idempotent per day: if tonight's array is already queued or
# running, it does nothing; if OUTDIR is already finalized (_SUCCESS), it does nothing.
set -euo pipefail
job=${1:?usage: submit-nightly.sh JOB.toml BASE_DIR [generate flags...]}
base=${2:?usage: submit-nightly.sh JOB.toml BASE_DIR [generate flags...]}
shift 2
day=${DSPINE_NIGHTLY_DATE:-$(date +%F)}
out="$base/$day"
name="$(basename "$job" .toml)-$day"
[ -f /etc/profile.d/slurm.sh ] && . /etc/profile.d/slurm.sh
if [ -e "$out/_SUCCESS" ]; then echo "$(date -u +%FT%TZ) $out already finalized"; exit 0; fi
if [ -n "$(squeue -h -u "$(id -un)" -n "$name" -o %i 2>/dev/null || true)" ]; then
    echo "$(date -u +%FT%TZ) $name is already queued/running"; exit 0
fi
echo "$(date -u +%FT%TZ) submitting $job -> $out"
exec dspine-batch slurm "$job" -o "$out" --set "job_name=$name" --submit -- --seed "${day//-/}" "$@"
