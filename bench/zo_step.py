"""ZO client step time against its floor: (P+1) no-grad client forwards.

    python -m bench.zo_step [--reps 40] [--clients NAME ...] [--tune-malloc] [--out bench/out]

One HO-SFL client step is what HOSFLWorker.run_round does for a sampled client, with a stand-in server (the memory
profiler's): z = f_c(x), the P perturbed forwards (zo_activations), the P projections v_p = λᵀ(z̃_p − z), and the
optimizer step from ĝ_c regenerated from the seeds (apply_update). Its physical floor is (P+1) forwards plus the
noise regeneration (2·P·d_c normal draws: once to perturb, once to rebuild ĝ_c). Reported per client:

    ratio = median step time / ((P+1) · median no-grad forward time)

with the step split into forward, perturbed forwards, projections and update, and the regeneration cost measured
alone (P·d_c draws through zo.noise_like) so that the part of the ratio above 1 can be read off. Forward and step
are timed alternately (warm-up first) so that load from other processes hits both alike, and the headline is
the median over repetitions of step_i / ((P+1)·forward_i); one torch thread by
default, because on a machine whose cores are shared, OpenMP barriers of a 2-thread run stall whenever another
process holds a core, which distorts short forwards far more than long ones.

Allocator: with glibc's defaults a freed block above the (dynamic) mmap threshold goes back to the OS, and the
next forward that needs it pays page faults; whether that happens depends on what else is alive (the step keeps
z and the P z̃, a lone forward keeps nothing), so it moves both sides of the ratio. ``--tune-malloc`` keeps freed
memory in the process (mallopt; the same as MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_) and measures the compute
alone; the suite runs both (``zo_step`` and ``zo_step_tuned``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bench.common import Recorder, options
from bench.suite import BENCHMARKS
from hosfl_dist.core.seeding import round_seeds
from hosfl_dist.core.zo import Projector, noise_like
from hosfl_dist.measure.modes import ProfileSpec, build_setup, profiled_worker

CLIENTS = {
    # figure name: spec -- the quickstart client (configs/quickstart.yaml), a tiny LM client with LoRA and without,
    # and the ResNet-18 client of results/finetune
    "quickstart_cnn": ProfileSpec(model="small_cnn", cut=1, batch=32, num_perturbations=5),
    "tiny_llama_lora": ProfileSpec(model="tiny:llama", cut=2, batch=32, seq=128),
    "tiny_llama_full": ProfileSpec(model="tiny:llama", cut=2, batch=32, seq=128, lora=False),
    "resnet18_cut2": ProfileSpec(model="resnet18", cut=2, batch=32, num_perturbations=5),
}


def tune_malloc() -> None:
    """Keep freed memory in the process: glibc otherwise unmaps every freed block above its mmap threshold (and
    trims the heap top), so each forward that frees a large activation pays fresh page faults on the next one."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's largest mmap threshold on 64-bit
    ok &= libc.mallopt(m_trim_threshold, 1 << 31)
    if not ok:
        raise RuntimeError("mallopt refused the thresholds (not glibc?)")


def measure_client(spec: ProfileSpec, reps: int, warmup: int = 3) -> dict:
    setup = build_setup(spec)
    worker = profiled_worker(spec, setup, "hosfl")
    rep = worker.replicas[0]
    x = setup.inputs
    gen = torch.Generator().manual_seed(1)
    d_c = sum(p.numel() for p in rep.params)
    times: dict[str, list[float]] = {k: [] for k in ("forward", "step", "z", "perturbed", "project", "update", "noise")}
    for i in range(warmup + reps):
        seeds = round_seeds(spec.seed, i, spec.P)
        worker.bind(rep.params)
        t0 = time.perf_counter()
        with torch.no_grad():
            worker.client_forward(x)
        t1 = time.perf_counter()
        # one client step, phase by phase
        with torch.no_grad():
            z = worker.client_forward(x)["z"]
        t2 = time.perf_counter()
        lam = torch.randn(z.shape, generator=gen)  # the stand-in's λ (not timed: it comes over the link)
        t3 = time.perf_counter()
        z_tilde = worker.zo_activations(x, seeds)
        t4 = time.perf_counter()
        v = worker.zo_scalars(x, seeds, Projector(lam, z), z_tilde)
        t5 = time.perf_counter()
        worker.apply_update(rep, seeds, v)
        t6 = time.perf_counter()
        for s in seeds:  # regeneration alone: the P·d_c draws of one pass over θc
            for j, p in enumerate(rep.params):
                noise_like(p, s, j)
        t7 = time.perf_counter()
        if i >= warmup:
            times["forward"].append(t1 - t0)
            times["z"].append(t2 - t1)
            times["perturbed"].append(t4 - t3)
            times["project"].append(t5 - t4)
            times["update"].append(t6 - t5)
            times["step"].append((t2 - t1) + (t6 - t3))
            times["noise"].append(t7 - t6)
    med = {k: statistics.median(v) for k, v in times.items()}
    floor = (spec.P + 1) * med["forward"]
    # forward i and step i ran back to back: their ratio sees the same load, so its median is the headline
    paired = [s / ((spec.P + 1) * f) for s, f in zip(times["step"], times["forward"])]
    return {
        "P": spec.P,
        "d_c": d_c,
        "median_s": med,
        "ratio": statistics.median(paired),
        "ratio_of_medians": med["step"] / floor,
        "ratio_of_minima": min(times["step"]) / ((spec.P + 1) * min(times["forward"])),
        # 1 + what regeneration alone costs (2 passes of P·d_c draws): the floor the issue names
        "floor_with_noise": 1 + 2 * med["noise"] / floor,
        "ratio_step_parts": {k: med[k] / floor for k in ("z", "perturbed", "project", "update")},
    }


def figures(data: dict) -> tuple[dict, dict]:
    """The ratio of each client measured, and its floor (1 + the noise regeneration measured beside it)."""
    rows = data["clients"]
    return {r["client"]: r["ratio"] for r in rows}, {r["client"]: r["floor_with_noise"] for r in rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: on 2 shared cores, 2 threads under load time noise)"
    )
    p.add_argument("--clients", nargs="*", choices=list(CLIENTS), help="subset of the clients (default: all)")
    p.add_argument(
        "--tune-malloc",
        action="store_true",
        help="glibc: keep freed memory (mmap threshold 32 MiB, trim threshold 2 GiB), see the module docstring",
    )
    args = options(p).parse_args(argv)
    rec = Recorder(BENCHMARKS["zo_step_tuned" if args.tune_malloc else "zo_step"], argv, args.via)
    torch.set_num_threads(args.threads)
    if args.tune_malloc:
        tune_malloc()
    rows = []
    for name, spec in CLIENTS.items():
        if args.clients and name not in args.clients:
            continue
        r = measure_client(spec, args.reps)
        rows.append({"client": name, **r})
        m = r["median_s"]
        print(
            f"{name:16s} ratio {r['ratio']:.3f} (of minima {r['ratio_of_minima']:.3f}; "
            f"floor+noise {r['floor_with_noise']:.3f}) "
            f"fwd {m['forward'] * 1e3:.2f} ms, step {m['step'] * 1e3:.2f} ms = z {m['z'] * 1e3:.2f} + perturbed "
            f"{m['perturbed'] * 1e3:.2f} + project {m['project'] * 1e3:.2f} + update {m['update'] * 1e3:.2f}; "
            f"d_c {r['d_c']}",
            flush=True,
        )
    data = {"threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "tune_malloc": args.tune_malloc,
            "reps": args.reps, "clients": rows}  # fmt: skip
    rec.write(args.out, data, *figures(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
