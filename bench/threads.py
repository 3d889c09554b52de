"""Intra-op threads of an in-process run: seconds per round with ``job.threads`` = 1, 2, … for a small model (the
quickstart CNN) and a 135M-parameter LM (SmolLM2 with LoRA), the measurement behind ``job.threads=0`` (auto:
one thread below 10M parameters, every core above; hosfl_dist/runtime/process/host.py::set_threads).

    python -m bench.threads                       # ~4 min on 2 cores: bench/out/threads.json
    python -m bench.threads --only small --threads 1 2 --repeat 3

Each setting is a fresh ``python -m hosfl_dist.run`` process (threads cannot be changed back and forth inside one
without side effects), evaluated only at the start and the end on a few samples; the time per round is the wall time
between those two metrics rows over the rounds run (the final evaluation included, the same for every setting).
Settings take turns ``--repeat`` times and the median is kept, since other work on a shared machine moves every
timing: compare the ratios of one run, not numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, Recorder, options
from bench.suite import BENCHMARKS

MODELS = {
    # rounds, overrides
    "small": (
        20,
        [
            "--config",
            "configs/repro/quickstart_small_cnn.yaml",
            "train.budget_samples=2560",
            "train.eval_every_samples=2560",
            "data.eval_max_samples=500",
        ],
    ),  # fmt: skip
    "lm135m": (
        4,
        [
            "--config",
            "configs/smollm2_sentiment.yaml",
            "train.budget_samples=192",
            "train.eval_every_samples=192",
            "data.eval_max_samples=16",
            "data.train_max_samples=320",
        ],
    ),  # fmt: skip
}


def seconds_per_round(model: str, threads: int) -> dict:
    rounds, args = MODELS[model]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "hosfl_dist.run", *args, f"job.threads={threads}", f"job.out_dir={tmp}/run",
               "job.progress=false"]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
        total = time.perf_counter() - start
        rows = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
    window = rows[-1]["wall_time_s"] - rows[0]["wall_time_s"]
    return {"s_per_round": window / rounds, "process_s": total}


def figures(data: dict) -> tuple[dict, dict]:
    """Seconds per round per model and thread count (the declared ones)."""
    values = {
        f"{model}_{n}_thread{'s' if int(n) > 1 else ''}": v
        for model, r in data["models"].items()
        for n, v in r["s_per_round"].items()
    }
    return {k: v for k, v in values.items() if k in BENCHMARKS["threads"].names}, {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=sorted(MODELS), default=sorted(MODELS), help="models to measure")
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="job.threads values")
    p.add_argument("--repeat", type=int, default=2, help="turns of every setting (the median is kept)")
    args = options(p).parse_args(argv)
    rec = Recorder(BENCHMARKS["threads"], argv, args.via)
    result: dict = {"cores": len(os.sched_getaffinity(0)), "models": {}}
    for model in args.only:
        runs: dict[int, list[float]] = {n: [] for n in args.threads}
        for turn in range(args.repeat):
            for n in args.threads:
                r = seconds_per_round(model, n)
                runs[n].append(r["s_per_round"])
                print(f"{model} threads={n} turn {turn}: {r['s_per_round']:.3f} s/round", flush=True)
        med = {n: statistics.median(v) for n, v in runs.items()}
        base = med[args.threads[0]]
        result["models"][model] = {
            "s_per_round": {str(n): med[n] for n in args.threads},
            "all_s_per_round": {str(n): runs[n] for n in args.threads},
            f"ratio_to_{args.threads[0]}_thread": {str(n): med[n] / base for n in args.threads},
            "fastest": min(med, key=med.get),
        }
    print(f"{'model':<8} " + " ".join(f"{f'{n} thr s/round':>15}" for n in args.threads) + "  fastest")
    for model, r in result["models"].items():
        cells = " ".join(f"{r['s_per_round'][str(n)]:>15.3f}" for n in args.threads)
        print(f"{model:<8} {cells}  {r['fastest']} thread(s)")
    rec.write(args.out, result, *figures(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
