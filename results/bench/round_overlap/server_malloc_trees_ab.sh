#!/bin/bash
# interleaved A/B of two trees: torchrun quickstart 1 server + 1 worker, 3200 samples
# /tmp/old3: git worktree add /tmp/old3 <the commit before "A one-rank server keeps the memory it frees">
for i in 1 2 3; do
  for tree in /tmp/old3 /work/main; do
    out=$(mktemp -d)
    (cd $tree && OMP_NUM_THREADS=1 /work/main/.venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 -m hosfl_dist.run --config configs/quickstart.yaml train.budget_samples=3200 train.eval_every_samples=3200 data.eval_max_samples=1000 job.progress=false job.plots=false job.out_dir=$out >/dev/null 2>&1)
    python3 - "$out" "$tree" <<'PY'
import json, sys
s = json.load(open(sys.argv[1] + "/summary.json"))
w = s["transport"]["workers"]; srv = s["transport"]["server"]["compute_s"]
train = max(x["round_s"] for x in w.values()); r = s["rounds"]
comp = sum(v for k, v in srv.items() if not k.startswith("eval"))
peak = [m["peak_rss_bytes"] for m in s.get("memory", []) if m.get("role") == "server"]
print(sys.argv[2], f"samples/s {s['processed_samples']/train:.1f}", f"server ms/round {1e3*comp/r:.1f}", f"round ms {1e3*train/r:.1f}", s["server_digest"][:12], f"server peak RSS {peak[0]/1e6:.0f} MB")
PY
    rm -rf $out
  done
done
