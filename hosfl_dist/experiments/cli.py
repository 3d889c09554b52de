"""What the experiment commands share: their common options, and check -> launch -> report -> one-line errors.

This module imports nothing that imports torch: a command checks its overrides with the config loader first, so a
mistyped key is reported in a second, and only then imports the runner and the report (which pull in torch).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hosfl_dist.config import load_config
from hosfl_dist.errors import ConfigError, HosflError

if TYPE_CHECKING:
    from hosfl_dist.experiments.runs import RunSpec

Build = Callable[[argparse.Namespace], tuple[dict[str, list["RunSpec"]], str, dict[str, Any]]]
Plan = Callable[[argparse.Namespace], dict[str, list[str]]]
"""The overrides of every row of the report (method or grid point), before seeds: what is checked up front."""


def parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config of the setting")
    p.add_argument("--seeds", default="0", help="comma-separated job.seed values (default 0)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override for every run (repeatable; the same as a positional KEY=VALUE)",
    )
    p.add_argument("--metric", default="eval_accuracy", help="metric of the table and plot (default eval_accuracy)")
    p.add_argument("--title", default="", help="title of the table and plots")
    p.add_argument("--jobs", type=int, default=1, help="runs at the same time (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--dry-run", action="store_true", help="print the commands of the runs still to do; run nothing")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides for every run, as for python -m hosfl_dist.run (applied after --set)",
    )
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Options and positional overrides in any order (``--out o zo.mu=1 --seeds 0,1 job.device=cpu``)."""
    return p.parse_intermixed_args(argv)


def user_overrides(args: argparse.Namespace) -> list[str]:
    """--set overrides, then positional ones: the same meaning, so a later one wins as on the run's command line."""
    return [*args.sets, *getattr(args, "overrides", [])]


def parse_list(text: str, what: str, cast: Callable[[str], Any] = str) -> list[Any]:
    """ "a,b,c" -> [a, b, c]; an empty item or a value ``cast`` rejects is a one-line error (torch-free: the lists
    are needed before the overrides are checked)."""
    items = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in items):
        raise ConfigError(f"{what}: {text!r} is not a comma-separated list")
    try:
        return [cast(s) for s in items]
    except ValueError:
        raise ConfigError(f"{what}: {text!r} has an item that is not {cast.__name__}") from None


def check_overrides(config: str | None, variants: dict[str, list[str]]) -> None:
    """Build each row's config once. Unknown keys and malformed overrides fail before the algorithm registry (and
    so torch) is imported; the first valid config imports it, the later ones are cheap."""
    for name, overrides in variants.items():
        try:
            load_config(config, overrides)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None


def check_builds(config: str | None, variants: dict[str, list[str]], row: str = "grid point") -> None:
    """Check every row's config as its run would build it (:func:`hosfl_dist.precheck.check_build`: an LM's split on
    the meta device, a text task's files), before any run starts; one line per row that fails, naming the row and
    the cause. Rows that read the same fields are checked once."""
    from hosfl_dist.precheck import build_key, check_build

    seen: dict[str, str | None] = {}
    failed = []
    for name, overrides in variants.items():
        cfg = load_config(config, overrides)
        key = build_key(cfg)
        if key not in seen:
            try:
                check_build(cfg, 1)  # every run of an experiment is one process
                seen[key] = None
            except HosflError as exc:
                seen[key] = str(exc)
        if seen[key] is not None:
            failed.append(f"{row} {name}: {seen[key]}")
    if failed:
        rows = f"{row}s" if len(variants) > 1 else row
        failed.append(f"{len(failed)} of {len(variants)} {rows} cannot be built: nothing was run")
        raise ConfigError("\n".join(failed))


def run_experiment(
    prog: str,
    args: argparse.Namespace,
    argv: list[str] | None,
    build: Build,
    plan: Plan | None = None,
    row: str = "grid point",
) -> int:
    """:func:`run_rows`, then the invocation's wall time; a bad input or a failed run is one line each (exit code
    2)."""
    start = time.perf_counter()
    try:
        record = run_rows(prog, args, argv, build, plan, row)
        if record is not None:
            print(done_line(start, record, Path(args.out)))
    except HosflError as exc:
        print_error(exc)
        return 2
    return 0


def run_rows(
    prog: str,
    args: argparse.Namespace,
    argv: list[str] | None,
    build: Build,
    plan: Plan | None = None,
    row: str = "grid point",
) -> dict[str, Any] | None:
    """Check the overrides and the builds of every row (with ``plan``; ``row`` names a row in the errors), build the
    runs, launch the unfinished ones, write the report; returns the record of what ran (None for a dry run)."""
    parse_list(args.seeds, "--seeds", int)
    if plan is not None:
        variants = plan(args)
        check_overrides(args.config, variants)
        check_builds(args.config, variants, row)  # imports torch (and transformers for an LM)
    # the runner and the report import torch: only once the input is known to be usable
    from hosfl_dist.experiments.report import few_evaluations, write_report
    from hosfl_dist.experiments.runs import launch, load

    specs, title, extra = build(args)
    record = launch(args.config, [s for v in specs.values() for s in v], args.jobs, args.threads, args.dry_run)
    if args.dry_run:
        return None
    if record["failed"]:
        raise HosflError(f"{len(record['failed'])} run(s) failed: {record['failed'][0]}")
    words = argv if argv is not None else sys.argv[1:]
    extra = {
        "config": args.config,
        "command": f"python -m {prog} " + " ".join(quote_arg(a) for a in words),
        **extra,
        "this_invocation": record,
    }
    out = Path(args.out)
    variants = {n: [load(s) for s in v] for n, v in specs.items()}
    print(write_report(out, variants, args.metric, title, extra))
    for name, runs in variants.items():
        note = few_evaluations(name, [r.rows for r in runs], args.metric, runs[0].summary.get("processed_samples"))
        if note is not None:
            print(note)
    return record


def done_line(start: float, record: dict[str, Any], out: Path) -> str:
    """The last line of an experiment command: its wall time from start to end, and what its runs were."""
    runs = f"{len(record['launched'])} run(s) launched ({record['wall_time_s']} s), {len(record['reused'])} reused"
    return f"wall time of this invocation: {time.perf_counter() - start:.1f} s; {runs} -> {out}"


def print_error(exc: HosflError) -> None:
    """``error: ...`` on stderr, one line per line of the message."""
    print("\n".join(f"error: {line}" for line in str(exc).splitlines()), file=sys.stderr)


def quote_arg(arg: str) -> str:
    return arg if all(c.isalnum() or c in "-_./=:,@+" for c in arg) else repr(arg)
