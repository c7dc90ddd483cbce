#!/usr/bin/env bash
# A private one-node Slurm cluster for tests (munged + slurmctld + slurmd, no accounting, no cgroups).
#
#   scripts/ci/local-cluster.sh start  [DIR]   # prints `export SLURM_CONF=...` lines: eval "$(... start)"
#   scripts/ci/local-cluster.sh stop   [DIR]   # stops what `start` started in DIR (and its jobs)
#   scripts/ci/local-cluster.sh status [DIR]   # exit 0 when the cluster in DIR answers with a usable node
#
# DIR (default $LOCAL_SLURM_DIR, else /tmp/local-slurm) holds everything: slurm.conf, cgroup.conf, the munge
# key, state, spool, logs and pid files. Nothing under /etc is written. Needs root: the daemons run as root,
# and Debian's slurmctld/slurmd/slurm-client/munge are installed with apt-get when missing (after
# `apt-get update`; with policy-rc.d making sure the packages' own init scripts do not start daemons).
# `start` is idempotent: if DIR's daemons already run it only waits for the node and prints the lines again.
#
# Environment (all optional): LOCAL_SLURM_CPUS (CPUs the node advertises, default nproc; more than the real
# cores is allowed), LOCAL_SLURM_MEM_MB (default 80% of MemTotal), LOCAL_SLURM_CTLD_PORT / LOCAL_SLURM_SLURMD_PORT
# (6817 / 6818), LOCAL_SLURM_KILL_WAIT (seconds between TERM and KILL on cancel or time limit, default 5),
# LOCAL_SLURM_WAIT (seconds to wait for the node to be idle, default 60), LOCAL_SLURM_NO_INSTALL=1 (never
# run apt-get). Progress goes to stderr; only the export lines go to stdout.
set -euo pipefail

say() { echo "[local-cluster] $*" >&2; }
fail() { say "error: $*"; exit 1; }

usage() { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

action=${1:-}
case "$action" in start|stop|status) ;; *) usage ;; esac
dir=${2:-${LOCAL_SLURM_DIR:-/tmp/local-slurm}}
case "$dir" in /*) ;; *) dir="$PWD/$dir" ;; esac
case "$dir" in *[[:space:]]*) fail "DIR must not contain whitespace: '$dir'" ;; esac

conf="$dir/etc/slurm.conf"
munge_socket="$dir/run/munge/munge.socket"
export SLURM_CONF="$conf"  # the daemons and the slurmstepds they start inherit it: `stop` finds strays by it
node=$(hostname -s 2>/dev/null || uname -n)
node=${node%%.*}

# pid_of NAME: the pid in DIR's pid file for daemon NAME, if that process is alive and really is NAME
# (/proc/PID/comm is checked, so a recycled pid is never signalled).
pid_of() {
    local file="$dir/run/$1.pid" pid state
    [ "$1" = munged ] && file="$dir/run/munge/munged.pid"
    [ -s "$file" ] || return 1
    pid=$(tr -cd '0-9' <"$file")
    [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] || return 1
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || true)  # comm has no spaces for our daemons
    case "$state" in Z|X|"") return 1 ;; esac
    echo "$pid"
}

alive() { case "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null || true)" in Z|X|"") return 1 ;; esac; }

node_usable() {
    [ -f "$conf" ] || return 1
    case "$(timeout 10 sinfo -h -N -n "$node" -o '%T' 2>/dev/null | head -n1)" in
        idle*|mixed*|allocated*|completing*) return 0 ;;
    esac
    return 1
}

show_logs() {
    local f
    for f in "$dir"/log/*.log; do
        [ -s "$f" ] || continue
        say "--- last lines of $f"
        tail -n 12 "$f" >&2 || true
    done
}

# --------------------------------------------------------------------------------------------- stop
# terminate PID NAME: SIGTERM, then SIGKILL if it is still there after 20 s.
terminate() {
    local pid=$1 name=$2 i
    kill -TERM "$pid" 2>/dev/null || return 0
    for i in $(seq 200); do
        alive "$pid" || { say "stopped $name (pid $pid)"; return 0; }
        sleep 0.1
    done
    say "$name (pid $pid) still running after 20 s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
}

# The slurmstepd processes of this instance (their environment carries our SLURM_CONF) and all their
# descendants: what is left of jobs when slurmctld could not cancel them.
leftover_steps() {
    local p pid roots=""
    for p in /proc/[0-9]*; do
        pid=${p#/proc/}
        [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ] && alive "$pid" || continue
        { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -qxF "SLURM_CONF=$conf" && roots="$roots $pid"
    done
    [ -n "$roots" ] || return 0
    # parent links of every process, then a transitive closure from the roots
    for p in /proc/[0-9]*/stat; do
        sed -E 's/^([0-9]+) \(.*\) [A-Za-z] ([0-9]+) .*/\1 \2/' "$p" 2>/dev/null || true
    done | awk -v roots="$roots" '
        { parent[$1] = $2 }
        END {
            n = split(roots, r, " ")
            for (i = 1; i <= n; i++) { keep[r[i]] = 1; print r[i] }
            do {
                grew = 0
                for (c in parent) if (!(c in keep) && (parent[c] in keep)) { keep[c] = 1; grew = 1; print c }
            } while (grew)
        }'
}

stop_cluster() {
    local ctld slurmd munged jobs i strays
    ctld=$(pid_of slurmctld || true)
    slurmd=$(pid_of slurmd || true)
    munged=$(pid_of munged || true)
    if [ -z "$ctld$slurmd$munged" ]; then
        say "nothing running in $dir"
    fi
    # Cancel the jobs first, so that slurmstepd ends the job processes the normal way.
    if [ -n "$ctld" ] && [ -n "$munged" ]; then
        jobs=$(timeout 10 squeue -h -o '%A' 2>/dev/null | sort -u | tr '\n' ' ' || true)
        if [ -n "${jobs// /}" ]; then
            say "cancelling jobs $jobs"
            # shellcheck disable=SC2086
            timeout 10 scancel $jobs 2>/dev/null || true
            for i in $(seq 100); do
                [ -z "$(timeout 10 squeue -h -t R,CG,S,ST,SO -o '%A' 2>/dev/null || true)" ] && break
                sleep 0.2
            done
        fi
    fi
    [ -n "$slurmd" ] && terminate "$slurmd" slurmd
    [ -n "$ctld" ] && terminate "$ctld" slurmctld
    strays=$(leftover_steps | tr '\n' ' ')
    if [ -n "${strays// /}" ]; then
        say "killing leftover job steps and their processes: $strays"
        # shellcheck disable=SC2086
        kill -KILL $strays 2>/dev/null || true
    fi
    [ -n "$munged" ] && terminate "$munged" munged  # last: slurmctld and slurmd need it until they exit
    rm -f "$dir/run/slurmctld.pid" "$dir/run/slurmd.pid" "$dir/run/munge/munged.pid"
    return 0
}

# --------------------------------------------------------------------------------------------- start
install_packages() {
    local missing=() b log
    for b in munged munge unmunge slurmctld slurmd sbatch squeue sinfo scontrol scancel srun; do
        command -v "$b" >/dev/null 2>&1 || missing+=("$b")
    done
    [ "${#missing[@]}" = 0 ] && return 0
    [ "${LOCAL_SLURM_NO_INSTALL:-0}" = 1 ] && fail "missing ${missing[*]} (and LOCAL_SLURM_NO_INSTALL=1)"
    command -v apt-get >/dev/null || fail "missing ${missing[*]}, and there is no apt-get to install them"
    say "missing ${missing[*]}: installing slurmctld slurmd slurm-client munge with apt-get"
    log=$(mktemp /tmp/local-cluster-apt.XXXXXX)
    local own_policy=0 rc=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then  # keep the packages from starting the distribution's daemons
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        own_policy=1
    fi
    {
        apt-get update -q &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
                slurmctld slurmd slurm-client munge
    } </dev/null >"$log" 2>&1 || rc=$?
    [ "$own_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
    if [ "$rc" != 0 ]; then
        tail -n 20 "$log" >&2
        fail "apt-get failed (exit $rc; full log $log)"
    fi
    rm -f "$log"
}

write_config() {
    local cpus=${LOCAL_SLURM_CPUS:-$(nproc)}
    local mem=${LOCAL_SLURM_MEM_MB:-$(awk '/^MemTotal:/ {printf "%d", $2 * 0.8 / 1024}' /proc/meminfo)}
    cat >"$conf" <<EOF
# Written by scripts/ci/local-cluster.sh: a one-node test cluster living entirely in $dir.
ClusterName=dspine-local
SlurmctldHost=${node}(127.0.0.1)
NodeName=${node} NodeAddr=127.0.0.1 CPUs=${cpus} Sockets=1 CoresPerSocket=${cpus} ThreadsPerCore=1 RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=${node} Default=YES MaxTime=INFINITE State=UP
SlurmctldPort=${LOCAL_SLURM_CTLD_PORT:-6817}
SlurmdPort=${LOCAL_SLURM_SLURMD_PORT:-6818}
SlurmUser=root
SlurmdUser=root
# munge through our own socket; a credential lives 10 s, which is also how soon a requeued job may start again
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=${munge_socket},cred_expire=10
StateSaveLocation=${dir}/state
SlurmdSpoolDir=${dir}/spool
SlurmctldPidFile=${dir}/run/slurmctld.pid
SlurmdPidFile=${dir}/run/slurmd.pid
SlurmctldLogFile=${dir}/log/slurmctld.log
SlurmdLogFile=${dir}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# containers rarely let us manage cgroups: follow job processes through the process tree instead
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# look at pending (e.g. requeued) jobs every second instead of every 30-60 s
SchedulerParameters=sched_interval=1,bf_interval=1
# the node may advertise more CPUs than it has (tests run more one-CPU tasks than there are cores)
SlurmdParameters=config_overrides
# refuse jobs that can never fit instead of queueing them forever
EnforcePartLimits=ALL
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
InactiveLimit=0
KillWait=${LOCAL_SLURM_KILL_WAIT:-5}
# finished jobs stay visible to squeue/scontrol for an hour (tests read their final state)
MinJobAge=3600
SlurmctldTimeout=60
SlurmdTimeout=60
Waittime=0
EOF
    # Read from next to slurm.conf; with proctrack/linuxproc and task/none no cgroup is created or constrained.
    cat >"$dir/etc/cgroup.conf" <<EOF
# Written by scripts/ci/local-cluster.sh: this cluster does not use cgroups (see ProctrackType in slurm.conf).
CgroupAutomount=no
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF
}

prepare_dir() {
    # A fresh cluster each start: job ids restart at 1 and no old job comes back from saved state.
    rm -rf "$dir/state" "$dir/spool"
    mkdir -p "$dir/etc" "$dir/state" "$dir/spool" "$dir/log" "$dir/run/munge"
    # munged refuses a socket directory others cannot reach and a key others can read or replace, and
    # clients must be able to traverse every folder above the socket (mktemp -d makes 0700 folders).
    chmod 755 "$dir" "$dir/etc" "$dir/run" "$dir/run/munge" "$dir/log"
    local up=$dir
    while [ "$up" != / ]; do
        [ -x "$up" ] && [ $(( $(stat -c '%a' "$up") % 2 )) = 1 ] || chmod go+x "$up"
        up=$(dirname "$up")
    done
    rm -f "$munge_socket" "$munge_socket.lock" "$dir"/run/*.pid "$dir/run/munge/munged.pid"
    if [ ! -s "$dir/etc/munge.key" ]; then
        head -c 1024 /dev/urandom >"$dir/etc/munge.key"
    fi
    chmod 600 "$dir/etc/munge.key"
}

# wait_for TEST SECONDS WHAT: poll TEST every 0.2 s; on timeout show the logs and fail.
wait_for() {
    local test=$1 seconds=$2 what=$3 end=$((SECONDS + $2))
    while ! eval "$test"; do
        if [ "$SECONDS" -ge "$end" ]; then
            show_logs
            fail "$what (waited ${seconds}s)"
        fi
        sleep 0.2
    done
}

wait_for_node() {
    local end=$((SECONDS + ${LOCAL_SLURM_WAIT:-60}))
    until node_usable; do
        pid_of slurmctld >/dev/null || { show_logs; fail "slurmctld exited"; }
        pid_of slurmd >/dev/null || { show_logs; fail "slurmd exited"; }
        if [ "$SECONDS" -ge "$end" ]; then
            sinfo -R >&2 || true
            show_logs
            fail "node $node is not idle after ${LOCAL_SLURM_WAIT:-60}s"
        fi
        # a node that registered as down or drained (e.g. after an unclean stop) is put back in service
        scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true
        sleep 0.5
    done
}

print_exports() {
    printf 'export SLURM_CONF=%s\nexport LOCAL_SLURM_DIR=%s\n' "$conf" "$dir" | tee "$dir/env.sh"
}

start_cluster() {
    local started=$SECONDS
    [ "$(id -u)" = 0 ] || fail "must run as root (the daemons run as root)"
    install_packages
    if pid_of munged >/dev/null && pid_of slurmctld >/dev/null && pid_of slurmd >/dev/null; then
        say "already running in $dir"
        wait_for_node
        print_exports
        return 0
    fi
    if pid_of munged >/dev/null || pid_of slurmctld >/dev/null || pid_of slurmd >/dev/null; then
        say "a partly running cluster in $dir: stopping it first"
        stop_cluster
    fi
    trap 'rc=$?; if [ "$rc" != 0 ]; then say "start failed: stopping what was started"; stop_cluster; fi' EXIT
    prepare_dir
    write_config

    say "starting munged"
    munged --socket="$munge_socket" --key-file="$dir/etc/munge.key" --pid-file="$dir/run/munge/munged.pid" \
        --log-file="$dir/log/munged.log" --seed-file="$dir/run/munge/munged.seed" \
        </dev/null >>"$dir/log/munged.log" 2>&1 || { show_logs; fail "munged did not start"; }
    wait_for 'munge -n -S "$munge_socket" 2>/dev/null | unmunge -S "$munge_socket" >/dev/null 2>&1' 10 \
        "munged does not answer on $munge_socket"

    say "starting slurmctld"
    slurmctld -f "$conf" </dev/null >>"$dir/log/slurmctld.log" 2>&1 || { show_logs; fail "slurmctld did not start"; }
    wait_for 'pid_of slurmctld >/dev/null' 10 "slurmctld did not write its pid file"
    say "starting slurmd"
    slurmd -f "$conf" -N "$node" </dev/null >>"$dir/log/slurmd.log" 2>&1 || { show_logs; fail "slurmd did not start"; }
    wait_for 'pid_of slurmd >/dev/null' 10 "slurmd did not write its pid file"
    wait_for_node
    trap - EXIT
    say "ready in $((SECONDS - started))s: node $node, partition debug; logs in $dir/log"
    print_exports
}

status_cluster() {
    if node_usable; then
        sinfo >&2
        return 0
    fi
    say "no usable cluster in $dir"
    return 1
}

case "$action" in
    start) mkdir -p "$dir"; start_cluster ;;
    stop) stop_cluster ;;
    status) status_cluster ;;
esac
