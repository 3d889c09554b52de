#!/usr/bin/env bash
# Regenerates results/cpu_repro/{iid,dirichlet}/ (tables, plots, per-run files) from the repository root:
#   bash results/cpu_repro/run.sh
# Finished runs are reused (delete a run folder to redo it). Two runs at a time, one torch thread each.
set -euo pipefail
PY=${PYTHON:-python}
for part in iid dirichlet; do
  "$PY" -m hosfl_dist.experiments.compare --config "configs/repro/cifar10_${part}.yaml" \
    --methods hosfl,sfl,fsl_sage,zo_sfl,mu_splitfed --seeds 0,1,2 --jobs 2 --threads 1 \
    --title "CPU repro: CIFAR-10 (8k offline images), small CNN, ${part}, 40k samples" \
    --out "results/cpu_repro/${part}"
done
