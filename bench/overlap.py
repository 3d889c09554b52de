"""Measured latency hiding (paper §3.4, App. C.1): real HO-SFL round time vs P, overlap on and off, under the link.

    python -m bench.overlap [--setups quickstart resnet18] [--links scaled paper] [--ps 1 2 5 10 20 40]
                            [--runtimes in_process torchrun] [--out bench/out]

Each setting runs with ``comm.inject_delay=true``: every client<->server message pays ``bytes·8 / bandwidth +
RTT/2`` (hosfl_dist.transport.link), asynchronously, and the scalar exchange one round trip. One sampled client per
round (K = 1) on one always-current replica (``clients.replicas=shared``: no catch-up replay at the start of a round;
the paper's per-client timeline), timed around ``worker.run_round`` (no evaluation). Two runtimes:

- ``in_process``: the server is a thread of the client's process (it competes with the client's perturbed forwards
  for the cores and the GIL); median over ``--rounds`` rounds after one warm-up round;
- ``torchrun``: 1 server + 1 client worker, the emulated link around the real RPC transport, so the server computes
  in its own process; the mean round time over ``--torchrun-rounds`` rounds after the first (summary.json's
  ``transport``): one job per point, so more rounds than in-process to average the noise of a shared machine.

Two links:

- ``paper``: the App. C.1 5G link as is (30 Mbps up, 200 Mbps down, 30 ms RTT) on our real message sizes. Our
  activations are small (quickstart z = 401 kB), so the window W is ~0.2 s and the fixed RTT of the scalar exchange
  (30 ms, paid once per round whatever P) weighs far more than in the paper (W ≈ 10 s);
- ``scaled`` (the headline): the App. C.1 system (Llama-3.2-1B, c = --paper-c client blocks, Jetson-class client,
  5G link) time-scaled to our client: every link time is multiplied by s = t_fwd(ours) / t_fwd(paper, c), so
  W / t_fwd, RTT / t_fwd and uplink / downlink time are the paper's (at c = 2: W ≈ 10.4 t_fwd, max P = 10). The
  bandwidths are set so that our z (and λ) take s × the paper's uplink (downlink) serialisation time.

P = 0 is the same round without the zeroth-order part (sync, z up, λ down, the round closed; no perturbed forwards,
no scalar exchange, no update), the paper's round_time(P=0). The ratio is round(P) / round(0); with overlap the
perturbed forwards run while z is in flight (HOSFLWorker with zo.overlap=true), so it stays near 1 until P·t_fwd
exceeds the idle window W, which is measured too in-process (submit → λ back, at P = 0). Besides the record, a plot of
round time against P per run: ``<out>/overlap.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import ROOT, Recorder, options, torchrun_cmd
from bench.suite import BENCHMARKS
from hosfl_dist.config import LinkConfig, load_config
from hosfl_dist.measure.latency import LatencyModel
from hosfl_dist.runtime.inprocess import InProcessRunner
from hosfl_dist.transport.wire import payload_bytes

SETUPS = {
    # name: (config file, overrides, P of the target ratio, target, links, P values)
    "quickstart": (
        "configs/repro/quickstart_small_cnn.yaml", [], 5, 1.10, ("scaled", "paper"), (0, 1, 2, 5, 10, 20, 40)
    ),
    "resnet18": (
        "configs/repro/cifar10_iid.yaml",
        ["model.name=resnet18", "split.cut=2", "clients.total=10"],
        5,
        None,
        ("scaled",),
        (0, 2, 5, 10, 20),
    ),
}
PAPER_LINK = LinkConfig()  # App. C.1: 30 Mbps up, 200 Mbps down, 30 ms RTT


def link_overrides(link: LinkConfig) -> list[str]:
    return [
        "comm.inject_delay=true",
        f"comm.uplink_mbps={link.uplink_mbps!r}",
        f"comm.downlink_mbps={link.downlink_mbps!r}",
        f"comm.rtt_ms={link.rtt_ms!r}",
    ]


def scaled_paper_link(t_fwd: float, up_bytes: int, down_bytes: int, c: int) -> tuple[LinkConfig, dict]:
    """The App. C.1 system time-scaled by s = t_fwd / t_fwd_paper(c): same W/t_fwd, RTT/t_fwd, up/down split."""
    paper = LatencyModel()
    s = t_fwd / paper.client_forward_time(c)
    half_rtt = paper.link.rtt_ms / 2e3
    up_s = s * (paper.uplink_time() - half_rtt)  # serialisation time our z (+ labels) must take
    down_s = s * (paper.downlink_time() - half_rtt)
    link = LinkConfig(up_bytes * 8 / up_s / 1e6, down_bytes * 8 / down_s / 1e6, paper.link.rtt_ms * s)
    info = {
        "paper_client_layers": c,
        "time_scale": s,
        "paper_t_fwd_s": paper.client_forward_time(c),
        "paper_window_s": paper.idle_window(c),
        "paper_max_p": paper.max_perturbations(c),
        "paper_ratio_p5_overlap": paper.round_time(5, c, True) / paper.round_time(0, c, True),
        "paper_ratio_p5_no_overlap": paper.round_time(5, c, False) / paper.round_time(0, c, False),
    }
    return link, info


def first_order_round(worker, t: int, window: list[float]) -> int:
    """The HO-SFL round with P = 0, as ``HOSFLWorker.run_round`` runs it without its zeroth-order part: sync
    (prefetched a round ahead), z up, λ down, and the round's report; no perturbed forwards, no scalar exchange, no
    update (so no history is replayed either). ``window`` gets each submit's time to λ."""
    tr = worker.transport
    sampled, mine = worker.plan(t)
    syncs = {m: tr.call_async("sync", t=t, client=m, since=worker.client_round[m]) for m in mine}
    futs = []
    for m in mine:
        syncs[m].wait()
        worker.client_round[m] = t
        x, y = worker.data.next_batch(m)
        worker.bind(worker.replicas[m].params)
        with torch.no_grad():
            act = worker.zo_forward(x)
        futs.append((time.perf_counter(), tr.call_async("submit", t=t, client=m, act=act, labels=y)))
    for sent, fut in futs:
        fut.wait()
        window.append(time.perf_counter() - sent)
    if worker.collective.is_leader:
        tr.post("finish_round", t=t, scalars=torch.zeros(worker.P))
    for m in mine:
        worker.client_round[m] = t + 1
    n = len(sampled) * worker.cfg.clients.batch_size
    worker.processed += n
    if worker.processed < worker.cfg.train.budget_samples:
        for m in worker.plan(t + 1)[1]:
            tr.prefetch("sync", t=t + 1, client=m, since=worker.client_round[m])
    return n


def forward_time(worker, reps: int = 5) -> float:
    x, _ = worker.data.next_batch(0)
    times = []
    with torch.no_grad():
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            worker.client_forward(x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def calibrate(config: str, overrides: list[str], tmp: Path) -> tuple[float, int, int]:
    """Our client's no-grad forward time and the bytes of its submit message (z + labels) and of λ."""
    runner = InProcessRunner(
        load_config(ROOT / config, [*overrides, "job.progress=false", f"job.out_dir={tmp}"])
    ).setup()
    worker = runner.worker
    x, y = worker.data.next_batch(0)
    with torch.no_grad():
        act = worker.client_forward(x)
    return forward_time(worker, reps=20), payload_bytes([act, y]), payload_bytes(act["z"])


def run_overrides(overrides: list[str], link: LinkConfig, P: int, overlap: bool, tmp: Path) -> list[str]:
    return [
        *overrides,
        *link_overrides(link),
        f"zo.num_perturbations={max(P, 1)}",
        f"zo.overlap={str(overlap).lower()}",
        "clients.per_round=1",
        # One always-current replica (the paper's per-client timeline, App. C.1): no round starts with a catch-up
        # replay of missed rounds (Algorithm 3), whose cost would grow with P and is not latency hiding's business.
        "clients.replicas=shared",
        "job.progress=false",
        f"job.out_dir={tmp}",
    ]


def measure(config: str, overrides: list[str], link: LinkConfig, P: int, overlap: bool, rounds: int, tmp: Path) -> dict:
    """In-process: the server on a thread of this process, behind the emulated link."""
    ovr = [*run_overrides(overrides, link, P, overlap, tmp), f"train.budget_samples={10**9}"]
    runner = InProcessRunner(load_config(ROOT / config, ovr)).setup()
    worker = runner.worker
    window: list[float] = []
    times = []
    for t in range(rounds + 1):
        t0 = time.perf_counter()
        if P == 0:
            first_order_round(worker, t, window)
        else:
            worker.run_round(t)
        times.append(time.perf_counter() - t0)
    stats = runner.link.stats
    out = {
        "runtime": "in_process",
        "P": P,
        "overlap": overlap,
        "round_s": statistics.median(times[1:]),
        "round_s_all": [round(x, 4) for x in times[1:]],
        "t_fwd_s": forward_time(worker),
        "uplink_bytes_per_round": stats.uplink_bytes / (rounds + 1),
        "downlink_bytes_per_round": stats.downlink_bytes / (rounds + 1),
    }
    if window:
        out["window_s"] = statistics.median(window[1:])
    runner.link.close()
    return out


FIRST_ORDER_RUN = "--_first-order-run"


def first_order_run(argv: list[str]) -> int:
    """P = 0 under torchrun (``python -m bench.overlap --_first-order-run <run arguments>`` on every rank): the worker
    runs first_order_round instead of HOSFLWorker.run_round. Its replicas stay at θc^0 while the server's history
    holds the closed rounds, so the server's end-of-run audit (it replays the history and compares the workers' θc
    digests) would rightly refuse the run: the stand-in measures round time only, and turns the audit off."""
    from hosfl_dist.algorithms import hosfl
    from hosfl_dist.run import main as run_main

    hosfl.HOSFLWorker.run_round = lambda self, t: first_order_round(self, t, [])
    hosfl.HOSFLServer.audit = lambda self, rounds, client_digests: None
    return run_main(argv)


def measure_torchrun(
    config: str, overrides: list[str], link: LinkConfig, P: int, overlap: bool, rounds: int, tmp: Path
) -> dict:
    """torchrun: 1 server + 1 client worker, the emulated link around the RPC transport (server in its own process)."""
    tmp.mkdir(parents=True, exist_ok=True)
    ovr = run_overrides(overrides, link, P, overlap, tmp / "run")
    cfg = load_config(ROOT / config, ovr)
    budget = rounds * cfg.clients.batch_size
    ovr += [f"train.budget_samples={budget}", f"train.eval_every_samples={budget}", "data.eval_max_samples=100"]
    target = ["-m", "bench.overlap", FIRST_ORDER_RUN] if P == 0 else ["-m", "hosfl_dist.run"]
    cmd = torchrun_cmd(2, [*target, "--config", str(ROOT / config), *ovr])
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"torchrun P={P} overlap={overlap} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    stats = next(iter(summary["transport"]["workers"].values()))
    return {
        "runtime": "torchrun",
        "P": P,
        "overlap": overlap,
        "round_s": (stats["round_s"] - stats["first_round_s"]) / (stats["rounds"] - 1),  # after the warm-up round
        "rounds": stats["rounds"],
        "link": summary.get("link"),
    }


def figures(data: dict) -> tuple[dict, dict]:
    """round(P)/round(0) at each run's target P, overlap on and off, for the declared setup/link/runtime runs."""
    values = {}
    for key, run in data["runs"].items():
        name = key.replace("/", "_")
        for overlap, label in (("overlap", "on"), ("no_overlap", "off")):
            values[f"{name}_{label}"] = run["ratio_at_target_p"][overlap]
    return {k: v for k, v in values.items() if k in BENCHMARKS["overlap"].names}, {}


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if words[:1] == [FIRST_ORDER_RUN]:
        return first_order_run(words[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", nargs="*", default=list(SETUPS), choices=list(SETUPS))
    p.add_argument("--links", nargs="*", choices=["scaled", "paper"], help="default: each setup's own")
    p.add_argument("--runtimes", nargs="*", default=list(RUNTIMES), choices=list(RUNTIMES))
    p.add_argument("--ps", type=int, nargs="*", help="P values (default: each setup's own; 0 is always run)")
    p.add_argument("--paper-c", type=int, default=2, help="client blocks of the App. C.1 setting copied")
    p.add_argument("--rounds", type=int, default=8, help="timed rounds in one process (median)")
    p.add_argument("--torchrun-rounds", type=int, default=30, help="timed rounds under torchrun (mean, one job)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each thread of work (client, server)")
    args = options(p).parse_args(argv)
    rec = Recorder(BENCHMARKS["overlap"], argv, args.via)
    torch.set_num_threads(args.threads)
    report: dict = {
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "rounds": args.rounds,
        "torchrun_rounds": args.torchrun_rounds,
        "runs": {},
    }
    with tempfile.TemporaryDirectory(prefix="overlap_") as tmp:
        for name in args.setups:
            config, overrides, p_target, target, links, ps = SETUPS[name]
            t_fwd, up_bytes, down_bytes = calibrate(config, overrides, Path(tmp) / f"{name}_cal")
            for kind in args.links or links:
                if kind == "scaled":
                    link, info = scaled_paper_link(t_fwd, up_bytes, down_bytes, args.paper_c)
                else:
                    link, info = PAPER_LINK, {}
                for runtime in args.runtimes:
                    rows = []
                    for P in sorted({0, *(args.ps or ps)}):
                        for overlap in (True, False) if P else (False,):
                            where = Path(tmp) / f"{name}{kind}{runtime}{P}{overlap}"
                            rounds = args.rounds if runtime == "in_process" else args.torchrun_rounds
                            r = RUNTIMES[runtime](config, overrides, link, P, overlap, rounds, where)
                            rows.append(r)
                            print(
                                f"{name:10s} {kind:6s} {runtime:10s} P={P:<3d} overlap={'on ' if overlap else 'off'} "
                                f"round {r['round_s'] * 1e3:7.1f} ms"
                                + (f" (window {r['window_s'] * 1e3:.1f} ms)" if "window_s" in r else ""),
                                flush=True,
                            )
                    base = next(r for r in rows if r["P"] == 0)
                    for r in rows:
                        r["ratio_to_p0"] = r["round_s"] / base["round_s"]
                    at = {r["overlap"]: r["ratio_to_p0"] for r in rows if r["P"] == p_target}
                    window = base.get("window_s")
                    report["runs"][f"{name}/{kind}/{runtime}"] = {
                        "config": config,
                        "overrides": overrides,
                        "runtime": runtime,
                        "link": {
                            "uplink_mbps": link.uplink_mbps,
                            "downlink_mbps": link.downlink_mbps,
                            "rtt_ms": link.rtt_ms,
                            **info,
                        },
                        "calibration": {"t_fwd_s": t_fwd, "uplink_bytes": up_bytes, "downlink_bytes": down_bytes},
                        "window_s": window,
                        "t_fwd_s": t_fwd,
                        "max_p_hidden_estimate": int(window // t_fwd) if window else None,
                        "target_p": p_target,
                        "target": target if kind == "scaled" else None,
                        "ratio_at_target_p": {"overlap": at.get(True), "no_overlap": at.get(False)},
                        "rows": rows,
                    }
    plot = Path(args.out) / "overlap.png"
    plot.parent.mkdir(parents=True, exist_ok=True)
    _plot(report, plot)
    rec.write(args.out, report, *figures(report))
    print(f"-> {plot}")
    return 0


RUNTIMES = {"in_process": measure, "torchrun": measure_torchrun}


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, (name, s) in zip(axes[0], runs.items()):
        for overlap, style, label in ((True, "o-", "overlap on (HO-SFL)"), (False, "s-", "overlap off")):
            rows = [r for r in s["rows"] if r["overlap"] == overlap or r["P"] == 0]
            ax.plot([r["P"] for r in rows], [r["round_s"] * 1e3 for r in rows], style, label=label, markersize=4)
        if s["window_s"]:
            ax.axvline(s["window_s"] / s["t_fwd_s"], color="grey", ls=":", label="W / t_fwd (measured)")
            title = f"{name}: W = {s['window_s'] * 1e3:.0f} ms, t_fwd = {s['t_fwd_s'] * 1e3:.1f} ms"
        else:
            title = f"{name}: t_fwd = {s['t_fwd_s'] * 1e3:.1f} ms"
        ax.set(xlabel="perturbations P", ylabel="measured round time (ms)", title=title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
