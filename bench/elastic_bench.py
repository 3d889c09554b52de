"""An elastic run against the torchrun job and the in-process runtime: one config, nothing dropping, one run.

    python -m bench.elastic_bench [--config configs/repro/quickstart_small_cnn.yaml] [--budget 6400] [--workers 2] \
        [--repeat 3]

For the config's model (default: the quickstart) it runs, ``--repeat`` times each and alternating, so that the load
of a shared machine falls on all three alike:
- the in-process runtime with 1 intra-op thread (what each process of the others gets);
- torchrun with 1 server + W client workers (``bench.dist_bench``'s run);
- ``--serve`` with W ``--join`` workers, each its own process;
each for ``--budget`` processed samples, evaluating at the start and the end only. Throughput is processed samples
over the rounds' wall time: the slowest worker's ``run_round`` times under torchrun, the server's trainer's round
times in the elastic run (a round there is from its opening to its close at the gate: what every worker waited for),
less its wait for ``server.min_workers`` to join (the start-up torchrun's launch does before its first round).
It also reports the elastic workers' RPC messages per worker-round and the digests of both multi-process runs against
the in-process run's (nothing drops: all three compute the same run).
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

from bench.common import ROOT, Recorder, options
from bench.dist_bench import overrides, run_in_process, run_torchrun
from bench.suite import BENCHMARKS


def run_elastic(args: argparse.Namespace, workers: int, tmp: Path) -> dict:
    """``--serve`` and ``workers`` ``--join`` processes, one thread each; the run's summary read back."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = tmp / "run"
    serve = [sys.executable, "-m", "hosfl_dist.run", "--config", str(ROOT / args.config), "--serve",
             f"server.min_workers={workers}", *overrides(args, out)]  # fmt: skip
    logs = [open(tmp / f"{name}.log", "w") for name in ["server", *(f"w{i}" for i in range(workers))]]  # noqa: SIM115
    try:
        server = subprocess.Popen(serve, cwd=tmp, env=env, stdout=logs[0], stderr=subprocess.STDOUT)
        end = time.monotonic() + args.timeout
        while not (out / "join.json").exists():
            if server.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the elastic server did not start:\n{(tmp / 'server.log').read_text()[-3000:]}")
            time.sleep(0.1)
        joins = [subprocess.Popen([sys.executable, "-m", "hosfl_dist.run", "--join", str(out)], cwd=tmp, env=env,
                                  stdout=logs[i + 1], stderr=subprocess.STDOUT) for i in range(workers)]  # fmt: skip
        code = server.wait(args.timeout)
        for j in joins:
            j.wait(120)
    finally:
        for fh in logs:
            fh.close()
    if code != 0:
        raise RuntimeError(f"the elastic run failed:\n{(tmp / 'server.log').read_text()[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    stats = summary["transport"]["workers"]
    coordinator = stats["coordinator"]  # the server's rounds, less the wait for server.min_workers to join
    train_s = coordinator["round_s"] - coordinator.get("waiting_for_workers_s", 0.0)
    members = [s for name, s in stats.items() if name != "coordinator"]
    rounds = summary["rounds"]
    return {
        "engine": f"elastic, --serve + {workers} --join workers",
        "processes": workers + 1,
        "rounds": rounds,
        "processed": summary["processed_samples"],
        "train_s": train_s,
        "samples_per_s": summary["processed_samples"] / train_s,
        "rpc_calls_per_round": sum(s.get("rpc_calls", 0) for s in members) / max(1, len(members) * rounds),
        "blocked_waits_per_round": sum(sum(s.get("blocked", {}).values()) for s in members)
        / max(1, len(members) * rounds),
        "final": summary["final"],
        "digests": sorted(set(summary["client_digests"].values())),
        "server_digest": summary["server_digest"],
    }


def figures(data: dict) -> dict:
    med = {kind: data["median"][kind]["samples_per_s"] for kind in data["median"]}
    values = {
        "in_process_samples_per_s": med["in_process"],
        "torchrun_samples_per_s": med["torchrun"],
        "elastic_samples_per_s": med["elastic"],
        "elastic_vs_torchrun": med["elastic"] / med["torchrun"],
        "elastic_rpc_messages": data["median"]["elastic"]["rpc_calls_per_round"],
        "elastic_blocking_waits": data["median"]["elastic"]["blocked_waits_per_round"],
    }
    finals = {kind: data["median"][kind]["final"] for kind in data["median"]}
    values["same_final_metrics"] = finals["elastic"] == finals["torchrun"] == finals["in_process"]
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/repro/quickstart_small_cnn.yaml")
    p.add_argument("--budget", type=int, default=6400, help="processed samples per run (quickstart: 128 per round)")
    p.add_argument("--eval-samples", type=int, default=1000, help="data.eval_max_samples (evaluation is not timed)")
    p.add_argument("--workers", type=int, default=2, help="client workers of the torchrun and the elastic runs")
    p.add_argument("--repeat", type=int, default=3, help="runs of each, alternating; the median is reported")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("overrides", nargs="*", help="extra dotted overrides for every run (after --)")
    args = options(p).parse_args(argv)
    args.overlap = ["auto"]
    from hosfl_dist.config import load_config

    cfg = load_config(ROOT / args.config, args.overrides)
    args.K, args.P = cfg.clients.per_round, cfg.zo.num_perturbations  # what dist_bench's runs read
    rec = Recorder(BENCHMARKS["elastic"], argv, args.via)
    runs: dict[str, list[dict]] = {"in_process": [], "torchrun": [], "elastic": []}
    with tempfile.TemporaryDirectory(prefix="elastic_bench_") as tmp:
        for i in range(args.repeat):
            for kind in runs:
                where = Path(tmp) / f"{kind}{i}"
                where.mkdir()
                if kind == "in_process":
                    row = run_in_process(args, 1, where / "run")
                elif kind == "torchrun":
                    row = run_torchrun(args, args.workers, where / "run")
                else:
                    row = run_elastic(args, args.workers, where)
                runs[kind].append(row)
                print(f"measured: {row['engine']}: {row['samples_per_s']:.1f} samples/s", file=sys.stderr, flush=True)
    median = {k: sorted(v, key=lambda r: r["samples_per_s"])[len(v) // 2] for k, v in runs.items()}
    print(f"config {args.config}, {args.budget} samples per run, {args.repeat} runs each (alternating), median:")
    for kind, row in median.items():
        every = ", ".join(f"{r['samples_per_s']:.1f}" for r in runs[kind])
        print(f"  {row['engine']:44s} {row['samples_per_s']:8.1f} samples/s   (runs: {every})")
    ratio = median["elastic"]["samples_per_s"] / median["torchrun"]["samples_per_s"]
    print(f"elastic / torchrun: {ratio:.2f}; elastic RPC messages per worker-round: "
          f"{median['elastic']['rpc_calls_per_round']:.2f}, of which waited on: "
          f"{median['elastic']['blocked_waits_per_round']:.2f}")  # fmt: skip
    data = {"config": args.config, "budget": args.budget, "workers": args.workers, "repeat": args.repeat,
            "runs": runs, "median": median}  # fmt: skip
    values = figures(data)
    print(f"final metrics equal in the three runtimes: {values['same_final_metrics']}")
    rec.write(args.out, data, values)
    return 0


if __name__ == "__main__":
    sys.exit(main())
