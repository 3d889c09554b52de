#!/usr/bin/env bash
# In-process rounds of the ResNet-18 fine-tuning config (K=5 clients a round, P=5, d_c 681k) with the round's noise
# drawn every time (zo.noise_cache_mb=0, the default) and kept (64 MiB), runs interleaved, one thread each:
#   bash results/bench/noise_cache/rounds_ab.sh [PAIRS]
# prints each run's wall time, and checks that both give the same digests.
set -euo pipefail
pairs=${1:-3}
out=$(mktemp -d)
common=(--config configs/finetune/hosfl_iid.yaml 'model.pretrained=""' train.budget_samples=3200
        train.eval_every_samples=3200 train.eval_batch_size=100 data.eval_max_samples=100 job.progress=false
        job.plots=false job.threads=1)
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for i in $(seq "$pairs"); do
  order=("0" "64"); [ $((i % 2)) -eq 0 ] && order=("64" "0")
  for mb in "${order[@]}"; do
    python -m hosfl_dist.run "${common[@]}" "zo.noise_cache_mb=$mb" "job.out_dir=$out/$mb-$i" > /dev/null 2>&1
    python - "$out/$mb-$i/summary.json" "$mb" "$i" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"pair {sys.argv[3]} noise_cache_mb={sys.argv[2]:>2}: {s['rounds']} rounds in {s['wall_time_s']:.2f} s, "
      f"client {s['client_digests'][0][:12] if isinstance(s['client_digests'], list) else str(s['client_digests'])[:40]} "
      f"server {s['server_digest'][:12]}")
PY
  done
done
python - "$out" "$pairs" <<'PY'
import json, statistics, sys
out, pairs = sys.argv[1], int(sys.argv[2])
t = {mb: [json.load(open(f"{out}/{mb}-{i}/summary.json"))["wall_time_s"] for i in range(1, pairs + 1)] for mb in ("0", "64")}
d = {mb: {(json.dumps(json.load(open(f"{out}/{mb}-{i}/summary.json"))["client_digests"]),
           json.load(open(f"{out}/{mb}-{i}/summary.json"))["server_digest"]) for i in range(1, pairs + 1)}
     for mb in ("0", "64")}
ratios = [b / a for a, b in zip(t["0"], t["64"])]
print(f"kept / drawn, per pair: {', '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f}")
print(f"same digests in every run: {len(d['0'] | d['64']) == 1}")
PY
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
rm -rf "$out"
