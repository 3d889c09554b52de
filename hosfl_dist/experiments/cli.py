"""What the experiment commands share: their common options, and launch -> report -> one-line errors."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hosfl_dist.errors import HosflError
from hosfl_dist.experiments.report import write_report
from hosfl_dist.experiments.runs import RunSpec, launch, load

Build = Callable[[argparse.Namespace], tuple[dict[str, list[RunSpec]], str, dict[str, Any]]]


def parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config of the setting")
    p.add_argument("--seeds", default="0", help="comma-separated job.seed values (default 0)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="override (repeatable)")
    p.add_argument("--metric", default="eval_accuracy", help="metric of the table and plot (default eval_accuracy)")
    p.add_argument("--title", default="", help="title of the table and plots")
    p.add_argument("--jobs", type=int, default=1, help="runs at the same time (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--dry-run", action="store_true", help="print the commands of the runs still to do; run nothing")
    return p


def run_experiment(prog: str, args: argparse.Namespace, argv: list[str] | None, build: Build) -> int:
    """Build the runs, launch the unfinished ones, write the report; a bad input or a failed run is one line."""
    try:
        specs, title, extra = build(args)
        record = launch(args.config, [s for v in specs.values() for s in v], args.jobs, args.threads, args.dry_run)
        if args.dry_run:
            return 0
        if record["failed"]:
            raise HosflError(f"{len(record['failed'])} run(s) failed: {record['failed'][0]}")
        words = argv if argv is not None else sys.argv[1:]
        extra = {
            "config": args.config,
            "command": f"python -m {prog} " + " ".join(_quote(a) for a in words),
            **extra,
            "this_invocation": record,
        }
        out = Path(args.out)
        print(write_report(out, {n: [load(s) for s in v] for n, v in specs.items()}, args.metric, title, extra))
        print(f"wall time of this invocation: {record['wall_time_s']} s -> {out}")
    except HosflError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _quote(arg: str) -> str:
    return arg if all(c.isalnum() or c in "-_./=:,@+" for c in arg) else repr(arg)
