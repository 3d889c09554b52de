"""The round's noise kept (zo.noise_cache_mb, B) against drawn twice (A), one client step, in one process.

    python results/bench/noise_cache/ab.py [--reps 20] [--clients NAME ...] [--threads 1] [--keep-mb 64]

Each repetition runs A and B in a shuffled order on the same worker, model and batch as ``bench.zo_step``: a block
of P+1 no-grad forwards and one client step (z, the P perturbed forwards, the projections, the update), in
alternating order, timed with the thread's CPU clock. A draws u to perturb and again to rebuild ĝ_c; B keeps the
draws of its perturbed forwards for the update (``HOSFLWorker.round_noise``, ``zo.noise_cache_mb`` = --keep-mb).
Reported per client: the median of step / block for each, the median step time of B over A, and whether one step
from the same replica gives the same scalars and replica digest both ways.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.zo_step import CLIENTS, available, forward_block  # noqa: E402
from hosfl_dist.core.digest import tensors_digest  # noqa: E402
from hosfl_dist.core.seeding import round_seeds  # noqa: E402
from hosfl_dist.core.zo import Projector  # noqa: E402
from hosfl_dist.measure.modes import build_setup, profiled_worker  # noqa: E402

now = time.thread_time


def step(worker, rep, x, lam, seeds, keep: bool) -> torch.Tensor:
    def run() -> torch.Tensor:
        worker.bind(rep.params)
        with torch.no_grad():
            z = worker.client_forward(x)["z"]
        v = worker.zo_scalars(x, seeds, Projector(lam, z), worker.zo_activations(x, seeds))
        worker.apply_update(rep, seeds, v)
        return v

    if keep:
        with worker.round_noise():
            return run()
    worker.noise = None
    return run()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--keep-mb", type=float, default=64.0, help="B's zo.noise_cache_mb [64]")
    p.add_argument("--clients", nargs="*", default=["quickstart_cnn", "tiny_llama_lora", "tiny_llama_full",
                                                     "resnet18_cut2"])  # fmt: skip
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, reps {args.reps}, load before {os.getloadavg()}")
    for name in args.clients:
        spec = replace(CLIENTS[name].spec, noise_cache_mb=args.keep_mb)  # B keeps up to this; A keeps none
        if not available(spec):
            print(f"{name}: skipped (package not installed)")
            continue
        setup = build_setup(spec)
        worker = profiled_worker(spec, setup, "hosfl")
        rep = worker.replicas[0]
        x = setup.inputs
        with torch.no_grad():
            z0 = worker.client_forward(x)["z"]
        lam = torch.randn(z0.shape, generator=torch.Generator().manual_seed(1))
        # the same step both ways from the same replica: the same scalars and the same replica after it
        seeds = round_seeds(spec.seed, 0, spec.P)
        out = {}
        for keep in (False, True):
            r = rep.copy()
            v = step(worker, r, x, lam, seeds, keep)
            out[keep] = (v, tensors_digest(r.params))
        same = torch.equal(out[False][0], out[True][0]) and out[False][1] == out[True][1]
        ratios = {False: [], True: []}
        steps = {False: [], True: []}
        for i in range(2 + args.reps):
            seeds = round_seeds(spec.seed, i + 1, spec.P)
            for keep in random.Random(i).sample([False, True], 2):
                r = rep.copy()
                if i % 2:
                    t0 = now()
                    step(worker, r, x, lam, seeds, keep)
                    s = now() - t0
                    b = forward_block(worker, r.params, x, spec.P + 1, now)
                else:
                    b = forward_block(worker, r.params, x, spec.P + 1, now)
                    t0 = now()
                    step(worker, r, x, lam, seeds, keep)
                    s = now() - t0
                if i >= 2:
                    ratios[keep].append(s / b)
                    steps[keep].append(s)
        ra, rb = statistics.median(ratios[False]), statistics.median(ratios[True])
        sa, sb = statistics.median(steps[False]), statistics.median(steps[True])
        d_c = sum(t.numel() for t in rep.params)
        print(f"{name:16s} d_c {d_c:>7d} P {spec.P}: step/(P+1 fwd) drawn twice {ra:.3f}, kept {rb:.3f}; step "
              f"{sa * 1e3:.2f} -> {sb * 1e3:.2f} ms ({sb / sa:.3f}x); same scalars and replica: {same}", flush=True)
    print(f"load after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
