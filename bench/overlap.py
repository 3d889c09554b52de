"""Measured latency hiding (paper §3.4, App. C.1): real HO-SFL round time vs P, overlap on and off, under the link.

    python bench/overlap.py [--setups quickstart resnet18] [--links scaled paper] [--ps 1 2 5 10 20 40]

Each setting runs the in-process engine with ``comm.inject_delay=true``: every client<->server message pays
``bytes·8 / bandwidth + RTT/2`` (hosfl_dist.measure.link), asynchronously, with the server computing on its own
thread. One sampled client per round (K = 1: the paper's per-client timeline), timed around ``worker.run_round``
(no evaluation), median over ``--rounds`` rounds after one warm-up round. Two links:

- ``paper``: the App. C.1 5G link as is (30 Mbps up, 200 Mbps down, 30 ms RTT) on our real message sizes. Our
  activations are small (quickstart z = 401 kB), so the window W is ~0.2 s and the fixed RTT of the scalar exchange
  (30 ms, paid once per round whatever P) weighs far more than in the paper (W ≈ 10 s);
- ``scaled`` (the headline): the App. C.1 system (Llama-3.2-1B, c = --paper-c client blocks, Jetson-class client,
  5G link) time-scaled to our client: every link time is multiplied by s = t_fwd(ours) / t_fwd(paper, c), so
  W / t_fwd, RTT / t_fwd and uplink / downlink time are the paper's (at c = 2: W ≈ 10.4 t_fwd, max P = 10). The
  bandwidths are set so that our z (and λ) take s × the paper's uplink (downlink) serialisation time.

P = 0 is the same round without the zeroth-order part (plan, sync, z up, λ down; no perturbed forwards, no scalar
exchange, no update), the paper's round_time(P=0). The ratio is round(P) / round(0); with overlap the perturbed
forwards run while z is in flight (HOSFLWorker with zo.overlap=true), so it stays near 1 until P·t_fwd exceeds the
idle window W, which is measured too (submit → λ back, at P = 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hosfl_dist.comm import payload_bytes  # noqa: E402
from hosfl_dist.config import load_config  # noqa: E402
from hosfl_dist.engine import InProcessEngine  # noqa: E402
from hosfl_dist.measure.latency import LatencyModel  # noqa: E402
from hosfl_dist.measure.link import Link  # noqa: E402

SETUPS = {
    # name: (config file, overrides, P of the target ratio, target, links, P values)
    "quickstart": ("configs/quickstart.yaml", [], 5, 1.10, ("scaled", "paper"), (0, 1, 2, 5, 10, 20, 40)),
    "resnet18": (
        "configs/repro/cifar10_iid.yaml",
        ["model.name=resnet18", "split.cut=2", "clients.total=10"],
        5,
        None,
        ("scaled",),
        (0, 2, 5, 10, 20),
    ),
}
PAPER_LINK = Link()  # App. C.1: 30 Mbps up, 200 Mbps down, 30 ms RTT


def link_overrides(link: Link) -> list[str]:
    return [
        "comm.inject_delay=true",
        f"comm.uplink_mbps={link.uplink_mbps!r}",
        f"comm.downlink_mbps={link.downlink_mbps!r}",
        f"comm.rtt_ms={link.rtt_ms!r}",
    ]


def scaled_paper_link(t_fwd: float, up_bytes: int, down_bytes: int, c: int) -> tuple[Link, dict]:
    """The App. C.1 system time-scaled by s = t_fwd / t_fwd_paper(c): same W/t_fwd, RTT/t_fwd, up/down split."""
    paper = LatencyModel()
    s = t_fwd / paper.client_forward_time(c)
    half_rtt = paper.link.rtt_ms / 2e3
    up_s = s * (paper.uplink_time() - half_rtt)  # serialisation time our z (+ labels) must take
    down_s = s * (paper.downlink_time() - half_rtt)
    link = Link(up_bytes * 8 / up_s / 1e6, down_bytes * 8 / down_s / 1e6, paper.link.rtt_ms * s)
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
    """The HO-SFL round with P = 0: the same messages up to λ, and nothing zeroth-order after it."""
    tr = worker.transport
    sampled = tr.call("plan", t=t)["sampled"]
    mine = [m for m in sampled.tolist() if m in worker.hosted]
    futs = []
    for m in mine:
        tr.call("sync", t=t, client=m, since=t)  # nothing to replay: no round updates θc at P = 0
        worker.client_round[m] = t
        x, y = worker.data.next_batch(m)
        worker.bind(worker.replicas[m].params)
        with torch.no_grad():
            act = worker.client_forward(x)
        futs.append((time.perf_counter(), tr.call_async("submit", t=t, client=m, act=act, labels=y)))
    for sent, fut in futs:
        fut.wait()
        window.append(time.perf_counter() - sent)
    return len(sampled) * worker.cfg.clients.batch_size


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
    engine = InProcessEngine(load_config(ROOT / config, [*overrides, "job.progress=false", f"job.out_dir={tmp}"]))
    worker = engine.worker
    x, y = worker.data.next_batch(0)
    with torch.no_grad():
        act = worker.client_forward(x)
    return forward_time(worker, reps=20), payload_bytes([act, y]), payload_bytes(act["z"])


def measure(config: str, overrides: list[str], link: Link, P: int, overlap: bool, rounds: int, tmp: Path) -> dict:
    ovr = [
        *overrides,
        *link_overrides(link),
        f"zo.num_perturbations={max(P, 1)}",
        f"zo.overlap={str(overlap).lower()}",
        "clients.per_round=1",
        "job.progress=false",
        f"job.out_dir={tmp}",
    ]
    engine = InProcessEngine(load_config(ROOT / config, ovr))
    worker = engine.worker
    window: list[float] = []
    times = []
    for t in range(rounds + 1):
        t0 = time.perf_counter()
        if P == 0:
            first_order_round(worker, t, window)
        else:
            worker.run_round(t)
        times.append(time.perf_counter() - t0)
    stats = worker.transport.stats
    out = {
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
    worker.transport.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", nargs="*", default=list(SETUPS), choices=list(SETUPS))
    p.add_argument("--links", nargs="*", choices=["scaled", "paper"], help="default: each setup's own")
    p.add_argument("--ps", type=int, nargs="*", help="P values (default: each setup's own; 0 is always run)")
    p.add_argument("--paper-c", type=int, default=2, help="client blocks of the App. C.1 setting copied")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each thread of work (client, server)")
    p.add_argument("--out", default="bench/results/overlap.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import tempfile

    report: dict = {"threads": args.threads, "cpu_count": os.cpu_count(), "rounds": args.rounds, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="overlap_") as tmp:
        for name in args.setups:
            config, overrides, p_target, target, links, ps = SETUPS[name]
            t_fwd, up_bytes, down_bytes = calibrate(config, overrides, Path(tmp) / f"{name}_cal")
            for kind in args.links or links:
                if kind == "scaled":
                    link, info = scaled_paper_link(t_fwd, up_bytes, down_bytes, args.paper_c)
                else:
                    link, info = PAPER_LINK, {}
                rows = []
                for P in sorted({0, *(args.ps or ps)}):
                    for overlap in (True, False) if P else (False,):
                        r = measure(config, overrides, link, P, overlap, args.rounds, Path(tmp) / f"{name}{P}{overlap}")
                        rows.append(r)
                        print(
                            f"{name:10s} {kind:6s} P={P:<3d} overlap={'on ' if overlap else 'off'} "
                            f"round {r['round_s'] * 1e3:7.1f} ms (t_fwd {r['t_fwd_s'] * 1e3:.1f} ms"
                            + (f", window {r['window_s'] * 1e3:.1f} ms)" if "window_s" in r else ")"),
                            flush=True,
                        )
                base = next(r for r in rows if r["P"] == 0)
                for r in rows:
                    r["ratio_to_p0"] = r["round_s"] / base["round_s"]
                at = {r["overlap"]: r["ratio_to_p0"] for r in rows if r["P"] == p_target}
                report["runs"][f"{name}/{kind}"] = {
                    "config": config,
                    "overrides": overrides,
                    "link": {**dataclasses.asdict(link), **info},
                    "calibration": {"t_fwd_s": t_fwd, "uplink_bytes": up_bytes, "downlink_bytes": down_bytes},
                    "window_s": base["window_s"],
                    "t_fwd_s": base["t_fwd_s"],
                    "max_p_hidden_estimate": int(base["window_s"] // base["t_fwd_s"]),
                    "target_p": p_target,
                    "target": target if kind == "scaled" else None,
                    "ratio_at_target_p": {"overlap": at.get(True), "no_overlap": at.get(False)},
                    "rows": rows,
                }
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out.with_suffix(".png"))
    print(f"-> {out} and {out.with_suffix('.png')}")
    return 0


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
        ax.axvline(s["window_s"] / s["t_fwd_s"], color="grey", ls=":", label="W / t_fwd (measured)")
        title = f"{name} link: W = {s['window_s'] * 1e3:.0f} ms, t_fwd = {s['t_fwd_s'] * 1e3:.1f} ms"
        ax.set(xlabel="perturbations P", ylabel="measured round time (ms)", title=title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
