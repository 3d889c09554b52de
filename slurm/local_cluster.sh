#!/usr/bin/env bash
# A Slurm cluster of one or more nodes on this machine, for tests of slurm/hosfl.sbatch.
#
#   slurm/local_cluster.sh up [--nodes N]   start munged, slurmctld and one slurmd per node; wait until all are idle
#   slurm/local_cluster.sh down             scancel leftovers, stop what `up` started, remove the state directory
#   slurm/local_cluster.sh status           sinfo/squeue against this cluster
#   slurm/local_cluster.sh env              print `export SLURM_CONF=...` for this cluster
#   slurm/local_cluster.sh kill-node NODE   the node dies: SIGKILL its slurmd, its slurmstepd processes and all they
#                                           started (the job processes of its steps); the other nodes live on
#   slurm/local_cluster.sh start-node NODE  start the node's slurmd again; wait until it has registered
#
# `up` prints `export SLURM_CONF=<state dir>/slurm.conf` on stdout (logs go to stderr), so
#   eval "$(slurm/local_cluster.sh up --nodes 2)"
# points sbatch/sinfo/scontrol in the calling shell at this cluster. Needs root and the Debian packages
# slurm-wlm and munge. `up` on a running cluster only waits for its nodes; `down` with nothing running does nothing.
#
# One node is named after this host (`slurmd -C`). Two or more are hosfl-n1, hosfl-n2, ...: Slurm's multiple-slurmd
# mode (`slurmd -N <node>`, a NodeName line per node with its own Port=, all with this host's NodeHostname and
# NodeAddr; `scontrol show config` says MULTIPLE_SLURMD = Yes for Debian's build). Every node gets the whole
# machine's CPUs (`slurmd -C`), so two nodes oversubscribe its cores. Their names are added to /etc/hosts (one line
# marked with the state directory, removed by `down`): hosfl.sbatch puts the c10d rendezvous on the first node's
# name. All nodes share this host's network namespace; ranks meet over its address.
#
# Environment:
#   HOSFL_SLURM_DIR        state directory: slurm.conf, logs, pid files, munged, spool, state  [/tmp/hosfl-slurm]
#   HOSFL_SLURM_NODES      number of nodes, unless `up --nodes N` says  [1]
#   HOSFL_SLURM_PORT       slurmctld port; the slurmd of node i (from 1) uses port + i  [6817]
#   HOSFL_SLURM_WAIT       seconds `up` and `start-node` wait for nodes to become idle  [60]
#   HOSFL_SLURM_KEEP_LOGS  1: when `up` fails, leave the state directory for inspection  [0]
#
# Why the config looks the way it does (Slurm 22.05, Debian 12, also inside containers/gVisor):
#   a munged of its own                                        on a socket in the state directory with a key made
#                                                              for this cluster (AuthInfo=socket=...): clusters
#                                                              started side by side never share or stop each
#                                                              other's munged, and /etc/munge is not touched
#   ProctrackType=proctrack/linuxproc, TaskPlugin=task/none  no cgroup plugin is ever loaded, so no cgroup.conf
#                                                              and no writable cgroup hierarchy are needed
#   node lines from `slurmd -C`                                a node registers with exactly the topology slurmd
#                                                              detects; a mismatch (e.g. RealMemory too high) drains it
#   SelectTypeParameters=CR_CPU                                memory is not a consumable resource
#   ReturnToService=2                                          a node comes back from DOWN as soon as slurmd registers
#   SlurmdTimeout=10                                           a node whose slurmd stopped answering is DOWN after
#                                                              about 25 s (default 300 s), and its jobs requeued
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
NODES=${HOSFL_SLURM_NODES:-1}
WAIT_S=${HOSFL_SLURM_WAIT:-60}
KEEP_LOGS=${HOSFL_SLURM_KEEP_LOGS:-0}
RESUME_DELAY_S=3  # start-node: seconds a node stays drained after its slurmd has registered

CONF="$STATE_DIR/slurm.conf"
CTLD_PID="$STATE_DIR/slurmctld.pid"
NODE_LIST="$STATE_DIR/nodes"  # the node names, one a line
MUNGE_DIR="$STATE_DIR/munge"
MUNGE_SOCKET="$MUNGE_DIR/munge.sock"
MUNGED_PID="$MUNGE_DIR/munged.pid"
HOSTS=/etc/hosts
HOSTS_MARK="# slurm/local_cluster.sh $STATE_DIR"  # ends the /etc/hosts line of this cluster's node names

log() { echo "local_cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

slurmd_pid() { echo "$STATE_DIR/slurmd-$1.pid"; }  # SlurmdPidFile=.../slurmd-%n.pid
spool() { echo "$STATE_DIR/spool/$1"; }              # SlurmdSpoolDir=.../spool/%n
nodes() { [[ -s $NODE_LIST ]] && cat "$NODE_LIST"; }
node_words() { nodes | paste -sd ' ' -; }  # the node names on one line

require() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (slurmd launches jobs as the submitting user)"
    local cmd
    for cmd in munge unmunge munged slurmctld slurmd sbatch sinfo scontrol squeue scancel runuser; do
        command -v "$cmd" >/dev/null || die "'$cmd' not on PATH; install the Debian packages slurm-wlm and munge"
    done
    # slurmd reaches slurmctld, and torchrun its rendezvous, through this name
    local host
    host=$(hostname -s)
    getent hosts "$host" >/dev/null || die "hostname '$host' does not resolve; add '127.0.0.1 $host' to /etc/hosts"
    [[ $NODES =~ ^[1-9][0-9]*$ ]] || die "--nodes / HOSFL_SLURM_NODES must be a positive integer, not '$NODES'"
}

alive() {  # alive PIDFILE: the pid in PIDFILE names a running process
    [[ -s $1 ]] && kill -0 "$(<"$1")" 2>/dev/null
}

munge_ok() { munge --socket="$MUNGE_SOCKET" -n 2>/dev/null | unmunge --socket="$MUNGE_SOCKET" >/dev/null 2>&1; }

start_munge() {
    # munged refuses a key readable by others and a socket directory that not everyone may enter
    mkdir -p "$MUNGE_DIR"
    chmod 0755 "$MUNGE_DIR"
    mungekey --create --keyfile="$MUNGE_DIR/munge.key" 2>/dev/null \
        || dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1 count=1024 status=none
    chmod 0400 "$MUNGE_DIR/munge.key"
    chown -R munge:munge "$MUNGE_DIR"
    runuser -u munge -- munged --socket="$MUNGE_SOCKET" --key-file="$MUNGE_DIR/munge.key" \
        --pid-file="$MUNGED_PID" --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed" \
        || fail_up "munged failed to start"
    local i
    for ((i = 0; i < 50; i++)); do
        munge_ok && { log "started munged (pid $(<"$MUNGED_PID"), socket $MUNGE_SOCKET)"; return; }
        sleep 0.1
    done
    fail_up "munged started but 'munge -n | unmunge' fails on $MUNGE_SOCKET"
}

node_names() {  # the names of NODES nodes: this host's for one, hosfl-n1 ... for more
    local i
    if ((NODES == 1)); then
        hostname -s
    else
        for ((i = 1; i <= NODES; i++)); do echo "hosfl-n$i"; done
    fi
}

write_conf() {
    local host topology name i=0
    host=$(hostname -s)
    # e.g. "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105"
    topology=$(slurmd -C | head -n1)
    [[ $topology == NodeName=* ]] || fail_up "unexpected 'slurmd -C' output: $topology"
    topology=${topology#NodeName=* }
    node_names >"$NODE_LIST"
    cat >"$CONF" <<EOF
# Written by slurm/local_cluster.sh; removed by 'local_cluster.sh down'.
ClusterName=hosfl-local
SlurmctldHost=$host
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
AuthInfo=cred_expire=5,socket=$MUNGE_SOCKET
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout=10
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$STATE_DIR/spool/%n
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$STATE_DIR/slurmd-%n.pid
SlurmctldLogFile=$STATE_DIR/slurmctld.log
SlurmdLogFile=$STATE_DIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$STATE_DIR/plugstack.conf
KillWait=5
SchedulerParameters=sched_interval=1,bf_interval=1
InactiveLimit=0
MinJobAge=16
EOF
    while read -r name; do
        i=$((i + 1))
        mkdir -p "$(spool "$name")"
        chmod 0755 "$(spool "$name")"
        echo "NodeName=$name NodeHostname=$host NodeAddr=$host Port=$((CTLD_PORT + i)) $topology State=UNKNOWN"
    done <"$NODE_LIST" >>"$CONF"
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
    : >"$STATE_DIR/plugstack.conf"  # keep the host's /etc/slurm/plugstack.conf out of this cluster
}

edit_hosts() {  # edit_hosts [LINE]: drop this cluster's line from /etc/hosts, then append LINE if given
    local tmp
    (
        flock 9  # one editor at a time (clusters side by side); readers see the old file or the new one
        tmp=$(mktemp "$HOSTS.hosfl.XXXXXX")
        # every line but those that end in this cluster's mark (exactly: /tmp/a is no mark of /tmp/ab's line)
        awk -v m="$HOSTS_MARK" '{ n = length($0) - length(m) } n < 0 || substr($0, n + 1) != m' "$HOSTS" >"$tmp"
        [[ -z ${1:-} ]] || echo "$1" >>"$tmp"
        if cmp -s "$tmp" "$HOSTS"; then
            rm -f "$tmp"
            exit 0
        fi
        chmod --reference="$HOSTS" "$tmp"
        # a bind-mounted /etc/hosts (containers) cannot be replaced, only rewritten
        mv -f "$tmp" "$HOSTS" 2>/dev/null || { cat "$tmp" >"$HOSTS"; rm -f "$tmp"; }
    ) 9<"$(dirname "$HOSTS")"
}

add_hosts() {  # more than one node: their names resolve to this host's address
    ((NODES > 1)) || return 0
    local addr
    addr=$(getent hosts "$(hostname -s)" | awk '{print $1; exit}')
    edit_hosts "$addr $(node_words) $HOSTS_MARK" || fail_up "cannot add the node names to $HOSTS"
    log "added to $HOSTS: $addr $(node_words)"
}

log_tails() {
    local f
    for f in "$STATE_DIR"/slurmctld.log "$STATE_DIR"/slurmd-*.log "$MUNGE_DIR/munged.log"; do
        [[ -r $f ]] || continue
        echo "----- tail $f" >&2
        tail -n 20 "$f" >&2
    done
}

node_states() { sinfo --noheader --Node --format=%t 2>/dev/null | sort -u | tr '\n' ' '; }

wait_idle() {
    local deadline=$((SECONDS + WAIT_S)) states="" name
    while ((SECONDS < deadline)); do
        if [[ -s $CTLD_PID ]] && ! alive "$CTLD_PID"; then
            log "slurmctld exited"
            return 1
        fi
        while read -r name; do
            if [[ -s $(slurmd_pid "$name") ]] && ! alive "$(slurmd_pid "$name")"; then
                log "slurmd of $name exited"
                return 1
            fi
        done < <(nodes)
        states=$(node_states)
        [[ $states == "idle " ]] && return 0
        sleep 0.5
    done
    log "nodes not idle after ${WAIT_S}s (last sinfo states: '${states:-none}')"
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

all_alive() {
    local name
    alive "$MUNGED_PID" && alive "$CTLD_PID" || return 1
    while read -r name; do
        alive "$(slurmd_pid "$name")" || return 1
    done < <(nodes)
    [[ -s $NODE_LIST ]]
}

up() {
    require
    export SLURM_CONF="$CONF"
    if all_alive; then
        [[ $(wc -l <"$NODE_LIST") -eq $NODES ]] \
            || die "a cluster of $(wc -l <"$NODE_LIST") node(s) is up in $STATE_DIR; 'down' it first for $NODES"
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
    add_hosts
    # -i: ignore errors in (absent) saved state; the daemons fork and write their pid files
    slurmctld -i -f "$CONF" || fail_up "slurmctld failed to start"
    local name
    while read -r name; do
        slurmd -f "$CONF" -N "$name" || fail_up "slurmd of $name failed to start"
    done <"$NODE_LIST"
    wait_idle || fail_up "cluster did not come up"
    log "up: $NODES node(s) idle ($(node_words)), SLURM_CONF=$CONF"
    echo "export SLURM_CONF=$CONF"
}

step_pids() {  # step_pids NODE: the node's slurmstepd processes (each listens on a socket in the node's spool)
    local dir
    dir=$(spool "$1")
    ss -xlpn 2>/dev/null | grep -F -- " $dir/" | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u
}

with_descendants() {  # with_descendants PID...: those pids and every process below them
    ps -eo pid=,ppid= | awk -v roots="$*" '
        BEGIN { n = split(roots, r, " "); for (i = 1; i <= n; i++) keep[r[i]] = 1 }
        { parent[$1] = $2 }
        END {
            do {
                grew = 0
                for (p in parent) if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; grew = 1 }
            } while (grew)
            for (p in keep) print p
        }'
}

kill_steps() {  # kill_steps NODE [SLURMD_PID]: SIGKILL the node's step processes (and slurmd) as at a power cut
    local -a roots pids
    mapfile -t roots < <(step_pids "$1")
    [[ -n ${2:-} ]] && roots+=("$2")
    ((${#roots[@]} > 0)) || return 0
    # freeze the trees first, so that nothing notices its parent's death (or forks) before all are gone
    mapfile -t pids < <(with_descendants "${roots[@]}")
    kill -STOP "${pids[@]}" 2>/dev/null || true
    mapfile -t pids < <(with_descendants "${roots[@]}")
    kill -KILL "${pids[@]}" 2>/dev/null || true
    log "$1: SIGKILL to ${#pids[@]} process(es): ${pids[*]}"
}

kill_node() {
    local name=${1:?usage: local_cluster.sh kill-node NODE}
    grep -qx -- "$name" "$NODE_LIST" 2>/dev/null || die "no node '$name' in this cluster ($(node_words))"
    local pid=""
    alive "$(slurmd_pid "$name")" && pid=$(<"$(slurmd_pid "$name")")
    kill_steps "$name" "$pid"
}

start_node() {
    local name=${1:?usage: local_cluster.sh start-node NODE}
    grep -qx -- "$name" "$NODE_LIST" 2>/dev/null || die "no node '$name' in this cluster ($(node_words))"
    export SLURM_CONF="$CONF"
    alive "$(slurmd_pid "$name")" && die "the slurmd of $name is running (pid $(<"$(slurmd_pid "$name")"))"
    # Drained until slurmctld has told the new slurmd to end the node's jobs of before it died (about 1 s after it
    # registers): a job requeued for the node's failure that started on it first would lose its step there, since
    # it has the same job id (Slurm 22.05: "credential for job N revoked").
    scontrol update NodeName="$name" State=DRAIN Reason="local_cluster.sh start-node" \
        || die "scontrol cannot drain $name"
    slurmd -f "$CONF" -N "$name" || die "slurmd of $name failed to start"
    local deadline=$((SECONDS + WAIT_S)) state=""
    while ((SECONDS < deadline)); do
        # '*': slurmctld has not heard from the node yet
        state=$(sinfo --noheader --Node --nodes="$name" --format=%t 2>/dev/null | head -n1)
        [[ -n $state && $state != *'*' ]] && break
        sleep 0.5
    done
    [[ -n $state && $state != *'*' ]] || die "$name did not register in ${WAIT_S}s (last state '${state:-none}')"
    sleep "$RESUME_DELAY_S"
    scontrol update NodeName="$name" State=RESUME || die "scontrol cannot resume $name"
    log "$name registered and resumed (state $(sinfo --noheader --Node --nodes="$name" --format=%t))"
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
    local name jobs i
    if alive "$CTLD_PID"; then
        # cancel leftover jobs while the slurmd daemons can still reap their slurmstepd processes
        jobs=$(squeue --noheader --format=%i 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            log "cancelling leftover jobs: ${jobs//$'\n'/ }"
            # shellcheck disable=SC2086  # one job id per word
            scancel $jobs 2>/dev/null || true
            for ((i = 0; i < 30; i++)); do
                [[ -z $(squeue --noheader --format=%i --states=RUNNING,COMPLETING 2>/dev/null) ]] && break
                sleep 0.5
            done
        fi
    fi
    local -a pidfiles=()
    while read -r name; do pidfiles+=("$(slurmd_pid "$name")"); done < <(nodes)
    stop_pidfiles "${pidfiles[@]}" "$CTLD_PID"
    # steps of a node whose slurmd was gone (kill-node, a crash) outlive the cluster; they go now
    while read -r name; do kill_steps "$name"; done < <(nodes)
    stop_pidfiles "$MUNGED_PID"
    grep -qF -- "$HOSTS_MARK" "$HOSTS" 2>/dev/null && edit_hosts && log "removed this cluster's line from $HOSTS"
    rm -rf "$STATE_DIR"
}

status() {
    export SLURM_CONF="$CONF"
    alive "$CTLD_PID" || { log "down (no slurmctld for $CONF)"; return 1; }
    sinfo --Node
    squeue
}

cmd=${1:-}
shift || true
case $cmd in
    up)
        case ${1:-} in
            --nodes) NODES=${2:?usage: local_cluster.sh up [--nodes N]} ;;
            --nodes=*) NODES=${1#--nodes=} ;;
            "") ;;
            *) die "usage: local_cluster.sh up [--nodes N]" ;;
        esac
        up
        ;;
    down) down ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    kill-node) kill_node "${1:-}" ;;
    start-node) start_node "${1:-}" ;;
    *) echo "usage: $0 up [--nodes N]|down|status|env|kill-node NODE|start-node NODE" >&2; exit 2 ;;
esac
