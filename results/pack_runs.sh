#!/usr/bin/env bash
# Packs an experiment's raw run folders into results/<experiment>/runs.tar.xz, byte for byte the same on any machine
# with GNU tar and xz (sorted names, one fixed mtime, owner 0, one xz thread), from the repository root:
#   bash results/pack_runs.sh [finetune|scaling|smollm2_sentiment|studies ...]     (default: all four)
# Unpack with `tar xJf results/<experiment>/runs.tar.xz -C results/<experiment>`: the folders land where the runs
# wrote them, which .gitignore ignores, and the experiment commands reuse them as finished runs. Checkpoints are left
# out (each run's summary.json is what the tables and the reuse check read), and so is each run's curves.png (python -m
# hosfl_dist.experiments.report RUN_DIR draws it again from metrics.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."

members() {  # the raw folders of one experiment, relative to results/<experiment>
  case "$1" in
    finetune) (cd results/finetune && find . -type d -name runs -prune -printf '%P\n' | sort) ;;
    scaling) echo qwen3/runs; echo qwen3/profiles ;;
    smollm2_sentiment) echo hosfl; echo splitlora ;;
    studies) (cd results/studies && find . -type d \( -name runs -o -name profiles \) -prune -printf '%P\n' | sort) ;;
    *) echo "unknown experiment: $1 (finetune, scaling, smollm2_sentiment or studies)" >&2; return 2 ;;
  esac
}

exps=("$@")
[ ${#exps[@]} -gt 0 ] || exps=(finetune scaling smollm2_sentiment studies)
for e in "${exps[@]}"; do
  mapfile -t dirs < <(members "$e")
  tar --sort=name --mtime='2026-11-25 00:00:00Z' --owner=0 --group=0 --numeric-owner --mode='a+rX,u+w,go-w' \
    --format=gnu --exclude=checkpoints --exclude=.active_run.sh --exclude=.lock --exclude=__pycache__ --exclude=curves.png \
    -C "results/$e" -cf - "${dirs[@]}" | xz -9e -T1 -c > "results/$e/runs.tar.xz"
  echo "results/$e/runs.tar.xz: ${#dirs[@]} folders, $(tar tJf "results/$e/runs.tar.xz" | grep -vc '/$') files," \
    "$(stat -c %s "results/$e/runs.tar.xz") bytes"
done
