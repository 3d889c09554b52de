"""zo.batch_clients A/B: seconds per HO-SFL round of the quickstart worker hosting the round's 4 clients, client by
client (A) against in one pass (B), and the client's largest activation in each.

    python results/bench/batch_clients/ab.py --rounds 40 [OVERRIDE ...]
    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=2147483648 python results/bench/batch_clients/ab.py

Both runs live in one process (in-process runtime, job.threads=1, the server on a thread of it) and take turns round
by round, so a busy machine weighs on both alike; the first two rounds of each are warm-up. Each round is timed around
``worker.run_round`` (no evaluation), in wall time and in the CPU time of the worker's thread (the server computes on
its own thread; CPU time is less moved by other work on the machine than wall time): sync, the 4 forwards (or one),
the server's step, the 4·P perturbed forwards (or P), the scalar exchange and the update. The largest activation is
the biggest output of one f_c module in a forward (forward hooks), for one client's batch and for the round's 4
concatenated. The second command keeps freed memory in the process (glibc's thresholds, as ``bench.zo_step
--tune-malloc``): with the default ones every buffer of the 4x batch is a fresh mmap, zeroed page by page.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from hosfl_dist.algorithms.hosfl import cat_inputs  # noqa: E402
from hosfl_dist.config import load_config  # noqa: E402
from hosfl_dist.runtime.inprocess import InProcessRunner  # noqa: E402


def largest_output(worker, x) -> int:
    """Bytes of the biggest module output in one no-grad forward of f_c on ``x``."""
    sizes = []
    hooks = [m.register_forward_hook(lambda _m, _a, out: sizes.append(out.numel() * out.element_size()))
             for m in worker.module.modules() if not list(m.children())]  # fmt: skip
    try:
        worker.zo_forward(x)
    finally:
        for h in hooks:
            h.remove()
    return max(sizes)


def forward_times(worker, xs, reps: int) -> tuple[float, float]:
    """Fastest seconds of the clients' z client by client and of one forward of them together, turn by turn."""
    x = cat_inputs(xs)
    a, b = [], []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for xi in xs:
            worker.zo_forward(xi)
        t1 = time.perf_counter()
        worker.zo_forward(x)
        a.append(t1 - t0)
        b.append(time.perf_counter() - t1)
    return min(a[1:]), min(b[1:])  # the fastest: the least disturbed by other work


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("overrides", nargs="*", help="more dotted overrides for both runs (e.g. zo.overlap=false)")
    args = p.parse_args()
    torch.set_num_threads(1)
    runners = {}
    with tempfile.TemporaryDirectory() as tmp:
        for on in (False, True):
            ovr = ["job.threads=1", "job.progress=false", "job.plots=false", f"train.budget_samples={10**9}",
                   f"train.eval_every_samples={10**9}", f"zo.batch_clients={str(on).lower()}",
                   f"job.out_dir={tmp}/{on}", *args.overrides]  # fmt: skip
            runners[on] = InProcessRunner(load_config(ROOT / "configs/quickstart.yaml", ovr)).setup()
        times: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[bool, list[float]] = {False: [], True: []}  # the worker's thread alone (the server has its own)
        for t in range(args.rounds + 2):
            for on in (False, True) if t % 2 == 0 else (True, False):
                t0, c0 = time.perf_counter(), time.thread_time()
                runners[on].worker.run_round(t)
                if t >= 2:
                    times[on].append(time.perf_counter() - t0)
                    cpu[on].append(time.thread_time() - c0)
        worker = runners[False].worker
        _, mine = worker.plan(0)
        xs = [worker.data.next_batch(m)[0] for m in mine]
        one, together = largest_output(worker, xs[0]), largest_output(worker, cat_inputs(xs))
        worker.bind(worker.replicas[mine[0]].params)
        fa, fb = forward_times(worker, xs, 4 * args.rounds)
        for r in runners.values():  # every replica to the end (Algorithm 3), then θc of A and B side by side
            r.worker.sync_all(args.rounds + 2)
            r.worker.eval_params(args.rounds + 2)  # the evaluation replica too
            r.worker.client_digest()  # the replicas of each run agree
        pa, pb = (runners[on].worker.replicas[0].params for on in (False, True))
        diff = max(float((u - v).abs().max()) for u, v in zip(pa, pb))
        for r in runners.values():
            r.cleanup()
    a, b = statistics.median(times[False]), statistics.median(times[True])
    print(f"clients per round on the worker: {len(mine)}, P={worker.P}, B={worker.cfg.clients.batch_size}, "
          f"{args.rounds} rounds each")  # fmt: skip
    print(f"s/round  client by client (A): {a:.4f}  one pass (B): {b:.4f}  B/A: {b / a:.3f}")
    ca, cb = statistics.median(cpu[False]), statistics.median(cpu[True])
    print(f"worker CPU s/round  A: {ca:.4f}  B: {cb:.4f}  B/A: {cb / ca:.3f}")
    print(f"fastest round  A: {min(times[False]):.4f}  B: {min(times[True]):.4f}  B/A: "
          f"{min(times[True]) / min(times[False]):.3f}")  # fmt: skip
    print(f"quartiles A: {statistics.quantiles(times[False], n=4)}  B: {statistics.quantiles(times[True], n=4)}")
    print(f"f_c forwards alone: {len(xs)} x {len(xs[0])} rows {fa * 1e3:.2f} ms, one of {len(xs) * len(xs[0])} "
          f"rows {fb * 1e3:.2f} ms, ratio {fb / fa:.3f}")  # fmt: skip
    print(f"largest f_c activation: one client {one / 2**20:.2f} MiB, {len(xs)} clients together "
          f"{together / 2**20:.2f} MiB")  # fmt: skip
    print(f"θc after the rounds, largest |A − B|: {diff:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
