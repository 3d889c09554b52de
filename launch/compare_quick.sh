#!/usr/bin/env bash
# The quickstart's point in a few minutes: HO-SFL, SFL and frozen_client (HO-SFL with the client frozen) on
# configs/quickstart.yaml, one seed each, one after the other, then one table: method, final accuracy, client peak
# memory (the memory profiler, against an inference-only forward of f_c), uplink bytes (counted, against SFL's
# estimate for the same samples) and wall time (README.md, "What the quickstart shows"). Extra arguments are config
# overrides for all three, e.g. `bash launch/compare_quick.sh train.budget_samples=30000`; a finished run is reused.
#   OUT       the study's folder                                                       [runs/compare_quick]
#   CONFIG    YAML config                                                              [configs/quickstart.yaml]
#   JOBS      runs at a time                                                           [1]
#   VENV      virtual environment with torch and hosfl_dist                            [.venv, else python3 on PATH]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/compare_quick}
CONFIG=${CONFIG:-configs/quickstart.yaml}
JOBS=${JOBS:-1}
VENV=${VENV:-.venv}
PYTHON=python3
[ -x "$VENV/bin/python" ] && PYTHON="$VENV/bin/python"
METHODS=(hosfl sfl frozen_client)
"$PYTHON" -m hosfl_dist.experiments.compare --config "$CONFIG" --methods "$(IFS=,; echo "${METHODS[*]}")" \
  --seeds 0 --jobs "$JOBS" --threads 1 --out "$OUT" \
  --title "Quickstart: HO-SFL, SFL and HO-SFL with the client frozen" "$@"
RUNS=()
for m in "${METHODS[@]}"; do RUNS+=("$OUT/runs/$m/seed0"); done
"$PYTHON" -m hosfl_dist.measure.outcome "${RUNS[@]}"
