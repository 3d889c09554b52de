#!/usr/bin/env bash
# What an elastic run costs against the fixed runtimes when nothing drops: the same run (configs/quickstart.yaml at a
# short budget) in one process, under torchrun (1 server + 2 client workers, P scalars by gloo all_reduce) and as an
# elastic run (--serve + 2 --join workers, P scalars through the server), REPEAT times each, interleaved; prints
# samples/s over the training rounds' wall time (summary.json transport.workers: round_s) per run. Ratios are what to read (the machine is shared).
#   bash results/elastic/cost.sh [overrides...]        PYTHON, REPEAT [2], BUDGET [6000], OUT [/tmp/hosfl-elastic-cost]
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
REPEAT=${REPEAT:-2}
BUDGET=${BUDGET:-6000}
OUT=${OUT:-/tmp/hosfl-elastic-cost}
rm -rf "$OUT"
mkdir -p "$OUT"
export OMP_NUM_THREADS=1
common=(--config configs/quickstart.yaml "train.budget_samples=$BUDGET" "train.eval_every_samples=$BUDGET"
  job.progress=false job.plots=false job.threads=1 "$@")
for r in $(seq 1 "$REPEAT"); do
  "$PYTHON" -m hosfl_dist.run "${common[@]}" "job.out_dir=$OUT/inprocess-$r" > "$OUT/inprocess-$r.log" 2>&1
  "$PYTHON" -m torch.distributed.run --nnodes=1 --nproc-per-node=3 --rdzv-backend=c10d --rdzv-endpoint=localhost:0 \
    --rdzv-id="cost-$r-$$" -m hosfl_dist.run "${common[@]}" "job.out_dir=$OUT/torchrun-$r" > "$OUT/torchrun-$r.log" 2>&1
  "$PYTHON" -m hosfl_dist.run "${common[@]}" server.min_workers=2 --serve "job.out_dir=$OUT/elastic-$r" \
    > "$OUT/elastic-$r.log" 2>&1 &
  server=$!
  until [ -f "$OUT/elastic-$r/join.json" ]; do sleep 0.2; done
  "$PYTHON" -m hosfl_dist.run --join "$OUT/elastic-$r" > "$OUT/elastic-$r-w1.log" 2>&1 &
  "$PYTHON" -m hosfl_dist.run --join "$OUT/elastic-$r" > "$OUT/elastic-$r-w2.log" 2>&1 &
  wait
done
"$PYTHON" - "$OUT" <<'PY'
import json, sys, statistics
from pathlib import Path
out = Path(sys.argv[1])
rates = {}
for d in sorted(p for p in out.iterdir() if p.is_dir()):
    s = json.loads((d / "summary.json").read_text())
    kind = d.name.rsplit("-", 1)[0]
    timing = next(iter(s["transport"]["workers"].values()))  # the first worker's rounds (elastic: the server's)
    rate = s["processed_samples"] / timing["round_s"]
    rates.setdefault(kind, []).append(rate)
    print(f"{d.name:14s} {s['status']:9s} {s['processed_samples']:6d} samples  wall {s['wall_time_s']:7.2f} s  "
          f"rounds {timing['round_s']:7.2f} s  {rate:7.1f} samples/s  θs {s['server_digest'][:12]}")
base = statistics.median(rates["inprocess"])
for kind, r in rates.items():
    print(f"{kind:10s} median {statistics.median(r):7.1f} samples/s  ({statistics.median(r) / base:.3f} x in-process)")
PY
