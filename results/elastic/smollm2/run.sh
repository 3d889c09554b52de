#!/usr/bin/env bash
# The SmolLM2 point of results/elastic: configs/quick_lm.yaml at 960 samples, client dropout 0 and 0.3
set -euo pipefail
cd "$(dirname "$0")/../../.."
PYTHON=${PYTHON:-.venv/bin/python}
for q in 0 0.3; do
  OMP_NUM_THREADS=1 nice -n 10 "$PYTHON" -m hosfl_dist.run --config configs/quick_lm.yaml \
    train.budget_samples=960 train.eval_every_samples=480 clients.dropout=$q server.min_clients=1 job.threads=1 \
    job.out_dir=results/elastic/smollm2/runs/dropout_$q
done
