#!/usr/bin/env bash
# The elastic (client dropout) study: 5 methods x dropout 0, 0.1, 0.3, 0.5 x seeds 0,1,2 on the quickstart setting
# at a reduced budget (19,200 samples, evaluated every 9,600), MU-SplitFed with the AdamW of the others
# (--no-paper-defaults: its paper SGD diverged at dropout 0, seed 0). Run from the repository root:
#   bash results/elastic/run.sh
# Seed 0 of every point first, then seeds 1 and 2 (compare reuses the completed seed-0 runs).
set -u
PY=${PY:-/work/main/.venv/bin/python}
METHODS=hosfl,sfl,zo_sfl,mu_splitfed,frozen_client
LOG=results/elastic/wall_times.log
for SEEDS in 0 0,1,2; do
  for Q in 0 0.1 0.3 0.5; do
    echo "$(date -u +%FT%TZ) start dropout=$Q seeds=$SEEDS load: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$LOG"
    t0=$(date +%s)
    nice -n 19 "$PY" -m hosfl_dist.experiments.compare --config configs/quickstart.yaml \
      --methods "$METHODS" --seeds "$SEEDS" --jobs 2 --threads 1 --no-paper-defaults \
      --set clients.dropout=$Q --set server.min_clients=1 \
      --set train.budget_samples=19200 --set train.eval_every_samples=9600 \
      --out results/elastic/dropout_$Q
    rc=$?
    echo "$(date -u +%FT%TZ) end   dropout=$Q seeds=$SEEDS rc=$rc wall=$(( $(date +%s) - t0 ))s load: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$LOG"
  done
done
