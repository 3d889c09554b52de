#!/usr/bin/env bash
# The GPU tier and the GPU rows of the benchmarks, on a device machine (see results/gpu/README.md):
#   bash results/gpu/run.sh OUT_DIR
# The machine's python3 holds torch with CUDA; the packages it lacks (or holds at other versions) travel as wheels in
# .whl/ (results/gpu/README.md says which) and are installed into /tmp/site.
out=${1:?usage: run.sh OUT_DIR}
mkdir -p "$out/bench" "$out/big"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD
if ! python3 -c "import transformers, peft, datasets, gguf" 2>/dev/null; then  # fall back on the image's own
  echo "carried transformers failed to import: using the image's" >&2
  rm -rf /tmp/site && mkdir /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl .whl/gguf-*.whl
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, peft, sys; print(sys.version.split()[0], 'torch', torch.__version__, \
torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'transformers', transformers.__version__, 'peft', peft.__version__)"
  nproc; free -g | head -2
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
echo "== set-up took $(( $(date +%s) - t0 )) s"
timeout 240 python3 -m pytest -q -m gpu tests -p no:cacheprovider --durations=0 -o addopts="-ra" 2>&1 \
  | tee "$out/pytest.log" | tail -40
echo "== gpu tier done at $(( $(date +%s) - t0 )) s"
timeout 60 python3 -m torch.distributed.run --nproc-per-node=2 results/gpu/nccl_shared_gpu.py > "$out/nccl.log" 2>&1
grep "^rank" "$out/nccl.log"; grep -m3 -i "duplicate\|invalid usage" "$out/nccl.log"
{
  timeout 150 python3 -m bench run gpu_zo_step gpu_zo_step_cuda_rng gpu_zo_step_batched --out "$out/bench"
  for batch in 1 64; do  # P=10: the sequential and the batched step, noise drawn on the GPU
    timeout 60 python3 -m bench.zo_step --device cuda --rng-device cuda --reps 20 --P 10 --perturb-batch $batch \
      --clients quickstart_cnn tiny_llama_lora tiny_llama_full resnet18_cut2 --out "$out/p10"
  done
  timeout 150 python3 -m bench.server_step --arch qwen3-0.6b qwen3-1.7b --reps 10 --optimizer-impl auto for_loop fused \
    --out "$out/big"
} 2>&1 | tee "$out/bench.log" | grep -v "^  "
echo "== all done at $(( $(date +%s) - t0 )) s"
