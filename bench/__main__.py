"""The benchmark suite's command.

    python -m bench list                                  # every benchmark, its figures, their targets and floors
    python -m bench run NAME... [--out DIR] [-- OPTIONS]  # NAME: a benchmark of the list, or all
    python -m bench table [DIR]                           # the records in DIR as one markdown table

``run`` runs each benchmark as its own process (``python -m bench.<module> <its options> --out DIR``), which writes
``DIR/NAME.json`` (default ``bench/out/``, ignored by git); OPTIONS after ``--`` go to every benchmark named, so they
are for running one (``python -m bench run dist -- --workers 1 2 3``). A benchmark that fails gets a record too, its
figures null and its error said. The exit status is 1 when a benchmark failed; a missed target is a measurement,
not a failure.
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from bench.common import DEFAULT_OUT, ROOT, Recorder, display
from bench.suite import BENCHMARKS


def list_text() -> str:
    lines = []
    for b in BENCHMARKS.values():
        gpu = ", needs a CUDA GPU" if b.gpu else ""
        lines += [f"{b.name} ({b.takes}{gpu}): {b.measures}", f"  {shlex.join(b.argv(DEFAULT_OUT)[:-2])}"]
        width = max(len(f.name) for f in b.figures)
        unit = max(len(f.unit) for f in b.figures)
        for f in b.figures:
            floor = "measured" if isinstance(f.floor, str) else f.floor_text()
            lines.append(
                f"    {f.name:<{width}}  {f.unit:<{unit}}  target {f.target_text():<8} floor {floor:<8}  {f.meaning}"
            )
        for how in dict.fromkeys(f.floor for f in b.figures if isinstance(f.floor, str)):
            lines.append(f"    floor measured: {how}")
    return "\n".join(lines)


def _value(v: object) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return str(v).lower()
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _met(m: bool | None) -> str:
    return "" if m is None else ("met" if m else "missed")


def summary(out: Path, names: list[str]) -> str:
    lines = []
    for name in names:
        path = out / f"{name}.json"
        if not path.is_file():
            lines.append(f"{name}: no record in {display(out)}")
            continue
        rec = json.loads(path.read_text())
        if rec.get("error"):
            lines.append(f"{name}: {rec['error']}")
        for fig, f in rec["figures"].items():
            target = "" if f["target"] is None else f"target {_value(f['target'])}"
            lines.append(f"  {name}.{fig}: {_value(f['value'])} {f['unit']}  {target} {_met(f['met'])}".rstrip())
    return "\n".join(lines)


@functools.cache
def cuda_available() -> bool:
    """Whether torch sees a CUDA device (asked in a child: this command does not import torch)."""
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], cwd=ROOT).returncode == 0


def run(names: list[str], out: Path, extra: list[str], timeout: float, via: str) -> int:
    failed = []
    t_all = time.perf_counter()
    for name in names:
        bench = BENCHMARKS[name]
        argv = [*bench.options, *extra, "--out", display(out)]
        rec = Recorder(bench, argv, via)  # the failure record, if the benchmark writes none
        print(f"== {name}: {rec.command}", flush=True)
        if bench.gpu and not cuda_available():
            print(f"== {name}: skipped (it needs a CUDA device; torch sees none here)", flush=True)
            continue
        t0 = time.time()
        proc = subprocess.Popen(
            [sys.executable, "-m", bench.module, *argv, "--via", via], cwd=ROOT, stderr=subprocess.PIPE, text=True
        )
        tail: list[str] = []
        try:
            for line in proc.stderr:  # shown as it comes; the last lines kept for the record
                sys.stderr.write(line)
                tail = [*tail[-19:], line.rstrip()]
            proc.wait(timeout=max(1.0, timeout - (time.time() - t0)))
            error = None if proc.returncode == 0 else f"exit {proc.returncode}: {tail[-1] if tail else '(no output)'}"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            error = f"no end after {timeout:.0f} s"
        path = out / f"{name}.json"
        if error is not None:
            failed.append(name)
            if not (path.is_file() and path.stat().st_mtime >= t0):
                rec.write(out, {"stderr_tail": tail}, {}, error=error)
        took = time.time() - t0
        total = time.perf_counter() - t_all
        print(
            f"== {name}: {'done' if error is None else 'FAILED (' + error + ')'} in {took:.0f} s (total {total:.0f} s)"
        )
    print(summary(out, names))
    return 1 if failed else 0


def table(out: Path) -> str:
    """Every record in ``out`` as one markdown table, then where each came from."""
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    records = [r for r in records if "figures" in r and r.get("benchmark") in BENCHMARKS]
    lines = ["| benchmark | figure | value | unit | target | floor | met |", "|---|---|---:|---|---|---:|---|"]
    for r in records:
        for name, f in r["figures"].items():
            target = "" if f["target"] is None else f"{'≤' if f['sense'] == '<=' else f['sense']} {_value(f['target'])}"
            target = target.replace(">=", "≥")
            lines.append(
                f"| {r['benchmark']} | {name} | {_value(f['value'])} | {f['unit']} | {target} | "
                f"{'' if f['floor'] is None else _value(f['floor'])} | {_met(f['met'])} |"
            )
    lines += ["", "| benchmark | command | started | commit | machine | load average before / after |"]
    lines.append("|---|---|---|---|---|---|")
    for r in records:
        load = " / ".join("–" if x is None else " ".join(map(str, x)) for x in r["load_average"].values())
        lines.append(
            f"| {r['benchmark']} | `{r['command']}` | {r['started'] or '–'} | {r['commit'] or '–'} | {r['machine']} | "
            f"{load} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in words:
        words, extra = words[: words.index("--")], words[words.index("--") + 1 :]
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every benchmark with its figures, targets and floors")
    r = sub.add_parser("run", help="run benchmarks, each writing DIR/NAME.json")
    r.add_argument("names", nargs="+", metavar="NAME", help=f"all, or any of: {', '.join(BENCHMARKS)}")
    r.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder of the records [bench/out]")
    r.add_argument("--timeout", type=float, default=7200, help="seconds per benchmark [7200]")
    t = sub.add_parser("table", help="the records in a folder as one markdown table")
    t.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT, help="[bench/out]")
    args = p.parse_args(words)
    if args.command == "list":
        print(list_text())
        return 0
    if args.command == "table":
        print(table(args.out))
        return 0
    unknown = [n for n in args.names if n != "all" and n not in BENCHMARKS]
    if unknown:
        p.error(f"no benchmark {', '.join(unknown)}: the suite has {', '.join(BENCHMARKS)} (or all)")
    names = list(BENCHMARKS) if "all" in args.names else list(dict.fromkeys(args.names))
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    via = shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)])
    return run(names, out, extra, args.timeout, via)


if __name__ == "__main__":
    sys.exit(main())
