#!/usr/bin/env bash
# Single-node Slurm cluster on this machine, for tests of slurm/hosfl.sbatch.
#
#   slurm/local_cluster.sh up       start munged (unless one answers), slurmctld and slurmd; wait for an idle node
#   slurm/local_cluster.sh down     scancel leftovers, stop what `up` started, remove the state directory
#   slurm/local_cluster.sh status   sinfo/squeue against this cluster
#   slurm/local_cluster.sh env      print `export SLURM_CONF=...` for this cluster
#
# `up` prints `export SLURM_CONF=<state dir>/slurm.conf` on stdout (logs go to stderr), so
#   eval "$(slurm/local_cluster.sh up)"
# points sbatch/sinfo/scontrol in the calling shell at this cluster. Needs root and the Debian packages
# slurm-wlm and munge. Both subcommands are safe to repeat: `up` on a running cluster only waits for the
# node, `down` with nothing running does nothing.
#
# Environment:
#   HOSFL_SLURM_DIR        state directory: slurm.conf, logs, pid files, spool, state  [/tmp/hosfl-slurm]
#   HOSFL_SLURM_PORT       slurmctld port; slurmd uses the next one  [6817]
#   HOSFL_SLURM_WAIT       seconds `up` waits for the node to become idle  [60]
#   HOSFL_SLURM_KEEP_LOGS  1: when `up` fails, leave the state directory for inspection  [0]
#
# Why the config looks the way it does (Slurm 22.05, Debian 12, also inside containers/gVisor):
#   ProctrackType=proctrack/linuxproc, TaskPlugin=task/none  no cgroup plugin is ever loaded, so no cgroup.conf
#                                                              and no writable cgroup hierarchy are needed
#   NodeName line from `slurmd -C`                             the node registers with exactly the topology slurmd
#                                                              detects; a mismatch (e.g. RealMemory too high) drains it
#   SelectTypeParameters=CR_CPU                                memory is not a consumable resource
#   ReturnToService=2                                          the node comes back from DOWN as soon as slurmd registers
#   AccountingStorageType=accounting_storage/none, JobAcctGatherType=jobacct_gather/none  no slurmdbd
#   MinJobAge=16                                               sbatch --wait polls after 2 s, then every 8 s (its
#                                                              backoff grows while below MinJobAge/2, so the default
#                                                              300 gives 2, 10, 42, 74 s); finished jobs stay in
#                                                              `scontrol show job` for at least 16 s
#   AuthInfo=cred_expire=5                                     a requeued job may start again 6 s after the requeue
#                                                              (cred_expire + 1 s; the default is 121 s)
#   SchedulerParameters=sched_interval=1,bf_interval=1         only the periodic pass of the main scheduler starts a
#                                                              job whose begin time has come (default: every 60 s),
#                                                              so a requeued job starts within 7 s; the backfill
#                                                              pass (default: every 30 s) starts a new one in ~1 s
set -euo pipefail

STATE_DIR=${HOSFL_SLURM_DIR:-/tmp/hosfl-slurm}
CTLD_PORT=${HOSFL_SLURM_PORT:-6817}
WAIT_S=${HOSFL_SLURM_WAIT:-60}
KEEP_LOGS=${HOSFL_SLURM_KEEP_LOGS:-0}

CONF="$STATE_DIR/slurm.conf"
CTLD_PID="$STATE_DIR/slurmctld.pid"
SLURMD_PID="$STATE_DIR/slurmd.pid"
MUNGED_PID="$STATE_DIR/munged.pid"  # exists only if `up` started munged
MUNGE_KEY=/etc/munge/munge.key
MUNGE_SOCKET_DIR=/run/munge

log() { echo "local_cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

require() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (slurmd launches jobs as the submitting user)"
    local cmd
    for cmd in munge unmunge munged slurmctld slurmd sbatch sinfo scontrol squeue scancel; do
        command -v "$cmd" >/dev/null || die "'$cmd' not on PATH; install the Debian packages slurm-wlm and munge"
    done
    # slurmd reaches slurmctld, and torchrun its rendezvous, through this name
    local host
    host=$(hostname -s)
    getent hosts "$host" >/dev/null || die "hostname '$host' does not resolve; add '127.0.0.1 $host' to /etc/hosts"
}

alive() {  # alive PIDFILE: the pid in PIDFILE names a running process
    [[ -s $1 ]] && kill -0 "$(<"$1")" 2>/dev/null
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    if munge_ok; then
        log "munged already answers; using it"
        return
    fi
    mkdir -p /etc/munge "$MUNGE_SOCKET_DIR" /var/log/munge /var/lib/munge
    if [[ ! -s $MUNGE_KEY ]]; then
        log "creating $MUNGE_KEY"
        mungekey --create --keyfile="$MUNGE_KEY" 2>/dev/null \
            || dd if=/dev/urandom of="$MUNGE_KEY" bs=1 count=1024 status=none
    fi
    # munged refuses keys readable by others and socket/log dirs writable by others
    chown munge:munge /etc/munge "$MUNGE_KEY" "$MUNGE_SOCKET_DIR" /var/log/munge /var/lib/munge
    chmod 0700 /etc/munge /var/log/munge /var/lib/munge
    chmod 0755 "$MUNGE_SOCKET_DIR"
    chmod 0400 "$MUNGE_KEY"
    runuser -u munge -- munged || fail_up "munged failed to start"
    cp "$MUNGE_SOCKET_DIR/munged.pid" "$MUNGED_PID"  # from here on, `down` stops it
    log "started munged (pid $(<"$MUNGED_PID"))"
    local i
    for ((i = 0; i < 50; i++)); do
        munge_ok && return
        sleep 0.1
    done
    fail_up "munged started but 'munge -n | unmunge' fails"
}

write_conf() {
    local host node
    host=$(hostname -s)
    # e.g. "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105"
    node=$(slurmd -C | head -n1)
    [[ $node == NodeName=* ]] || fail_up "unexpected 'slurmd -C' output: $node"
    cat >"$CONF" <<EOF
# Written by slurm/local_cluster.sh; removed by 'local_cluster.sh down'.
ClusterName=hosfl-local
SlurmctldHost=$host
SlurmctldPort=$CTLD_PORT
SlurmdPort=$((CTLD_PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$STATE_DIR/slurmctld.log
SlurmdLogFile=$STATE_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$STATE_DIR/plugstack.conf
KillWait=5
AuthInfo=cred_expire=5
SchedulerParameters=sched_interval=1,bf_interval=1
InactiveLimit=0
MinJobAge=16
$node State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    : >"$STATE_DIR/plugstack.conf"  # keep the host's /etc/slurm/plugstack.conf out of this cluster
}

log_tails() {
    local f
    for f in "$STATE_DIR/slurmctld.log" "$STATE_DIR/slurmd.log" /var/log/munge/munged.log; do
        [[ -r $f ]] || continue
        echo "----- tail $f" >&2
        tail -n 20 "$f" >&2
    done
}

node_state() { sinfo --noheader --Node --format=%t 2>/dev/null | head -n1; }

wait_idle() {
    local deadline=$((SECONDS + WAIT_S)) state="" pidfile
    while ((SECONDS < deadline)); do
        for pidfile in "$CTLD_PID" "$SLURMD_PID"; do
            if [[ -s $pidfile ]] && ! alive "$pidfile"; then
                log "$(basename "$pidfile" .pid) exited"
                return 1
            fi
        done
        state=$(node_state)
        [[ $state == idle ]] && return 0
        sleep 0.5
    done
    log "node not idle after ${WAIT_S}s (last sinfo state: '${state:-none}')"
    return 1
}

fail_up() {
    log_tails
    if [[ $KEEP_LOGS == 1 ]]; then
        log "keeping $STATE_DIR (HOSFL_SLURM_KEEP_LOGS=1); run 'local_cluster.sh down' when done"
    else
        down
    fi
    die "$1"
}

up() {
    require
    export SLURM_CONF="$CONF"
    if alive "$CTLD_PID" && alive "$SLURMD_PID"; then
        log "already up ($CONF)"
        wait_idle || fail_up "running cluster is not healthy"
        echo "export SLURM_CONF=$CONF"
        return
    fi
    down  # clear a half-started cluster or stale state
    mkdir -p "$STATE_DIR/state" "$STATE_DIR/spool"
    chmod 0755 "$STATE_DIR" "$STATE_DIR/spool"  # slurmd runs job scripts from its spool directory
    start_munge
    write_conf
    # -i: ignore errors in (absent) saved state; both daemons fork and write their pid files
    slurmctld -i -f "$CONF" || fail_up "slurmctld failed to start"
    slurmd -f "$CONF" || fail_up "slurmd failed to start"
    wait_idle || fail_up "cluster did not come up"
    log "up: node $(hostname -s) idle, SLURM_CONF=$CONF"
    echo "export SLURM_CONF=$CONF"
}

stop_pidfiles() {  # stop_pidfiles PIDFILE...: SIGTERM all at once, wait up to 10 s, then SIGKILL the rest
    local pidfile pid i
    local -a pids=()
    for pidfile in "$@"; do
        alive "$pidfile" || continue
        pid=$(<"$pidfile")
        kill -TERM "$pid" 2>/dev/null && pids+=("$pid") && log "stopping $(basename "$pidfile" .pid) (pid $pid)"
    done
    for ((i = 0; i < 100 && ${#pids[@]} > 0; i++)); do
        for pid in "${!pids[@]}"; do
            kill -0 "${pids[pid]}" 2>/dev/null || unset 'pids[pid]'
        done
        sleep 0.1
    done
    for pid in "${pids[@]}"; do
        log "pid $pid ignored SIGTERM; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    done
}

down() {
    [[ -d $STATE_DIR ]] || return 0
    export SLURM_CONF="$CONF"
    if alive "$CTLD_PID" && alive "$SLURMD_PID"; then
        # cancel leftover jobs while slurmd can still reap their slurmstepd processes
        local jobs i
        jobs=$(squeue --noheader --format=%i 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            log "cancelling leftover jobs: ${jobs//$'\n'/ }"
            # shellcheck disable=SC2086  # one job id per word
            scancel $jobs 2>/dev/null || true
            for ((i = 0; i < 30; i++)); do
                [[ -z $(squeue --noheader --format=%i 2>/dev/null) ]] && break
                sleep 0.5
            done
        fi
    fi
    stop_pidfiles "$SLURMD_PID" "$CTLD_PID" "$MUNGED_PID"  # munged only if `up` started it
    rm -rf "$STATE_DIR"
}

status() {
    export SLURM_CONF="$CONF"
    alive "$CTLD_PID" || { log "down (no slurmctld for $CONF)"; return 1; }
    sinfo
    squeue
}

case ${1:-} in
    up) up ;;
    down) down ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
