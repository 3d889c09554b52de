#!/bin/bash
# interleaved A/B: torchrun quickstart 1 server + 1 worker; B sets glibc's thresholds for every rank (the worker's already)
for i in 1 2 3 4; do
  for v in A B; do
    out=$(mktemp -d)
    if [ $v = B ]; then export MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=2147483648; else unset MALLOC_MMAP_THRESHOLD_ MALLOC_TRIM_THRESHOLD_; fi
    OMP_NUM_THREADS=1 /work/main/.venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 -m hosfl_dist.run --config configs/quickstart.yaml train.budget_samples=3200 train.eval_every_samples=3200 data.eval_max_samples=1000 job.progress=false job.plots=false job.out_dir=$out >/dev/null 2>&1
    python3 - "$out" "$v" <<'PY'
import json, sys
s = json.load(open(sys.argv[1] + "/summary.json"))
w = s["transport"]["workers"]; srv = s["transport"]["server"]["compute_s"]
train = max(x["round_s"] for x in w.values()); r = s["rounds"]
comp = sum(v for k, v in srv.items() if not k.startswith("eval"))
mem = [m for m in s.get("memory", []) if m.get("role") == "server"]
print(sys.argv[2], f"samples/s {s['processed_samples']/train:.1f}", f"server ms/round {1e3*comp/r:.1f}", f"round ms {1e3*train/r:.1f}", s["server_digest"][:12], json.dumps(mem)[:200])
PY
    rm -rf $out
  done
done
