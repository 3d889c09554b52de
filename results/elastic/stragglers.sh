#!/usr/bin/env bash
# Time to a target accuracy with stragglers: elastic runs of configs/quickstart.yaml on the emulated 5G link
# (comm.inject_delay) with clients on log-normal link speeds (comm.speed_spread), three ways of running a round:
#   wait_all      wait for every sampled client (server.round_timeout_s=0, server.min_clients=K)
#   timeout       step with what arrived server.round_timeout_s after the first upload (server.min_clients=1)
#   over_select   sample ⌈1.5 K⌉ clients and step on the first K uploads (clients.over_select=0.5)
# Each is one server and WORKERS workers on this machine; summarize.py reads the runs into table.md / table.json.
#   bash results/elastic/stragglers.sh [overrides...]     PYTHON, WORKERS [2], SEEDS ["0"], OUT [results/elastic/stragglers]
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
WORKERS=${WORKERS:-2}
SEEDS=${SEEDS:-0}
OUT=${OUT:-results/elastic/stragglers}
mkdir -p "$OUT/runs"
export OMP_NUM_THREADS=1
common=(--config configs/quickstart.yaml train.budget_samples=19200 train.eval_every_samples=1920 job.plots=false
  comm.inject_delay=true comm.speed_spread=1.0 "server.min_workers=$WORKERS" server.worker_timeout_s=120 "$@")
declare -A variants=(
  [wait_all]=""
  [timeout]="server.round_timeout_s=0.25 server.min_clients=1"
  [over_select]="clients.over_select=0.5"
)
for seed in $SEEDS; do
  for name in wait_all timeout over_select; do
    run="$OUT/runs/$name/seed$seed"
    if [ -f "$run/summary.json" ] && grep -q '"status": "completed"' "$run/summary.json"; then
      continue  # finished before: kept
    fi
    # shellcheck disable=SC2086  # the variant's overrides are word-split on purpose
    "$PYTHON" -m hosfl_dist.run "${common[@]}" ${variants[$name]} "job.seed=$seed" "job.out_dir=$run" \
      job.overwrite=true --serve > "$OUT/runs/$name-seed$seed.log" 2>&1 &
    server=$!
    until [ -f "$run/join.json" ]; do
      kill -0 "$server" 2>/dev/null || { wait "$server"; exit 1; }
      sleep 0.2
    done
    for _ in $(seq 1 "$WORKERS"); do
      "$PYTHON" -m hosfl_dist.run --join "$run" >> "$OUT/runs/$name-seed$seed.workers.log" 2>&1 &
    done
    wait
  done
done
"$PYTHON" results/elastic/summarize_stragglers.py "$OUT"
