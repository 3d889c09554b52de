#!/bin/bash
# /tmp/old2: git worktree add /tmp/old2 41e733a (the tree before the pool change); /work/main at edc0078 (the change)
# interleaved A/B: in-process quickstart, 1 thread, round time summed (bench.dist_bench's child)
for i in 1 2 3 4 5; do
  for tree in /tmp/old2 /work/main; do
    out=$(mktemp -d)
    r=$(cd $tree && OMP_NUM_THREADS=1 /work/main/.venv/bin/python -m bench.dist_bench --_in-process-child --config configs/quickstart.yaml -- train.budget_samples=3200 train.eval_every_samples=3200 data.eval_max_samples=1000 job.progress=false job.out_dir=$out 2>/dev/null | tail -1)
    echo "$tree $(echo $r | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print(round(d["processed"]/d["round_s"],1), d["final"])')"
    rm -rf $out
  done
done
