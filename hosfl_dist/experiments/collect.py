"""Report a study from its runs as they stand: ``python -m hosfl_dist.experiments.collect OUT [--wait]``.

OUT is the --out of a compare, sweep or scaling command; its ``study.json`` holds that command. The command's report
(table.md, table.json, the plots; scaling.md for scaling) is written again from the runs in OUT that completed, and
the others are named with their cause (table.md's "Missing", table.json's ``missing``): still queued in Slurm,
failed (summary.json's ``error`` or the log's last ``error:`` line), interrupted, or not run. Nothing is launched or
submitted. ``--wait`` first waits until none of the study's Slurm tasks is in the queue.

Exit code 0 when every run completed, 2 when some did not (one ``error:`` line each) or OUT holds no study.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from hosfl_dist.errors import HosflError

PROG = "hosfl_dist.experiments.collect"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", metavar="OUT", help="the study's --out folder (with its study.json)")
    p.add_argument("--wait", action="store_true", help="wait until none of the study's Slurm tasks is queued first")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from hosfl_dist.experiments.cli import print_error
    from hosfl_dist.experiments.launch import study

    args = parse_args(argv)
    out = Path(args.out).resolve()
    try:
        record = study.read(out)
        if record is None:
            raise HosflError(f"{out} holds no study.json: collect reports what compare, sweep or scaling launched "
                             "there (a dry run writes none)")  # fmt: skip
        if not os.path.isdir(record["cwd"]):
            raise HosflError(f"{out / study.FILE}: the folder the study ran in, {record['cwd']}, is gone")
        if args.wait:
            from hosfl_dist.experiments.launch.slurm import wait_queued

            wait_queued(out)
    except HosflError as exc:
        print_error(exc)
        return 2
    os.chdir(record["cwd"])  # the command's relative paths (--config, --worlds) are the study's folder's
    words, skip = [], False
    for w in record["argv"]:  # the study's own words but --no-wait and --out, which collect gives (resolved)
        if skip or w == "--no-wait" or w.startswith("--out="):
            skip = False
            continue
        if w == "--out":
            skip = True
            continue
        words.append(w)
    return importlib.import_module(record["prog"]).main([*words, "--collect", "--out", str(out)])


if __name__ == "__main__":
    sys.exit(main())
