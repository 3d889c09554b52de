"""What a P-batched ZO client could gain here at most: P sequential client forwards against one forward of the batch
repeated P times, on the client of ``bench.zo_step`` (LoRA clients), at 1 and 2 threads.

    python results/bench/p_batched/probe.py [--threads 1 2] [--clients tiny_llama_lora smollm2_cut5] [--reps 8]
                                            [--device cuda] [--P 2 5 10]

A P-batched path (issue 23, item 4) would run the P perturbed forwards as one forward over P adapter copies; the
frozen base's work is the same either way, so its best case is what one forward of a P-times larger batch costs
against P forwards of the batch, which this measures (without the perturbation and the per-copy LoRA matmuls, which
can only add). Medians over repetitions after one warm-up, wall clock (on CUDA to the last kernel), each pair back
to back. ``--P`` replaces the client's P (default: its own); ``--device`` puts the client on a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.zo_step import CLIENTS, available  # noqa: E402
from hosfl_dist.measure.modes import build_setup, profiled_worker  # noqa: E402


def repeat(x, n: int):
    return {k: torch.cat([v] * n) for k, v in x.items()} if isinstance(x, dict) else torch.cat([x] * n)


def pair(worker, x, P: int, reps: int, sync) -> tuple[float, float]:
    """Medians of (P forwards one after another, one forward of the P-times batch), after one warm-up pair."""
    xb = repeat(x, P)
    seq, bat = [], []
    with torch.no_grad():
        for i in range(1 + reps):
            t0 = sync()
            for _ in range(P):
                worker.client_forward(x)
            t1 = sync()
            worker.client_forward(xb)
            t2 = sync()
            if i:
                seq.append(t1 - t0)
                bat.append(t2 - t1)
    return statistics.median(seq), statistics.median(bat)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--clients", nargs="+", default=["tiny_llama_lora", "smollm2_cut5"])
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--P", type=int, nargs="+", default=None, help="perturbations per step (default: the client's)")
    args = p.parse_args()
    print(f"load before {os.getloadavg()}, {os.cpu_count()} cores")
    cuda = args.device.startswith("cuda")

    def sync() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.clients:
            spec = replace(CLIENTS[name].spec, device=args.device)
            if not available(spec):
                print(f"{name}: skipped (package not installed)")
                continue
            setup = build_setup(spec)
            worker = profiled_worker(spec, setup, "hosfl")
            worker.bind(worker.replicas[0].params)
            for P in args.P or [spec.P]:
                s, b = pair(worker, setup.inputs, P, min(args.reps, CLIENTS[name].max_reps or args.reps), sync)
                print(f"{name:16s} {args.device} threads {threads}: P={P} forwards one after another "
                      f"{s * 1e3:8.1f} ms, one forward of the {P}x batch {b * 1e3:8.1f} ms: {b / s:.3f}x", flush=True)
    print(f"load after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
