"""Before/after of the ZO client step in one process, A/B interleaved: the table in results/bench/README.md.

    python results/bench/zo_step_ab.py [--before efe76c7] [--reps 20] [--clients NAME ...] [--tune-malloc]

A is the client as it was at ``--before``: that commit's ``hosfl_dist/core/zo.py`` (loaded from git as its own
module) and ``nn.MaxPool2d``; B is the working tree (``vision.MaxPool2d``, today's ``zo.py``). Both run on the same
worker, model and batch of ``bench.zo_step``: each repetition runs A and B in a shuffled order, each as P+1 no-grad
forwards (the block) and one client step (``zo_activations``, ``zo_scalars``, ``apply_update``) in alternating
order, timed with the thread's CPU clock on one thread. Reported per client and variant: the median over
repetitions of step / block (the figure ``bench.zo_step`` records) and the median step time, with B's over A's;
and whether one step from the same replica gives the same scalars and the same replica digest under A and B.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import hosfl_dist.algorithms.hosfl as hosfl  # noqa: E402
import hosfl_dist.core.zo as zo_after  # noqa: E402
from bench.zo_step import CLIENTS, available, forward_block, tune_malloc  # noqa: E402
from hosfl_dist.core.seeding import round_seeds  # noqa: E402
from hosfl_dist.measure.modes import build_setup, profiled_worker  # noqa: E402


def module_at(commit: str, path: str, name: str):
    """``path`` as it was at ``commit``, imported as module ``name``."""
    import importlib.util

    text = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True)
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(text.stdout)
    spec = importlib.util.spec_from_file_location(name, file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def pools(module: nn.Module) -> list[tuple[nn.Module, str, nn.MaxPool2d]]:
    return [(m, n, c) for m in module.modules() for n, c in m.named_children() if isinstance(c, nn.MaxPool2d)]


def measure(name: str, reps: int, zo_before) -> dict:
    spec = CLIENTS[name].spec
    setup = build_setup(spec)
    worker = profiled_worker(spec, setup, "hosfl")
    rep, x = worker.replicas[0], setup.inputs
    after_pools = pools(worker.module)
    before_pools = [(m, n, nn.MaxPool2d(c.kernel_size, c.stride, c.padding)) for m, n, c in after_pools]
    impl = {"A": (zo_before, before_pools), "B": (zo_after, after_pools)}

    @contextlib.contextmanager
    def variant(v: str):
        zo, ps = impl[v]
        hosfl.perturbed, hosfl.reconstruct, hosfl.Projector = zo.perturbed, zo.reconstruct, zo.Projector
        for m, n, c in ps:
            setattr(m, n, c)
        try:
            yield zo
        finally:
            hosfl.perturbed, hosfl.reconstruct, hosfl.Projector = (
                zo_after.perturbed,
                zo_after.reconstruct,
                zo_after.Projector,
            )
            for m, n, c in after_pools:
                setattr(m, n, c)

    gen = torch.Generator().manual_seed(1)
    now = time.thread_time

    def block() -> float:
        return forward_block(worker, rep.params, x, spec.P + 1, now)

    def step(zo, seeds: list[int]) -> float:
        worker.bind(rep.params)
        t0 = now()
        with torch.no_grad():
            z = worker.client_forward(x)["z"]
        t1 = now()
        lam = torch.randn(z.shape, generator=gen)  # the stand-in's λ, not timed
        t2 = now()
        z_tilde = worker.zo_activations(x, seeds)
        v = worker.zo_scalars(x, seeds, zo.Projector(lam, z), z_tilde)
        worker.apply_update(rep, seeds, v)
        return (t1 - t0) + (now() - t2)

    times = {v: {"step": [], "ratio": []} for v in "AB"}
    order, rng, i = ["A", "B"], random.Random(0), 0
    warmup = 2
    for r in range(warmup + reps):
        rng.shuffle(order)
        for v in order:
            with variant(v) as zo:
                seeds = round_seeds(spec.seed, i, spec.P)
                i += 1
                if i % 2:
                    b, s = block(), step(zo, seeds)
                else:
                    s, b = step(zo, seeds), block()
            if r >= warmup:
                times[v]["step"].append(s)
                times[v]["ratio"].append(s / b)
    same = []
    for v in "AB":  # one step from the same replica under each: scalars and digest
        with variant(v) as zo:
            r2 = rep.copy()
            worker.bind(r2.params)
            seeds = round_seeds(spec.seed, 10**6, spec.P)
            with torch.no_grad():
                z = worker.client_forward(x)["z"]
            lam = torch.randn(z.shape, generator=torch.Generator().manual_seed(5))
            vals = worker.zo_scalars(x, seeds, zo.Projector(lam, z), None)
            worker.apply_update(r2, seeds, vals)
            same.append((vals.tolist(), r2.digest()))
    med = statistics.median
    return {
        "client": name,
        "reps": reps,
        "ratio_before": med(times["A"]["ratio"]),
        "ratio_after": med(times["B"]["ratio"]),
        "step_ms_before": med(times["A"]["step"]) * 1e3,
        "step_ms_after": med(times["B"]["step"]) * 1e3,
        "step_after_over_before": med(times["B"]["step"]) / med(times["A"]["step"]),
        "identical": same[0] == same[1],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default="efe76c7", help="commit of the A side")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--clients", nargs="*", choices=list(CLIENTS))
    p.add_argument("--tune-malloc", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.tune_malloc:
        tune_malloc()
    zo_before = module_at(args.before, "hosfl_dist/core/zo.py", "zo_before")
    malloc = "glibc keeping freed memory" if args.tune_malloc else "glibc default malloc"
    print(f"A = {args.before}, B = working tree; one thread, thread CPU time, {malloc}; load {os.getloadavg()}")
    print("| client | step/(P+1) fwd before | after | step time after/before | step before (ms) | after (ms) | same |")
    print("|---|---|---|---|---|---|---|")
    for name in args.clients or list(CLIENTS):
        client = CLIENTS[name]
        if not available(client.spec):
            print(f"| {name} | skipped: {client.spec.model} not installed |")
            continue
        r = measure(name, min(args.reps, client.max_reps or args.reps), zo_before)
        print(f"| {name} | {r['ratio_before']:.3f} | {r['ratio_after']:.3f} | {r['step_after_over_before']:.3f} | "
              f"{r['step_ms_before']:.2f} | {r['step_ms_after']:.2f} | {r['identical']} |", flush=True)  # fmt: skip
    print(f"load after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
