"""What a P-batched ZO client could gain here at most: P sequential client forwards against one forward of the batch
repeated P times, on the client of ``bench.zo_step`` (LoRA clients), at 1 and 2 threads.

    python results/bench/p_batched/probe.py [--threads 1 2] [--clients tiny_llama_lora smollm2_cut5] [--reps 8]

A P-batched path (issue 23, item 4) would run the P perturbed forwards as one forward over P adapter copies; the
frozen base's work is the same either way, so its best case is what one forward of a P-times larger batch costs
against P forwards of the batch, which this measures (without the perturbation and the per-copy LoRA matmuls, which
can only add). Medians over repetitions after one warm-up, wall clock, each pair back to back.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.zo_step import CLIENTS, available  # noqa: E402
from hosfl_dist.measure.modes import build_setup, profiled_worker  # noqa: E402


def repeat(x, n: int):
    return {k: torch.cat([v] * n) for k, v in x.items()} if isinstance(x, dict) else torch.cat([x] * n)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--clients", nargs="+", default=["tiny_llama_lora", "smollm2_cut5"])
    p.add_argument("--reps", type=int, default=8)
    args = p.parse_args()
    print(f"load before {os.getloadavg()}, {os.cpu_count()} cores")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.clients:
            spec = CLIENTS[name].spec
            if not available(spec):
                print(f"{name}: skipped (package not installed)")
                continue
            setup = build_setup(spec)
            worker = profiled_worker(spec, setup, "hosfl")
            x, P = setup.inputs, spec.P
            xb = repeat(x, P)
            worker.bind(worker.replicas[0].params)
            seq, bat = [], []
            reps = min(args.reps, CLIENTS[name].max_reps or args.reps)
            with torch.no_grad():
                for i in range(1 + reps):
                    t0 = time.perf_counter()
                    for _ in range(P):
                        worker.client_forward(x)
                    t1 = time.perf_counter()
                    worker.client_forward(xb)
                    t2 = time.perf_counter()
                    if i:
                        seq.append(t1 - t0)
                        bat.append(t2 - t1)
            s, b = statistics.median(seq), statistics.median(bat)
            print(f"{name:16s} threads {threads}: P={P} forwards one after another {s * 1e3:8.1f} ms, one forward "
                  f"of the {P}x batch {b * 1e3:8.1f} ms: {b / s:.3f}x", flush=True)
    print(f"load after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
