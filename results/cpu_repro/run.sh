#!/usr/bin/env bash
# Regenerates results/cpu_repro/{iid,dirichlet}/ from the repository root (tables, plots; the run folders land in
# <part>/runs/, which git ignores):
#   bash results/cpu_repro/run.sh
# Finished runs are reused (delete a run folder to redo it). Two runs at a time, one torch thread each.
set -euo pipefail
PY=${PYTHON:-python}
for part in iid dirichlet; do
  "$PY" -m hosfl_dist.experiments.compare --config "configs/repro/cifar10_${part}.yaml" \
    --methods hosfl,sfl,fsl_sage,zo_sfl,mu_splitfed,frozen_client --seeds 0,1,2 --jobs 2 --threads 1 \
    --title "CPU repro: CIFAR-10 (8k offline images), small CNN, ${part}, 40k samples" \
    --out "results/cpu_repro/${part}"
done

# Traffic in the paper's own geometry (ResNet-18 cut after stage 2, 32x32 inputs, batch 32, 500 samples per client so
# E=1 is 16 steps, K=10): 5,120 samples, i.e. one SFL round; every round of the 160k-sample run is the same, so the
# 160k totals are these x 31.25 (accuracy after 5k samples of a randomly initialised ResNet is meaningless here).
"$PY" -m hosfl_dist.experiments.compare --config configs/paper/table3/cifar10_iid.yaml \
  --methods hosfl,sfl,fsl_sage,zo_sfl,mu_splitfed --seeds 0 --jobs 2 --threads 1 \
  --set data.name=cifar10_npz --set job.device=cpu --set clients.total=16 --set clients.per_round=10 \
  --set train.budget_samples=5120 --set train.eval_every_samples=100000 --set data.eval_max_samples=100 \
  --set data.augment=false \
  --title "Paper geometry (ResNet-18 cut 2, 500 samples/client, K=10): traffic of 5,120 samples" \
  --out results/cpu_repro/paper_geometry_traffic

# The ResNet-18 setting of the authors' code with the fixed baselines (issue 34; README: resnet18_code/)
"$PY" -m hosfl_dist.experiments.compare --config configs/repro/resnet18_cifar10_code.yaml \
  --methods hosfl,sfl,frozen_client,fsl_sage,zo_sfl,mu_splitfed --seeds 0,1,2 --no-paper-defaults --jobs 2 --threads 1 \
  --title "ResNet-18 from scratch, cut 2, the authors' code's settings (AdamW 1e-3/1e-4, freeze_bn=code), M=100, K=10, 19.2k samples" \
  --out results/cpu_repro/resnet18_code
