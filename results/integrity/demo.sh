#!/usr/bin/env bash
# The integrity issue's cases, run as a user would (quickstart, under torchrun: 1 server + 2 client workers); prints
# what happened. Writes into $OUT (default /tmp/hosfl-integrity). Usage: bash results/integrity/demo.sh [case ...]
#   cases: corrupt  overwrite  died  diskfull   (all by default; diskfull needs root for a tmpfs mount)
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-/tmp/hosfl-integrity}
RUN=(train.budget_samples=3072 train.eval_every_samples=1024 checkpoint.interval_samples=1024 checkpoint.keep=2
     job.progress=false)
cases=("$@"); [ ${#cases[@]} -eq 0 ] && cases=(corrupt overwrite died diskfull)
rm -rf "$OUT"; mkdir -p "$OUT"
digests() { "$PY" -c 'import json,sys; s=json.load(open(sys.argv[1])); print(s["status"], sorted(set(s.get("client_digests",{}).values()))[:1], s.get("server_digest"))' "$1/summary.json"; }
wait_for() { for _ in $(seq 1 600); do [ -e "$1" ] && return 0; sleep 0.2; done; echo "timed out waiting for $1"; return 1; }

for c in "${cases[@]}"; do
case $c in
corrupt)
  echo "== corrupt: SIGTERM after round 8's checkpoint, 64 bytes of the newest checkpoint's shard flipped, resume"
  bash launch/torchrun.sh "${RUN[@]}" job.out_dir="$OUT/ref" > "$OUT/ref.log" 2>&1
  echo "uninterrupted: $(digests "$OUT/ref")"
  bash launch/torchrun.sh "${RUN[@]}" job.out_dir="$OUT/run" > "$OUT/run.log" 2>&1 &
  launcher=$!
  wait_for "$OUT/run/checkpoints/round-00000008"; kill -TERM "$launcher"; wait "$launcher"
  newest=$(ls -d "$OUT"/run/checkpoints/round-* | sort | tail -1)
  echo "interrupted: $(grep -o 'interrupted: .*' "$OUT/run.log" | head -1); newest checkpoint $(basename "$newest")"
  "$PY" - "$newest"/model/__0_0.distcp <<'PYEOF'
import sys
p = sys.argv[1]; b = bytearray(open(p, "rb").read()); m = len(b) // 2
b[m:m + 64] = bytes(x ^ 0xFF for x in b[m:m + 64]); open(p, "wb").write(bytes(b))
PYEOF
  bash launch/torchrun.sh "${RUN[@]}" job.out_dir="$OUT/run" job.resume=auto > "$OUT/resume.log" 2>&1
  echo "resume said: $(grep -o 'resuming from round [0-9]*: .*' "$OUT/resume.log" | head -1)"
  echo "resumed:       $(digests "$OUT/run")"
  ;;
overwrite)
  echo "== overwrite: run B (job.seed=1, job.overwrite=true) into the folder of live run A"
  bash launch/torchrun.sh "${RUN[@]}" comm.inject_delay=true comm.rtt_ms=40 job.out_dir="$OUT/live" > "$OUT/a.log" 2>&1 &
  a=$!
  wait_for "$OUT/live/checkpoints/round-00000008"
  bash launch/torchrun.sh "${RUN[@]}" job.seed=1 job.overwrite=true job.out_dir="$OUT/live" > "$OUT/b.log" 2>&1
  echo "B: exit $? — $(tail -1 "$OUT/b.log")"
  wait "$a"; echo "A: exit $? — $(digests "$OUT/live"), $(wc -l < "$OUT/live/metrics.jsonl") metrics rows, seed $(grep -o 'seed: [0-9]*' "$OUT/live/config.yaml")"
  ;;
died)
  echo "== died: SIGKILL to every rank of a running job (as an OOM kill or a lost node would)"
  bash launch/torchrun.sh "${RUN[@]}" comm.inject_delay=true comm.rtt_ms=40 job.out_dir="$OUT/killed" > "$OUT/k.log" 2>&1 &
  k=$!
  wait_for "$OUT/killed/checkpoints/round-00000008"
  for p in /proc/[0-9]*; do  # the ranks only (torchrun gave them TORCHELASTIC_RUN_ID): the launcher lives on
    if grep -qa "job.out_dir=$OUT/killed" "$p/cmdline" 2>/dev/null && grep -qa TORCHELASTIC_RUN_ID= "$p/environ" 2>/dev/null; then
      kill -KILL "${p#/proc/}"
    fi
  done
  wait "$k"; echo "launcher: exit $?; its last line: $(tail -1 "$OUT/k.log")"
  echo "summary.json says: $("$PY" -c 'import json,sys; s=json.load(open(sys.argv[1])); print(s["status"], "|", s.get("error"))' "$OUT/killed/summary.json")"
  "$PY" -m hosfl_dist.run --status "$OUT/killed"
  ;;
diskfull)
  echo "== diskfull: job.out_dir on a 2 MB tmpfs (in one process)"
  mkdir -p "$OUT/tmpfs" && mount -t tmpfs -o size=2m tmpfs "$OUT/tmpfs" || { echo "(needs root: skipped)"; continue; }
  "$PY" -m hosfl_dist.run --config configs/quickstart.yaml "${RUN[@]}" job.out_dir="$OUT/tmpfs/run" > "$OUT/full.log" 2>&1
  echo "exit $? — $(tail -1 "$OUT/full.log")"
  echo "summary.json: $("$PY" -c 'import json,sys; s=json.load(open(sys.argv[1])); print(s["status"], "|", s.get("error"))' "$OUT/tmpfs/run/summary.json")"
  echo "left behind: $(ls -A "$OUT/tmpfs/run" | tr '\n' ' ')"
  "$PY" -m hosfl_dist.run --status "$OUT/tmpfs/run"
  umount "$OUT/tmpfs"
  ;;
esac
done
