"""The benchmark suite in one command: each measured figure next to the target or limit an issue set for it.

    python bench/run_all.py                     # every bench, into bench/out/ (untracked)
    python bench/run_all.py --only zo_step overlap
    python bench/run_all.py --skip dist         # reuse bench/out/dist_bench.json if present
    python bench/run_all.py --dry-run           # the output folder and each bench's command; runs nothing
    python bench/run_all.py --update-results    # write bench/results/, the committed reference results

Where it writes: each bench runs as its own process (its own thread settings) and writes its JSON into one output
folder, bench/out/ by default (ignored by git, overwritten by the next run) or --out DIR. bench/results/ holds the
reference results that git tracks and the READMEs quote; it is written only with --update-results. bench.json and
bench.md in the same folder then collect every row with the command that reruns its bench alone. A bench left out by
--only or --skip is reused from the JSON already in that folder, where there is one.

How long: the last full run took 825 s (~14 min) on the shared 2-core machine under load from other jobs, and the
time moves with that load. Each bench's elapsed time is printed as it ends, the total at the end.

The rows:

- ZO client step time / ((P+1) × no-grad client forward), target ≤ 1.15 (floor: 1 + noise regeneration);
- client peak memory of HO-SFL, SFL, ZO-SFL and full local training over inference (target for HO-SFL ≤ 1.05,
  the paper's 1.03 beside each);
- aggregation bytes per client per round for HO-SFL and SFL as d_c grows 2×, 4×, 8× (limits: 4·P flat, 4·d_c);
- the torchrun runtime's samples/s against the in-process runtime, and its transport time per round against the
  floor measured beside it (one loopback RPC round trip + one all_reduce of K×P), RPCs and blocking waits per round
  (bench/dist_bench.py);
- round time with P = 5 over P = 0 under the paper's link model with latency hiding, target ≤ 1.10, in one process
  and under torchrun (the server in its own process).

What "met" and "missed" mean: where an issue set a target or a limit, the row compares the number measured in this
run, on this machine at the load average recorded with it, against that target: "met" when it is within (≤ the
target for a ratio, equal to the limit for a byte count), "missed" when not. It is that comparison and no more, not
a pass/fail of the product: timings on shared cores move with load, and a rerun can land on the other side of a
target. Rows without a target carry no mark.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = Path("bench/results")  # the committed reference results: written with --update-results only
DEFAULT_OUT = Path("bench/out")  # ignored by git

# name: (script and its options, the JSON it writes into the output folder)
BENCHES: dict[str, tuple[list[str], str]] = {
    "zo_step": (["bench/zo_step.py"], "zo_step.json"),
    "zo_step_tuned": (["bench/zo_step.py", "--tune-malloc"], "zo_step_tuned.json"),
    "memory": (["bench/memory_ratio.py"], "memory_ratio.json"),
    "agg_traffic": (["bench/agg_traffic.py"], "agg_traffic.json"),
    "dist": (["bench/dist_bench.py", "--workers", "1", "2"], "dist_bench.json"),
    "overlap": (["bench/overlap.py"], "overlap.json"),
}

MEANING = (
    '"met" / "missed": the number measured in this run, on this machine at the load average above, compared with the '
    "target or limit an issue set for it (≤ a ratio's target, = a byte count's limit); a comparison, not a pass/fail "
    "of the product: on shared cores timings move with load, and a rerun can land on the other side of a target."
)


def output_dir(out: str | Path | None = None, update_results: bool = False) -> Path:
    """The folder a run writes every JSON, bench.json and bench.md to: bench/results (the committed reference) with
    ``update_results`` and only then, else ``out`` (relative to the current directory), else bench/out. Relative to the
    repository root where it lies inside it; ValueError for ``out`` naming bench/results or given with
    ``update_results``."""
    if update_results:
        if out is not None:
            raise ValueError("--out and --update-results name two folders: give one of them")
        return REFERENCE
    path = ROOT / DEFAULT_OUT if out is None else Path(out).resolve()
    if path == ROOT / REFERENCE:
        raise ValueError(f"{REFERENCE} holds the committed reference results: write there with --update-results")
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def bench_argv(name: str, out: Path) -> list[str]:
    """The bench's script and options, its JSON going into ``out``."""
    script, json_name = BENCHES[name]
    return [*script, "--out", str(out / json_name)]


def command(name: str, out: Path) -> str:
    return "python " + shlex.join(bench_argv(name, out))


def run(name: str, out: Path, timeout: float) -> dict:
    t0 = time.perf_counter()
    print(f"== {name}: {command(name, out)}", flush=True)
    try:
        res = subprocess.run(
            [sys.executable, *bench_argv(name, out)], cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "why": f"timed out after {timeout:.0f} s", "seconds": timeout}
    took = time.perf_counter() - t0
    sys.stdout.write(res.stdout)
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"ok": False, "why": f"exit {res.returncode}: {tail}", "seconds": took}
    return {"ok": True, "seconds": took}


def load(name: str, out: Path) -> dict | None:
    path = ROOT / out / BENCHES[name][1]
    return json.loads(path.read_text()) if path.is_file() else None


def verdict(value: float | None, target: float | None, below: bool = True) -> str:
    """Compare ``value`` with the ``target`` an issue set for it: met, missed (see MEANING), or "" without one."""
    if value is None or target is None:
        return ""
    return "met" if (value <= target if below else value >= target) else "missed"


def rows_zo_step(data: dict) -> list[dict]:
    out = []
    alloc = "glibc malloc keeping freed memory" if data.get("tune_malloc") else "default glibc malloc"
    for c in data["clients"]:
        out.append(
            {
                "metric": f"ZO step / ((P+1) fwd): {c['client']}, {alloc}",
                "value": round(c["ratio"], 3),
                "limit": f"floor 1 + noise = {c['floor_with_noise']:.3f}"
                + (f"; target ≤ {c['target']}" if c["target"] else ""),
                "verdict": verdict(c["ratio"], c["target"]),
                "detail": f"fwd {c['median_s']['forward'] * 1e3:.2f} ms, step {c['median_s']['step'] * 1e3:.2f} ms, "
                f"ratio of minima {c['ratio_of_minima']:.3f}, d_c {c['d_c']}",
            }
        )
    return out


def rows_memory(data: dict) -> list[dict]:
    out = []
    paper = data["paper_ratios"]
    names = {
        "hosfl": "HO-SFL (overlap off)",
        "hosfl_overlap": "HO-SFL (overlap on)",
        "sfl": "SFL",
        "zo_sfl": "ZO-SFL",
        "full_local": "full local",
    }
    for r in data["rows"]:
        s = r["spec"]
        z_share = r["activation_bytes"] / r["peak_bytes"]["inference"]
        for mode, label in names.items():
            value = r["ratio_to_inference"][mode]
            target = 1.05 if mode == "hosfl" else None  # overlap on trades P·|z| of memory for latency
            ref = paper.get(mode.removesuffix("_overlap"))
            floors = r.get("data_flow_floors", {})
            floor = ""
            if mode == "hosfl_overlap":
                floor = f"data-flow floor 1 + P·|z|/inf = {floors['hosfl_overlap']:.3f}; "
            elif mode == "hosfl":
                floor = (
                    f"data-flow floor 1 + |λ|/inf (λ beside one forward; λᵀz taken once, each z̃ projected at once): "
                    f"{floors['hosfl']:.3f}; "
                )
            out.append(
                {
                    "metric": f"client peak / inference, {label}: {r['model']} cut {s['cut']} B{s['batch']} "
                    f"T{s['seq']} P{s['P']}",
                    "value": round(value, 3),
                    "limit": (f"target ≤ {target}; " if target else "") + floor + (f"paper {ref:.2f}" if ref else ""),
                    "verdict": verdict(value, target),
                    "detail": f"inference peak {r['peak_bytes']['inference'] / 2**20:.1f} MiB, |z| = "
                    f"{z_share:.1%} of it",
                }
            )
    for model, why in data.get("skipped", {}).items():
        out.append({"metric": f"client peak / inference: {model}", "value": None, "limit": "", "verdict": "",
                    "detail": f"not available: {why}"})  # fmt: skip
    return out


def rows_agg(data: dict) -> list[dict]:
    out = []
    P = data["P"]
    for r in data["rows"]:
        limit = 4 * P if r["algorithm"] == "hosfl" else 4 * r["d_c"]
        what = "4·P (flat)" if r["algorithm"] == "hosfl" else "4·d_c (linear)"
        out.append(
            {
                "metric": f"aggregation uplink B/client/round, {r['algorithm']}, d_c ×{r['d_c_factor']:.0f} "
                f"({r['d_c']})",
                "value": r["uplink_aggregation_bytes"],
                "limit": f"{what} = {limit}",
                "verdict": "met" if r["uplink_aggregation_bytes"] == limit else "missed",
                "detail": f"downlink {r['downlink_aggregation_bytes']:.0f} B",
            }
        )
    return out


def rows_dist(data: dict | None, why: str) -> list[dict]:
    if not data:
        return [{"metric": "distributed transport share / samples/s vs in-process", "value": None, "limit": "",
                 "verdict": "", "detail": f"not available: {why}"}]  # fmt: skip
    runs = data["runs"]
    base = runs[0]
    out = []
    for r in runs:
        row = {
            "metric": f"samples/s vs {base['engine']}: {r['engine']}",
            "value": round(r["samples_per_s"] / base["samples_per_s"], 3),
            "limit": "",
            "verdict": "",
            "detail": f"{r['samples_per_s']:.0f} samples/s",
        }
        if "transport_share" in r:
            row["detail"] += (
                f"; transport share {r['transport_share']:.1%} (rpc {r['rpc_wait_share']:.1%}, all_reduce "
                f"{r['allreduce_share']:.1%}), server compute {r['server_compute_share']:.1%}"
            )
        out.append(row)
        if "transport_ms_per_round" in r:
            blocked = r.get("blocked_waits_per_round")
            out.append(
                {
                    "metric": f"transport ms per worker-round / floor: {r['engine']}",
                    "value": round(r["transport_over_floor"], 1),
                    "limit": f"floor {r['floor_ms_per_round']:.2f} ms (1 RPC round trip + 1 all_reduce of K×P)",
                    "verdict": "",
                    "detail": f"{r['transport_ms_per_round']:.1f} ms; RPCs per worker-round "
                    f"{r['rpc_calls_per_round']:.2f}, blocking waits "
                    + ("n/a" if blocked is None else f"{blocked:.2f}")
                    + f" for {r['sampled_clients_per_worker_round']:.1f} sampled clients",
                }
            )
    return out


def rows_overlap(data: dict) -> list[dict]:
    out = []
    for name, s in data["runs"].items():
        link = s["link"]
        for key, label in (("overlap", "on"), ("no_overlap", "off")):
            value = s["ratio_at_target_p"][key]
            target = s["target"] if key == "overlap" else None
            paper = link.get("paper_ratio_p5_" + key)
            out.append(
                {
                    "metric": f"round(P={s['target_p']}) / round(P=0), overlap {label}: {name} link",
                    "value": None if value is None else round(value, 3),
                    "limit": (f"target ≤ {target}; " if target else "")
                    + (f"App. C.1 model {paper:.3f}" if paper else ""),
                    "verdict": verdict(value, target),
                    "detail": (f"W = {s['window_s'] * 1e3:.0f} ms, " if s["window_s"] else "")
                    + f"t_fwd = {s['t_fwd_s'] * 1e3:.1f} ms, RTT {link['rtt_ms']:.2f} ms, up {link['uplink_mbps']:.2f}"
                    f" / down {link['downlink_mbps']:.2f} Mbps",
                }
            )
    return out


def markdown(report: dict) -> str:
    out = report["out"]
    reused = [k for k, v in report["benches"].items() if v.get("reused")]
    lines = [
        "# Benchmark suite",
        "",
        f"`{report['command']}` on {report['machine']} ({report['cpu_count']} cores), load average before / "
        f"after {report['load_before']} / {report['load_after']}, {report['seconds']:.0f} s.",
        "",
        MEANING,
        "",
        *(
            [f"Results of {', '.join(reused)} are reused from an earlier run (their JSON under {out}).", ""]
            if reused
            else []
        ),
        "| metric | measured | target / limit | vs target | detail | command |",
        "|---|---:|---|---|---|---|",
    ]
    for r in report["rows"]:
        value = "–" if r["value"] is None else r["value"]
        lines.append(f"| {r['metric']} | {value} | {r['limit']} | {r['verdict']} | {r['detail']} | `{r['command']}` |")
    failed = {k: v["why"] for k, v in report["benches"].items() if not v.get("ok")}
    if failed:
        lines += ["", "Benches without a result:", ""] + [f"- {k}: {v}" for k, v in failed.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", choices=list(BENCHES), help="run only these benches")
    p.add_argument("--skip", nargs="*", default=[], choices=list(BENCHES), help="do not run these (reuse JSON)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per bench")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", help=f"output folder [{DEFAULT_OUT}]; {REFERENCE} only through --update-results")
    where.add_argument(
        "--update-results",
        action="store_true",
        help=f"write into {REFERENCE}, the committed reference results (then review and commit the diff)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the output folder and each bench's command, run nothing"
    )
    args = p.parse_args(argv)
    try:
        out = output_dir(args.out, args.update_results)
    except ValueError as e:
        p.error(str(e))
    chosen = [name for name in BENCHES if not (args.only and name not in args.only) and name not in args.skip]
    print(f"output folder: {out}" + (" (the committed reference results)" if out == REFERENCE else ""), flush=True)
    if args.dry_run:
        for name in BENCHES:
            if name in chosen:
                print(f"run    {name}: {command(name, out)}")
            else:
                found = "present" if (ROOT / out / BENCHES[name][1]).is_file() else "missing: no row"
                print(f"reuse  {name}: {out / BENCHES[name][1]} ({found})")
        return 0
    (ROOT / out).mkdir(parents=True, exist_ok=True)
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    status = {}
    for name in BENCHES:
        if name not in chosen:
            data = load(name, out)
            status[name] = {"ok": data is not None, "reused": data is not None}
            if data is None:
                status[name]["why"] = f"not run, and no earlier result in {out}"
            continue
        status[name] = run(name, out, args.timeout)
        total = time.perf_counter() - t0
        result = "done" if status[name]["ok"] else f"FAILED ({status[name]['why']})"
        print(f"== {name}: {result} in {status[name]['seconds']:.0f} s (total so far {total:.0f} s)", flush=True)
    rows: list[dict] = []
    builders = {
        "zo_step": rows_zo_step,
        "zo_step_tuned": rows_zo_step,
        "memory": rows_memory,
        "agg_traffic": rows_agg,
        "overlap": rows_overlap,
    }
    for name in BENCHES:
        data = load(name, out) if status[name].get("ok") else None
        if name == "dist":
            new = rows_dist(data, status[name].get("why", ""))
        else:
            new = builders[name](data) if data is not None else []
        rows += [{**r, "command": command(name, out)} for r in new]
    seconds = time.perf_counter() - t0
    report = {
        "command": shlex.join(["python", "bench/run_all.py", *(sys.argv[1:] if argv is None else argv)]),
        "out": str(out),
        "machine": os.uname().machine + " " + os.uname().sysname,
        "cpu_count": os.cpu_count(),
        "load_before": load_before,
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "seconds": seconds,
        "benches": status,
        "rows": rows,
    }
    (ROOT / out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (ROOT / out / "bench.md").write_text(markdown(report))
    print(markdown(report))
    print(f"total: {seconds:.0f} s ({seconds / 60:.1f} min) -> {out / 'bench.json'} and {out / 'bench.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
