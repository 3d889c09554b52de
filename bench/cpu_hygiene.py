"""What the torchrun processes cost the machine beyond their work: server memory over many rounds, idle CPU of the
client workers, and the round time, polled from outside (/proc) while a tiny-Qwen3 HO-SFL run trains.

    python -m bench.cpu_hygiene                           # this tree: the suite's figures, bench/out/cpu_hygiene.json
    python -m bench.cpu_hygiene --before /tmp/old         # this tree against a checkout of an earlier version
    python -m bench.cpu_hygiene --before /tmp/old --this-env MALLOC_ARENA_MAX=64 --before-env MALLOC_ARENA_MAX=2

``--before``: e.g. ``git worktree add /tmp/old <commit>``; ``--this-env`` / ``--before-env`` add a run of that tree
with extra environment variables (e.g. glibc's arena limit lifted here, or set by hand there, to tell the server
thread from the arena limit). Each run is 1 server + ``--workers`` client workers for ``--rounds`` rounds, evaluated
only at the start and the end on a few samples; with ``--repeat`` the settings take turns and the run of median wall
time per round is kept (the others' wall times are listed). Every ``--poll`` seconds
the bench reads VmRSS (/proc/<pid>/status) and utime+stime (/proc/<pid>/stat) of every rank; the training window
runs from the first metrics row (after the evaluation at round 0) to the last one (after the final evaluation).

Reported per run: the server's RSS when training starts, its peak and its value at the end (and a series over the
training window, the round estimated as elapsed / window · rounds); per rank the CPU seconds per round and the share
of a core it used over the window; the wall time per round (window / rounds) and the slowest worker's run_round
time per round (summary.json); the digests, to show that the runs computed the same thing. The figures are this
tree's run (the first setting); the table of every setting is printed and kept in the record's data.
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

from bench.common import ROOT, Recorder, commit, options, proc_sample, ranks, torchrun_cmd
from bench.suite import BENCHMARKS

SENTENCES = [
    ("a gorgeous, witty, seductive movie that never loses its nerve.", 1),
    ("the plot is a mess and the acting is worse than the script.", 0),
    ("one of the best films of the year, and the funniest.", 1),
    ("dull, lifeless and far too long for what it has to say.", 0),
    ("a warm and funny delight from the first scene to the last.", 1),
    ("i wanted my money back before the opening credits ended.", 0),
]


def overrides(args: argparse.Namespace, data: Path, out_dir: Path) -> list[str]:
    """HO-SFL on a random tiny Qwen3 cut after block 1 (the server holds the rest), the sentences as SST-2."""
    budget = args.rounds * args.K * args.batch
    return [
        "model.name=hf",
        "model.source=tiny:qwen3",
        "split.cut=1",
        "data.name=sst2",
        f"data.train_path={data}",
        f"data.eval_path={data}",
        "data.columns={sentence: review, label: y}",
        f"data.max_length={args.max_length}",
        "data.eval_max_samples=8",
        "lora.r=2",
        f"clients.total={2 * args.K}",
        f"clients.per_round={args.K}",
        f"clients.batch_size={args.batch}",
        "zo.num_perturbations=2",
        f"train.budget_samples={budget}",
        f"train.eval_every_samples={budget}",  # evaluate at 0 and at the end only
        "train.eval_batch_size=8",
        "job.progress=false",
        f"job.out_dir={out_dir}",
        *args.overrides,
    ]


def rows_written(out: Path) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def run(args: argparse.Namespace, label: str, tree: Path, env_extra: dict[str, str], tmp: Path) -> dict:
    out = tmp / label.replace(" ", "_").replace("/", "_")
    data = tmp / "sst2.jsonl"
    env = {**os.environ, "PYTHONPATH": str(tree), **env_extra}
    cmd = torchrun_cmd(args.workers + 1, ["-m", "hosfl_dist.run", *overrides(args, data, out)])
    log = (tmp / f"{out.name}.log").open("w")
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    samples: list[tuple[float, int, dict[int, tuple[float, int]]]] = []  # (time, metrics rows, rank -> sample)
    pids: dict[int, int] = {}
    start = time.monotonic()
    while proc.poll() is None:
        if len(pids) < args.workers + 1:
            pids = ranks(proc.pid)
        now = {r: s for r, pid in pids.items() if (s := proc_sample(pid)) is not None}
        samples.append((time.monotonic() - start, rows_written(out), now))
        if time.monotonic() - start > args.timeout:
            proc.kill()
            raise RuntimeError(f"{label}: no end after {args.timeout} s (log {log.name})")
        time.sleep(args.poll)
    log.close()
    if proc.returncode != 0:
        raise RuntimeError(f"{label} failed:\n{Path(log.name).read_text()[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rounds = summary["rounds"]
    # the training window: from the first sample with the first row to the last sample before the last row
    first = next(i for i, s in enumerate(samples) if s[1] >= 1)
    last = max(i for i, s in enumerate(samples) if s[1] < 2 and set(s[2]) == set(pids))
    t0, t1 = samples[first][0], samples[last][0]
    window = t1 - t0
    per_rank = {}
    for r in sorted(pids):
        c0, c1 = samples[first][2][r][0], samples[last][2][r][0]
        per_rank[r] = {"cpu_s_per_round": (c1 - c0) / rounds, "core_share": (c1 - c0) / window}
    rss = [(t - t0, s[0][1]) for t, _, s in samples[first : last + 1] if 0 in s]
    series = [
        {"round": round(rounds * dt / window, 1), "rss_gib": r / 2**30}
        for dt, r in rss[:: max(1, len(rss) // args.points)]
    ]
    workers = summary["transport"]["workers"]
    return {
        "label": label,
        "tree": str(tree),
        "commit": commit(tree),
        "env": env_extra,
        "rounds": rounds,
        "wall_s_per_round": window / rounds,
        "run_round_s_per_round": max(w["round_s"] for w in workers.values()) / rounds,
        "server_rss_gib": {
            "train_start": rss[0][1] / 2**30,
            "peak": max(r for _, r in rss) / 2**30,
            "end": rss[-1][1] / 2**30,
        },
        "server_rss_series": series,
        "ranks": per_rank,
        "server_threads": summary["transport"]["server"].get("threads"),
        "server_digest": summary["server_digest"],
        "client_digests": sorted(set(summary["client_digests"].values())),
    }


def table(runs: list[dict]) -> str:
    head = (
        "| run | server RSS start / peak / end (GiB) | server CPU s/round | client workers' CPU s/round (share of a "
        f"core) | wall s/round (all runs) | run_round s/round |\n|{'---|' * 6}"
    )
    lines = [head]
    for r in runs:
        rss = r["server_rss_gib"]
        ws = [r["ranks"][w] for w in sorted(r["ranks"]) if w != 0]
        worker = ", ".join(f"{w['cpu_s_per_round']:.3f} ({w['core_share']:.0%})" for w in ws)
        walls = ", ".join(f"{w:.3f}" for w in r["wall_s_per_round_all"])
        lines.append(
            f"| {r['label']} | {rss['train_start']:.2f} / {rss['peak']:.2f} / {rss['end']:.2f} "
            f"| {r['ranks'][0]['cpu_s_per_round']:.3f} | {worker} | {r['wall_s_per_round']:.3f} ({walls}) "
            f"| {r['run_round_s_per_round']:.3f} |"
        )
    return "\n".join(lines)


def env_vars(pairs: list[str]) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in pairs)


def figures(data: dict) -> tuple[dict, dict]:
    """This tree's run: server RSS, a worker's CPU per round, wall time per round, the server's threads."""
    r = data["runs"][0]
    workers = [v for k, v in r["ranks"].items() if int(k) != 0]
    rss = r["server_rss_gib"]
    values = {
        "server_rss_start_gib": rss["train_start"],
        "server_rss_peak_gib": rss["peak"],
        "server_rss_end_gib": rss["end"],
        "worker_cpu_s_per_round": sum(w["cpu_s_per_round"] for w in workers) / len(workers),
        "wall_s_per_round": r["wall_s_per_round"],
        "server_threads": r["server_threads"],
    }
    return values, {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--workers", type=int, default=2, help="client workers (plus one server process)")
    p.add_argument("--K", type=int, default=2, help="clients per round (of 2K)")
    p.add_argument("--batch", type=int, default=16, help="clients.batch_size")
    p.add_argument("--max-length", type=int, default=64, help="data.max_length (tokens per sample)")
    p.add_argument("--before", type=Path, help="a checkout of an earlier version, run the same way")
    p.add_argument("--before-env", nargs="*", default=[], help="KEY=VALUE: one more run of --before with these")
    p.add_argument("--this-env", nargs="*", default=[], help="KEY=VALUE: one more run of this tree with these")
    p.add_argument("--repeat", type=int, default=1, help="runs per setting (median wall time per round kept)")
    p.add_argument("--poll", type=float, default=0.1, help="seconds between /proc samples")
    p.add_argument("--points", type=int, default=25, help="points of the RSS series kept")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("overrides", nargs="*", help="extra dotted overrides for every run (after --)")
    args = options(p).parse_args(argv)
    rec = Recorder(BENCHMARKS["cpu_hygiene"], argv, args.via)
    settings = [("this tree", ROOT, {})]
    if args.this_env:
        settings.append((f"this tree + {' '.join(args.this_env)}", ROOT, env_vars(args.this_env)))
    if args.before is not None:
        before = args.before.resolve()
        settings.append((f"before ({args.before})", before, {}))
        if args.before_env:
            label = f"before ({args.before}) + {' '.join(args.before_env)}"
            settings.append((label, before, env_vars(args.before_env)))
    measured: dict[str, list[dict]] = {label: [] for label, _, _ in settings}
    with tempfile.TemporaryDirectory(prefix="cpu_hygiene_") as tmp:
        rows = [{"review": s, "y": y} for _ in range(64) for s, y in SENTENCES]
        (Path(tmp) / "sst2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        for i in range(args.repeat):  # the settings take turns, so that a busy spell of the machine hits them alike
            for label, tree, env in settings:
                measured[label].append(run(args, f"{label} #{i}", tree, env, Path(tmp)))
                print(f"measured: {label} #{i}", file=sys.stderr, flush=True)
    runs = []
    for label, got in measured.items():
        got.sort(key=lambda r: r["wall_s_per_round"])
        walls = [r["wall_s_per_round"] for r in got]
        runs.append({**got[len(got) // 2], "label": label, "wall_s_per_round_all": walls})
    same = len({r["server_digest"] for r in runs}) == 1 and len({tuple(r["client_digests"]) for r in runs}) == 1
    text = "\n".join(
        [
            f"`{rec.command}`",
            "",
            f"tiny Qwen3 HO-SFL, 1 server + {args.workers} client workers, {args.rounds} rounds of K={args.K} "
            f"(batch {args.batch}, {args.max_length} tokens), {os.cpu_count()} CPU cores, load average at the end "
            f"{os.getloadavg()[0]:.2f}",
            "",
            table(runs),
            "",
            "client workers: CPU seconds per round of each (rank 1, 2, …) over the training window, and the share of "
            "one core that is; a worker waits for the server most of a round, so this is mostly what waiting costs. "
            "wall s/round: the window / rounds (the run of median wall time is shown; all runs in brackets); "
            "run_round: the slowest worker's.",
            f"same server and client digests in every run: {same}",
            "trees: " + "; ".join(sorted({f"{r['tree']} at {r['commit']}" for r in runs})),
        ]
    )
    print(text)
    data = {"args": {k: str(v) for k, v in vars(args).items()}, "same_digests": same, "runs": runs, "table": text}
    rec.write(args.out, data, *figures(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
