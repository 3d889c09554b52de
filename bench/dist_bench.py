"""Throughput and transport share of the torchrun runtime against the in-process engine, on one machine.

    python bench/dist_bench.py [--config configs/quickstart.yaml] [--budget 6400] [--workers 2 3] [--overlap]

For the config's model (default: the quickstart, small CNN on Fashion-MNIST) it runs
- the in-process engine with 1 intra-op thread (what each torchrun process gets) and with all cores;
- torchrun with 1 server and W client workers, for each W of --workers;
each for ``--budget`` processed samples, evaluating only at the start and the end (evaluation is not timed).

Measured, per run: training time = sum of ``run_round`` wall times (the leader's; workers run in lockstep),
throughput = processed samples / training time, and for torchrun the share of a round each worker spends blocked
in the transport: waiting on RPC (which includes the server's forward/backward) and in all_reduce (which includes
waiting for the slowest worker), with the server's own compute share beside it. Prints a table, writes JSON.
Numbers, not verdicts: on a machine with fewer cores than processes they measure contention as much as transport.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def overrides(args: argparse.Namespace, out_dir: Path) -> list[str]:
    return [
        f"train.budget_samples={args.budget}",
        f"train.eval_every_samples={args.budget}",  # evaluate at 0 and at the end only
        f"data.eval_max_samples={args.eval_samples}",
        f"zo.overlap={str(args.overlap).lower()}",
        "job.progress=false",
        f"job.out_dir={out_dir}",
        *args.overrides,
    ]


def in_process_child(config: str, ovr: list[str]) -> None:
    """Runs in a subprocess (so its thread count is its own): the in-process engine with run_round timed."""
    from hosfl_dist.config import load_config
    from hosfl_dist.runtime.inprocess import InProcessRunner

    engine = InProcessRunner(load_config(config, ovr)).setup()
    worker, timing = engine.worker, {"round_s": 0.0, "rounds": 0}
    run_round = worker.run_round

    def timed(t: int) -> int:
        start = time.perf_counter()
        n = run_round(t)
        timing["round_s"] += time.perf_counter() - start
        timing["rounds"] += 1
        return n

    worker.run_round = timed  # train_loop calls the instance attribute
    summary = engine.run()
    print(json.dumps({**timing, "processed": summary["processed_samples"], "final": summary["final"]}))


def run_in_process(args: argparse.Namespace, threads: int, tmp: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, __file__, "--_in-process-child", "--config", args.config, "--", *overrides(args, tmp)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    if res.returncode != 0:
        raise RuntimeError(f"in-process run failed:\n{res.stderr[-3000:]}")
    got = json.loads(res.stdout.strip().splitlines()[-1])
    return {
        "engine": f"in-process, {threads} thread(s)",
        "processes": 1,
        "rounds": got["rounds"],
        "processed": got["processed"],
        "train_s": got["round_s"],
        "samples_per_s": got["processed"] / got["round_s"],
        "final": got["final"],
    }


def run_torchrun(args: argparse.Namespace, workers: int, tmp: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={workers + 1}",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:0",
        f"--rdzv-id=bench-{uuid.uuid4().hex[:8]}",
        "-m",
        "hosfl_dist.run",
        "--config",
        args.config,
        *overrides(args, tmp),
    ]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if res.returncode != 0:
        raise RuntimeError(f"torchrun with {workers} workers failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    summary = json.loads((tmp / "summary.json").read_text())
    stats = summary["transport"]["workers"]
    train_s = max(s["round_s"] for s in stats.values())
    rpc = sum(s["rpc_wait_s"] / s["round_s"] for s in stats.values()) / len(stats)
    allreduce = sum(s["allreduce_s"] / s["round_s"] for s in stats.values()) / len(stats)
    server = summary["transport"]["server"]["compute_s"]
    round_compute = sum(v for k, v in server.items() if k != "eval_batch")
    return {
        "engine": f"torchrun, 1 server + {workers} workers",
        "processes": workers + 1,
        "rounds": summary["rounds"],
        "processed": summary["processed_samples"],
        "train_s": train_s,
        "samples_per_s": summary["processed_samples"] / train_s,
        "transport_share": rpc + allreduce,
        "rpc_wait_share": rpc,
        "allreduce_share": allreduce,
        "server_compute_share": round_compute / train_s,
        "allreduce_bytes_per_round": next(iter(stats.values()))["allreduce_bytes"] / summary["rounds"],
        "final": summary["final"],
        "client_digests_equal": len(set(summary["client_digests"].values())) == 1,
    }


def table(rows: list[dict], base: float) -> str:
    head = f"{'engine':36s} {'samples/s':>10s} {'vs 1-thr':>8s} {'train s':>8s} {'transport':>9s} {'(rpc':>6s} "
    head += f"{'allred)':>7s} {'server':>7s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        line = f"{r['engine']:36s} {r['samples_per_s']:10.1f} {r['samples_per_s'] / base:8.2f} {r['train_s']:8.2f}"
        if "transport_share" in r:
            line += f" {r['transport_share']:9.1%} {r['rpc_wait_share']:6.1%} {r['allreduce_share']:7.1%}"
            line += f" {r['server_compute_share']:7.1%}"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--budget", type=int, default=6400, help="processed samples per run (quickstart: 128 per round)")
    p.add_argument("--eval-samples", type=int, default=1000, help="data.eval_max_samples (evaluation is not timed)")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 3], help="client-worker counts to run")
    p.add_argument("--overlap", action="store_true", help="zo.overlap=true (latency hiding) in every run")
    p.add_argument("--repeat", type=int, default=1, help="runs per setting; the one of median throughput is kept")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--out", default="runs/bench/dist_bench.json")
    p.add_argument("--_in-process-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="extra dotted overrides for every run (after --)")
    args = p.parse_args()
    if args._in_process_child:
        in_process_child(args.config, args.overrides)
        return
    settings = [(run_in_process, n) for n in sorted({1, os.cpu_count() or 1})] + [
        (run_torchrun, w) for w in args.workers
    ]
    rows = []
    with tempfile.TemporaryDirectory(prefix="dist_bench_") as tmp:
        for fn, n in settings:
            runs = sorted(
                (fn(args, n, Path(tmp) / f"{fn.__name__}{n}_{i}") for i in range(args.repeat)),
                key=lambda r: r["samples_per_s"],
            )
            rows.append({**runs[len(runs) // 2], "samples_per_s_all": [round(r["samples_per_s"], 1) for r in runs]})
            print(f"measured: {rows[-1]['engine']} {rows[-1]['samples_per_s_all']}", file=sys.stderr, flush=True)
    base = rows[0]["samples_per_s"]
    print(f"config {args.config}, {args.budget} samples per run, overlap={args.overlap}, {os.cpu_count()} CPU cores")
    print(table(rows, base))
    same = all(r["final"] == rows[0]["final"] for r in rows if r["processes"] > 1)
    print(f"torchrun final metrics identical to the 1-thread in-process run: {same}")
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "config": args.config,
        "budget": args.budget,
        "overlap": args.overlap,
        "repeat": args.repeat,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    out.write_text(json.dumps({**meta, "runs": rows}, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
