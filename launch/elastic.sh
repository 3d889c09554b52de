#!/usr/bin/env bash
# An elastic run on this machine: the server (--serve) and WORKERS client workers (--join), each its own process, so
# a worker that dies ends only itself and the run goes on without it (docs/participation.md#elastic-runs). Join more
# at any time with `python -m hosfl_dist.run --join OUT`; see who is there with `python -m hosfl_dist.run --status OUT`.
# Extra arguments are config overrides, e.g. `WORKERS=3 bash launch/elastic.sh server.round_timeout_s=2`.
#   WORKERS   client workers started with the server                                   [2]
#   CONFIG    YAML config                                                              [configs/quickstart.yaml]
#   OUT       the run folder (job.out_dir)                                             [runs/elastic-<time>]
#   VENV      virtual environment with torch and hosfl_dist                            [.venv, else python3 on PATH]
#   OMP_NUM_THREADS  intra-op threads of each worker (yours is kept)                   [1]
set -euo pipefail
cd "$(dirname "$0")/.."
WORKERS=${WORKERS:-2}
CONFIG=${CONFIG:-configs/quickstart.yaml}
OUT=${OUT:-runs/elastic-$(date +%Y%m%d-%H%M%S)}
VENV=${VENV:-.venv}
PYTHON=python3
[ -x "$VENV/bin/python" ] && PYTHON="$VENV/bin/python"
# Bad input fails here in one line (exit 2), before any process starts.
"$PYTHON" -m hosfl_dist.run --config "$CONFIG" --serve --check "job.out_dir=$OUT" "$@"
"$PYTHON" -m hosfl_dist.run --config "$CONFIG" --serve "job.out_dir=$OUT" "$@" &
server=$!
# SIGTERM or Ctrl-C stops the server (the run is recorded as interrupted); the workers then find it gone and end.
trap 'kill -TERM "$server" 2>/dev/null || true' TERM INT
until [ -f "$OUT/join.json" ]; do
  if ! kill -0 "$server" 2>/dev/null; then
    wait "$server"
    exit $?
  fi
  sleep 0.2
done
workers=()
for _ in $(seq 1 "$WORKERS"); do
  OMP_NUM_THREADS="${OMP_NUM_THREADS-1}" "$PYTHON" -m hosfl_dist.run --join "$OUT" &
  workers+=($!)
done
rc=0
wait "$server" || rc=$?
for w in "${workers[@]}"; do
  wait "$w" || true  # a worker that died or left is the run's business, not the launcher's
done
exit "$rc"
