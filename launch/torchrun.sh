#!/usr/bin/env bash
# The distributed runtime on this machine: torchrun with c10d rendezvous on a free port (the rendezvous the Slurm
# script uses across nodes); rank 0 is the server, the other ranks are client workers. Extra arguments are passed on
# as overrides, e.g. `NPROC=4 bash launch/torchrun.sh zo.overlap=true`.
#   NPROC          processes (1 server + NPROC-1 client workers, or server.ranks servers)  [3]
#   CONFIG         YAML config                                                            [configs/quickstart.yaml]
#   VENV           virtual environment with torch and hosfl_dist                         [.venv, else python3 on PATH]
#   TORCHRUN_ARGS  extra torchrun options, word-split, e.g. "--max-restarts=0"           [empty]
#   OMP_NUM_THREADS per-process intra-op threads when NPROC > 1 (yours is kept)          [1]
#   HOSFL_JOB_TOKEN the job's secret, handed to every rank (yours is kept; never printed) [made here, random]
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-3}
CONFIG=${CONFIG:-configs/quickstart.yaml}
VENV=${VENV:-.venv}
PYTHON=python3
[ -x "$VENV/bin/python" ] && PYTHON="$VENV/bin/python"
# Bad input fails here in one line (exit 2), before torchrun starts NPROC processes that would each report it.
"$PYTHON" -m hosfl_dist.run --config "$CONFIG" --check --nproc "$NPROC" "$@"
# torchrun sets OMP_NUM_THREADS=1 itself when it is unset and NPROC > 1, with a multi-line warning on every launch;
# setting the same default here keeps the behaviour and drops the warning. A value of your own (even empty) is kept.
if [ "$NPROC" -gt 1 ]; then
  export OMP_NUM_THREADS="${OMP_NUM_THREADS-1}"
fi
# The server refuses RPC calls without the job's token (docs/checkpoints.md, "Trust boundary"): a secret made here
# reaches every rank through the environment, never through the network, and is printed nowhere.
if [ -z "${HOSFL_JOB_TOKEN:-}" ]; then
  HOSFL_JOB_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
fi
export HOSFL_JOB_TOKEN
# The job's key-value store on loopback: rank 0 hosts it (runtime/process/groups.py, job_store) instead of torchrun,
# whose stores listen on every interface; torchrun's rendezvous store still does. Set 0 to keep torchrun's.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE-1}"
# torchrun runs in the background so that this shell can pass SIGTERM on to it (each rank then stops at the next round
# boundary with a checkpoint); Ctrl-C reaches the whole process group by itself.
# shellcheck disable=SC2086  # TORCHRUN_ARGS is deliberately word-split
"$PYTHON" -m torch.distributed.run --nnodes=1 --nproc-per-node="$NPROC" \
  --rdzv-backend=c10d --rdzv-endpoint=localhost:0 --rdzv-id="hosfl-$$" ${TORCHRUN_ARGS:-} \
  -m hosfl_dist.run --config "$CONFIG" "$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM
trap ':' INT
rc=0
while :; do
  rc=0
  wait "$child" || rc=$?
  kill -0 "$child" 2>/dev/null || break  # a trapped signal ended the wait, not torchrun
done
trap - TERM INT
# Processes killed before they could record how the run ended (OOM, SIGKILL) leave summary.json at "running": say
# so, and record "died" there (docs/checkpoints.md, "A live run owns its folder").
if ((rc != 0)); then
  "$PYTHON" -m hosfl_dist.run --config "$CONFIG" --record-death "$@" >&2 || true
fi
exit "$rc"
