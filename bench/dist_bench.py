"""The torchrun runtime against the in-process runtime, and its transport against the floor measured beside it.

    python -m bench.dist_bench [--config configs/repro/quickstart_small_cnn.yaml] [--budget 6400] [--workers 1 2]
                               [--overlap auto|true|false ...]
    python -m bench.dist_bench --workers 2 --repeat 3 --before /tmp/old    # also the torchrun runs of an older tree

For the config's model (default: the quickstart, small CNN on Fashion-MNIST) it runs
- the in-process runtime with 1 intra-op thread (what each torchrun process gets) and with all cores;
- torchrun with 1 server and W client workers, for each W of --workers (and the same from ``--before``, a checkout
  of an earlier version, e.g. ``git worktree add /tmp/old <commit>``);
- the transport floor with the same process layout (``bench/rpc_floor.py``): one loopback RPC round trip carrying
  the round's submit (z + labels up, λ down) and one all_reduce of the K×P scalar matrix;
each run for ``--budget`` processed samples, evaluating only at the start and the end (evaluation is not timed).
``--overlap`` sets zo.overlap (default: auto, the product's default); a second value adds torchrun runs with it, marked
``[zo.overlap=…]`` (e.g. ``--overlap auto false``: latency hiding against turn-taking in one invocation).

Reported per torchrun run: throughput (processed samples / the sum of ``run_round`` wall times), and per client
worker and round: the time blocked in the transport (waiting on RPC answers, which includes the server's compute,
plus all_reduce, which includes waiting for the slowest worker), beside the floor; the RPC calls sent; and the waits
that really blocked (answers not there yet when asked for: the round trips on the critical path), per method where
the version records them. Numbers, not verdicts: on a machine with fewer cores than processes they measure contention
as much as transport.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, Recorder, options, torchrun_cmd
from bench.suite import BENCHMARKS
from hosfl_dist.runtime.process.groups import RPC_CHANNELS, RPC_TRANSPORTS


def overrides(args: argparse.Namespace, out_dir: Path, overlap: str | None = None) -> list[str]:
    return [
        f"train.budget_samples={args.budget}",
        f"train.eval_every_samples={args.budget}",  # evaluate at 0 and at the end only
        f"data.eval_max_samples={args.eval_samples}",
        f"zo.overlap={overlap or args.overlap[0]}",
        "job.progress=false",
        f"job.out_dir={out_dir}",
        *args.overrides,
    ]


def in_process_child(config: str, ovr: list[str]) -> None:
    """Runs in a subprocess (so its thread count is its own): the in-process runtime with run_round timed."""
    from hosfl_dist.config import load_config
    from hosfl_dist.runtime.inprocess import InProcessRunner
    from hosfl_dist.transport.wire import payload_bytes

    runner = InProcessRunner(load_config(config, ovr)).setup()
    worker, timing = runner.worker, {"round_s": 0.0, "rounds": 0}
    x, y = next(worker.data.eval_batches(runner.cfg.clients.batch_size))  # a batch's shape; client streams untouched
    act = worker.client_forward(x)
    sizes = {"submit_up_bytes": payload_bytes([act, y]), "submit_down_bytes": payload_bytes(act["z"])}
    run_round = worker.run_round

    def timed(t: int) -> int:
        start = time.perf_counter()
        n = run_round(t)
        timing["round_s"] += time.perf_counter() - start
        timing["rounds"] += 1
        return n

    worker.run_round = timed  # the trainer calls the instance attribute
    summary = runner.run()
    print(json.dumps({**timing, **sizes, "processed": summary["processed_samples"], "final": summary["final"]}))


def run_in_process(args: argparse.Namespace, threads: int, tmp: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "bench.dist_bench", "--_in-process-child", "--config", args.config, "--",
           *overrides(args, tmp)]  # fmt: skip
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
        "sizes": {k: got[k] for k in ("submit_up_bytes", "submit_down_bytes")},
    }


def run_torchrun(
    args: argparse.Namespace, workers: int, tmp: Path, tree: Path = ROOT, label: str = "", overlap: str | None = None
) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    config = str(ROOT / args.config)
    cmd = torchrun_cmd(workers + 1, ["-m", "hosfl_dist.run", "--config", config, *overrides(args, tmp, overlap)])
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=args.timeout)
    if res.returncode != 0:
        raise RuntimeError(f"torchrun with {workers} workers failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    summary = json.loads((tmp / "summary.json").read_text())
    stats = summary["transport"]["workers"]
    train_s = max(s["round_s"] for s in stats.values())
    rounds = summary["rounds"]
    per_worker = len(stats) * rounds

    def per_round(key: str) -> float:
        return sum(s.get(key, 0) for s in stats.values()) / per_worker

    def by_method(key: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in stats.values():
            for m, n in s.get(key, {}).items():
                out[m] = out.get(m, 0) + n / per_worker
        return out

    rpc = sum(s["rpc_wait_s"] / s["round_s"] for s in stats.values()) / len(stats)
    allreduce = sum(s["allreduce_s"] / s["round_s"] for s in stats.values()) / len(stats)
    server = summary["transport"]["server"]["compute_s"]
    round_compute = sum(v for k, v in server.items() if not k.startswith("eval"))
    return {
        "engine": f"torchrun, 1 server + {workers} workers{label}",
        "processes": workers + 1,
        "rounds": rounds,
        "processed": summary["processed_samples"],
        "train_s": train_s,
        "samples_per_s": summary["processed_samples"] / train_s,
        "transport_share": rpc + allreduce,
        "rpc_wait_share": rpc,
        "allreduce_share": allreduce,
        "server_compute_share": round_compute / train_s,
        "transport_ms_per_round": 1e3 * (per_round("rpc_wait_s") + per_round("allreduce_s")),
        "rpc_calls_per_round": per_round("rpc_calls"),
        "rpc_calls_per_round_by_method": by_method("calls"),
        "blocked_waits_per_round": sum(by_method("blocked").values())
        if "blocked" in next(iter(stats.values()))
        else None,
        "blocked_waits_per_round_by_method": by_method("blocked"),
        "blocked_ms_per_round_by_method": {k: 1e3 * v for k, v in by_method("blocked_s").items()},
        "sampled_clients_per_worker_round": args.K / workers,
        "allreduce_bytes_per_round": next(iter(stats.values()))["allreduce_bytes"] / rounds,
        "final": summary["final"],
        "client_digests_equal": len(set(summary["client_digests"].values())) == 1,
    }


def run_floor(args: argparse.Namespace, workers: int, sizes: dict, tmp: Path) -> dict:
    out = tmp / f"floor{workers}.json"
    target = [
        "-m",
        "bench.rpc_floor",
        f"--up-bytes={sizes['submit_up_bytes']}",
        f"--down-bytes={sizes['submit_down_bytes']}",
        f"--K={args.K}",
        f"--P={args.P}",
        f"--out={out}",
        "--transports", *RPC_TRANSPORTS,
        "--channels", *RPC_CHANNELS,
    ]  # fmt: skip
    res = subprocess.run(torchrun_cmd(workers + 1, target), cwd=ROOT, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"floor with {workers} workers failed:\n{res.stderr[-3000:]}")
    floor = json.loads(out.read_text())
    floor["floor_ms_per_round"] = 1e3 * (floor["rpc_round_trip_s"] + floor["all_reduce_s"])
    return floor


def table(rows: list[dict], base: float) -> str:
    head = f"{'engine':44s} {'samples/s':>9s} {'vs 1-thr':>8s} {'transport':>9s} {'ms/round':>8s} {'floor ms':>8s}"
    head += f" {'RPCs/round':>10s} {'blocked/round':>13s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        line = f"{r['engine']:44s} {r['samples_per_s']:9.1f} {r['samples_per_s'] / base:8.2f}"
        if "transport_share" in r:
            blocked = r["blocked_waits_per_round"]
            line += f" {r['transport_share']:9.1%} {r['transport_ms_per_round']:8.1f} {r['floor_ms_per_round']:8.2f}"
            line += f" {r['rpc_calls_per_round']:10.2f} {'n/a' if blocked is None else f'{blocked:.2f}':>13s}"
        lines.append(line)
    return "\n".join(lines)


def waits(rows: list[dict], floors: dict) -> str:
    """Per torchrun run, the waits that blocked, per method: how many per worker-round and their ms per worker-round,
    beside the loopback round trip of the floor run."""
    lines = ["blocked waits per worker-round, per method: count / ms (loopback round trips of the floor run in "
             "brackets: a submit's, an empty one)"]  # fmt: skip
    for r in rows:
        if "blocked_ms_per_round_by_method" not in r:
            continue
        counts, ms = r["blocked_waits_per_round_by_method"], r["blocked_ms_per_round_by_method"]
        each = ", ".join(f"{m} {counts[m]:.2f} / {ms.get(m, 0.0):.2f} ms" for m in sorted(counts) if counts[m])
        floor = floors[r["processes"] - 1]
        rtts = [1e3 * floor[k] for k in ("rpc_round_trip_s", "small_round_trip_s") if k in floor]
        lines.append(f"  {r['engine']}: {each or 'none'} [{', '.join(f'{v:.2f} ms' for v in rtts)}]")
    return "\n".join(lines)


def figures(data: dict) -> tuple[dict, dict]:
    """Throughput against the 1-thread in-process run; per torchrun layout of the declared worker counts, the
    transport's ms per worker-round (its floor measured beside it), the blocking waits and the RPC messages."""
    runs = data["runs"]
    base = runs[0]
    values = {"in_process_samples_per_s": base["samples_per_s"]}
    floors = {}
    for r in runs:
        if "transport_ms_per_round" not in r or r["engine"].endswith("]"):  # in-process, or an older tree's run
            continue
        w = r["processes"] - 1
        if f"torchrun_w{w}_vs_in_process" not in BENCHMARKS["dist"].names:
            continue
        values[f"torchrun_w{w}_vs_in_process"] = r["samples_per_s"] / base["samples_per_s"]
        values[f"torchrun_w{w}_transport_ms"] = r["transport_ms_per_round"]
        values[f"torchrun_w{w}_blocking_waits"] = r["blocked_waits_per_round"]
        values[f"torchrun_w{w}_rpc_messages"] = r["rpc_calls_per_round"]
        if "blocked_ms_per_round_by_method" in r:
            values[f"torchrun_w{w}_catch_up_wait_ms"] = r["blocked_ms_per_round_by_method"].get("sync", 0.0)
        floors[f"torchrun_w{w}_transport_ms"] = r["floor_ms_per_round"]
    torchruns = [r for r in runs if r["processes"] > 1]
    if torchruns:
        values["same_final_metrics"] = all(r["final"] == base["final"] for r in torchruns)
    return values, floors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/repro/quickstart_small_cnn.yaml")
    p.add_argument("--budget", type=int, default=6400, help="processed samples per run (quickstart: 128 per round)")
    p.add_argument("--eval-samples", type=int, default=1000, help="data.eval_max_samples (evaluation is not timed)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="client-worker counts to run")
    p.add_argument("--overlap", nargs="*", choices=["auto", "true", "false"], default=["auto"],
                   help="zo.overlap of the runs (alone: true); more values add torchrun runs with each")  # fmt: skip
    p.add_argument("--repeat", type=int, default=1, help="runs per setting; the one of median throughput is kept")
    p.add_argument("--before", type=Path, help="a checkout of an earlier version whose torchrun runs are added")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--_in-process-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="extra dotted overrides for every run (after --)")
    args = options(p).parse_args(argv)
    if args._in_process_child:
        in_process_child(args.config, args.overrides)
        return 0
    args.overlap = list(dict.fromkeys(args.overlap or ["true"]))
    rec = Recorder(BENCHMARKS["dist"], argv, args.via)
    from hosfl_dist.config import load_config

    cfg = load_config(ROOT / args.config, args.overrides)
    args.K, args.P = cfg.clients.per_round, cfg.zo.num_perturbations
    first = args.overlap[0]
    settings = [("in-process", n, ROOT, first) for n in sorted({1, os.cpu_count() or 1})]
    settings += [("torchrun", w, ROOT, v) for w in args.workers for v in args.overlap]
    if args.before is not None:
        settings += [("torchrun", w, args.before.resolve(), first) for w in args.workers]
    rows, floors = [], {}
    with tempfile.TemporaryDirectory(prefix="dist_bench_") as tmp:
        for kind, n, tree, overlap in settings:
            runs = []
            for i in range(args.repeat):
                out = Path(tmp) / f"{kind}{n}_{tree.name}_{overlap}_{i}"
                if kind == "in-process":
                    runs.append(run_in_process(args, n, out))
                else:
                    label = "" if tree == ROOT else f" [{args.before}]"
                    label += "" if overlap == first else f" [zo.overlap={overlap}]"
                    runs.append(run_torchrun(args, n, out, tree, label, overlap))
            runs.sort(key=lambda r: r["samples_per_s"])
            row = {**runs[len(runs) // 2], "samples_per_s_all": [round(r["samples_per_s"], 1) for r in runs]}
            if kind == "torchrun":
                if n not in floors:
                    floors[n] = run_floor(args, n, rows[0]["sizes"], Path(tmp))
                row["floor_ms_per_round"] = floors[n]["floor_ms_per_round"]
                row["transport_over_floor"] = row["transport_ms_per_round"] / row["floor_ms_per_round"]
            rows.append(row)
            print(f"measured: {row['engine']} {row['samples_per_s_all']}", file=sys.stderr, flush=True)
    base = rows[0]["samples_per_s"]
    print(f"config {args.config}, {args.budget} samples per run, zo.overlap={first} (other values marked), "
          f"{os.cpu_count()} CPU cores")  # fmt: skip
    print(table(rows, base))
    print("transport: share of the round a worker is blocked in RPC waits + all_reduce; ms/round: the same per round")
    print("floor: one loopback RPC round trip carrying a submit (z + labels up, λ down) + one all_reduce of K×P")
    print(waits(rows, floors))
    same = all(r["final"] == rows[0]["final"] for r in rows if r["processes"] > 1)
    print(f"torchrun final metrics identical to the 1-thread in-process run: {same}")
    data = {
        "config": args.config,
        "budget": args.budget,
        "overlap": args.overlap,
        "repeat": args.repeat,
        "before": str(args.before) if args.before else None,
        "cpu_count": os.cpu_count(),
        "floors": floors,
        "runs": rows,
    }
    rec.write(args.out, data, *figures(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
