#!/usr/bin/env bash
# Packs an experiment's raw files into one archive, byte for byte the same on any machine with GNU tar and xz (sorted
# names, one fixed mtime, owner 0, one xz thread), from the repository root:
#   bash results/pack_runs.sh [EXPERIMENT ...]     (default: all eight below)
# runs.tar.xz (finetune, scaling, smollm2_sentiment, studies): the run folders, and for finetune each experiment's
# table.json beside its runs/. records.tar.xz (bench, elastic, memory, zo_client): the per-point records of an
# experiment whose run folders are not kept (benchmark records, per-level tables, logs). Unpack with
# `tar xJf results/<experiment>/<archive> -C results/<experiment>`: the files land where the commands wrote them,
# which results/.gitignore and .gitignore ignore, and the experiment commands reuse the runs as finished. Checkpoints
# are left out (each run's summary.json is what the tables and the reuse check read), and so is each run's curves.png
# (python -m hosfl_dist.experiments.report RUN_DIR draws it again from metrics.jsonl). A member missing on disk stops
# the script before it writes anything: packing a checkout whose archive was never unpacked would empty it.
set -euo pipefail
cd "$(dirname "$0")/.."

ALL=(finetune scaling smollm2_sentiment studies bench elastic memory zo_client)

archive() {  # the archive an experiment's raw files go into
  case "$1" in
    finetune | scaling | smollm2_sentiment | studies) echo runs.tar.xz ;;
    *) echo records.tar.xz ;;
  esac
}

members() {  # the raw folders and files of one experiment, relative to results/<experiment>
  case "$1" in
    finetune) (cd results/finetune && find . \( -type d -name runs -prune -o -type f -name table.json \) -printf '%P\n' | sort) ;;
    scaling) echo qwen3/runs; echo qwen3/profiles ;;
    smollm2_sentiment) echo hosfl; echo splitlora ;;
    studies) (cd results/studies && find . -type d \( -name runs -o -name profiles \) -prune -printf '%P\n' | sort) ;;
    bench) (cd results/bench && find . -maxdepth 1 -type f -name '*.json' -printf '%P\n' | sort) ;;
    elastic)
      for q in 0 0.1 0.3 0.5; do for f in table.json table.md traffic.png; do echo "dropout_$q/$f"; done; done
      printf '%s\n' stragglers/table.json stragglers/table.md wall_times.log smollm2/record.json ;;
    memory) (cd results/memory && find . -mindepth 2 -maxdepth 2 -type f -name memory.json -printf '%P\n' | sort) ;;
    zo_client) (cd results/zo_client && find . -mindepth 2 -maxdepth 2 -type f -name 'table.*' -printf '%P\n' | sort) ;;
    *) echo "unknown experiment: $1 (${ALL[*]})" >&2; return 2 ;;
  esac
}

exps=("$@")
[ ${#exps[@]} -gt 0 ] || exps=("${ALL[@]}")
for e in "${exps[@]}"; do
  mapfile -t items < <(members "$e")
  dest="results/$e/$(archive "$e")"
  missing=()
  for m in "${items[@]}"; do [ -e "results/$e/$m" ] || missing+=("$m"); done
  if [ ${#items[@]} -eq 0 ] || [ ${#missing[@]} -gt 0 ]; then
    echo "$dest: not packed: ${missing[*]:-no raw files} missing on disk (unpack first: tar xJf $dest -C results/$e)" >&2
    exit 2
  fi
  tar --sort=name --mtime='2026-11-25 00:00:00Z' --owner=0 --group=0 --numeric-owner --mode='a+rX,u+w,go-w' \
    --format=gnu --exclude=checkpoints --exclude=.active_run.sh --exclude=.lock --exclude=__pycache__ --exclude=curves.png \
    -C "results/$e" -cf - "${items[@]}" | xz -9e -T1 -c > "$dest.tmp"
  mv "$dest.tmp" "$dest"
  echo "$dest: ${#items[@]} members, $(tar tJf "$dest" | grep -vc '/$') files, $(stat -c %s "$dest") bytes"
done
