"""What the experiment commands share: their common options, and check -> launch -> report -> one-line errors.

This module imports nothing that imports torch: a command checks its overrides with the config loader first, so a
mistyped key is reported in a second, and only then imports the runner and the report (which pull in torch).

Before anything starts every row is checked as its run would start (:func:`check_builds`): its build, its world
against its roles (``--launcher torchrun|slurm``), and its memory floor against the node's or GPU's memory where that
is known; one line per row that fails, exit code 2, nothing launched or submitted. After the runs, the report holds
those that completed and names the others with their cause (table.md's "Missing" section, table.json's ``missing``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hosfl_dist.config import load_config
from hosfl_dist.errors import ConfigError, HosflError, write_failure
from hosfl_dist.experiments.launch import LAUNCHERS
from hosfl_dist.experiments.launch.worlds import Rule, World

if TYPE_CHECKING:
    from hosfl_dist.experiments.runs import RunSpec

Build = Callable[[argparse.Namespace], tuple[dict[str, list["RunSpec"]], str, dict[str, Any]]]
Plan = Callable[[argparse.Namespace], dict[str, list[str]]]
"""The overrides of every row of the report (method or grid point), before seeds: what is checked up front."""
RowOverrides = Callable[[argparse.Namespace, str], list[str]]
"""The overrides this invocation would give a row of that name (a method, a grid point's label), before seeds: how
an earlier invocation's row into the same --out is judged the same setting, and kept in the report."""


def parser(prog: str, doc: str | None, examples: str | None = None) -> argparse.ArgumentParser:
    """A study's options; ``examples`` end its ``--help``."""
    p = argparse.ArgumentParser(prog=prog, description=doc, epilog=examples,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
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
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="a module every run imports first (e.g. one that registers a method or a task), added to the "
                   "config's job.plugins as python -m hosfl_dist.run --plugin does (repeatable)")  # fmt: skip
    p.add_argument("--metric", default="eval_accuracy", help="metric of the table and plot (default eval_accuracy)")
    p.add_argument("--title", default="", help="title of the table and plots")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at the same time (default 1; --launcher slurm: N > 1 caps each array's running tasks "
                        "at N, 1 leaves it to Slurm)")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--dry-run", action="store_true", help="print the commands of the runs still to do; run nothing")
    g = p.add_argument_group("launchers (docs/experiments.md, Launchers)")
    g.add_argument("--launcher", choices=LAUNCHERS, default="inprocess",
                   help="how each run starts: inprocess (python -m hosfl_dist.run, one process; the default), "
                        "torchrun (a local torchrun job, launch/torchrun.sh) or slurm (a task of a Slurm job array, "
                        "slurm/study_array.sbatch; an array per world)")  # fmt: skip
    g.add_argument("--nproc", type=int, metavar="N",
                   help="torchrun/slurm: processes of every run no --world rule matches (default: its server.ranks "
                        "+ 1, the server group and one client worker)")  # fmt: skip
    g.add_argument("--world", action="append", default=[], metavar="WHEN:NPROC[,nodes=N][,gpus=G][,KEY=VALUE...]",
                   help="torchrun/slurm: the world of the rows whose config matches WHEN (* or key=value[&key=value]), "
                        "with overrides it adds, e.g. --world=model.source=arch:qwen3-8b:6,server.ranks=2 "
                        "(repeatable; the first match wins)")  # fmt: skip
    g.add_argument("--worlds", metavar="FILE",
                   help="torchrun/slurm: a YAML list of worlds ({when: {key: value}, nproc, nodes, gpus, set: "
                        "[key=value]}), after the --world rules")  # fmt: skip
    g.add_argument("--node-memory", type=float, metavar="GIB",
                   help="refuse, before anything starts, a CPU run whose node needs more than GIB GiB for its weights "
                        "and optimizer state (slurm: default from --sbatch=--mem=SIZE)")  # fmt: skip
    g.add_argument("--gpu-memory", type=float, metavar="GIB",
                   help="refuse, before anything starts, a CUDA run whose rank needs more than GIB GiB for its "
                        "weights and optimizer state")  # fmt: skip
    g.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                   help="slurm: an sbatch option for every array, e.g. --sbatch=--partition=gpu "
                        "--sbatch=--time=04:00:00 (repeatable; after the study's own, so it wins)")  # fmt: skip
    g.add_argument(
        "--no-wait",
        action="store_true",
        help="slurm: return once the arrays are submitted (their ids and the collect command are printed)",
    )
    g.add_argument("--collect", action="store_true",
                   help="report the runs in --out as they stand; launch and submit nothing (python -m "
                        "hosfl_dist.experiments.collect OUT runs this)")  # fmt: skip
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
    """--set overrides, then positional ones: the same meaning, so a later one wins as on the run's command line;
    ``--plugin`` first, as ``job.plugins`` (the config file's and then these)."""
    given = [*args.sets, *getattr(args, "overrides", [])]
    plugins = getattr(args, "plugin", [])
    if not plugins:
        return given
    listed = load_config(args.config, given).job.plugins
    listed = [*listed, *(m for m in dict.fromkeys(plugins) if m not in listed)]
    return [f"job.plugins=[{', '.join(listed)}]", *given]


def parse_list(text: str, what: str, cast: Callable[[str], Any] = str) -> list[Any]:
    """ "a,b,c" -> [a, b, c]; an empty item or a value ``cast`` rejects is a one-line error (torch-free: the lists
    are needed before the overrides are checked)."""
    items = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in items):
        raise ConfigError(f"{what}: {text!r} is not a comma-separated list")
    try:
        values = [cast(s) for s in items]
    except ValueError:
        raise ConfigError(f"{what}: {text!r} has an item that is not {cast.__name__}") from None
    twice = sorted({str(v) for v in values if values.count(v) > 1})
    if twice:  # one point run twice would count as two seeds or two grid values
        raise ConfigError(f"{what}: {text!r} gives {', '.join(twice)} more than once (each point runs once)")
    return values


class Planning:
    """What a study says while it plans (every row's config, world and build, then every run's folder, checked before
    anything starts): for a plan of :attr:`SAY_FROM_RUNS` runs or more, a line that it is planning as it begins, one
    every :attr:`EVERY_S` with how far it is, and its time when done (a smaller plan takes a few seconds and says
    nothing). On stderr, so that a dry run's stdout stays its list of commands."""

    SAY_FROM_RUNS = 100
    EVERY_S = 10.0

    def __init__(self, rows: int, runs: int, row: str) -> None:
        self.rows, self.runs, self.row = rows, runs, row
        self.start = self.last = time.perf_counter()
        self.said = self.finished = False

    def __call__(self, stage: str, done: int, total: int) -> None:
        """Where the plan is: ``done`` of ``total`` ``stage`` (e.g. 4,000 of 10,000 configs checked)."""
        if self.finished or self.runs < self.SAY_FROM_RUNS:
            return
        now = time.perf_counter()
        if not self.said:
            self._say(f"planning {self.runs:,} run(s) of {self.rows:,} {self.row}(s): every config, world, build and "
                      "run folder is checked before anything starts")  # fmt: skip
            self.said, self.last = True, now
        elif now - self.last >= self.EVERY_S:
            self._say(f"planning: {done:,} of {total:,} {stage} ({now - self.start:.0f} s)")
            self.last = now

    def done(self) -> None:
        """The plan is made: its time, where it was announced."""
        if self.said and not self.finished:
            self._say(f"planned {self.runs:,} run(s) in {time.perf_counter() - self.start:.1f} s")
        self.finished = True

    @staticmethod
    def _say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)


def _quiet(stage: str, done: int, total: int) -> None:
    pass


def check_overrides(
    config: str | None, variants: dict[str, list[str]], progress: Callable[[str, int, int], None] = _quiet
) -> dict[str, Any]:
    """Build each row's config once. Unknown keys and malformed overrides of every row fail before the algorithm
    registry (and so torch) is imported; then each row's sections are checked against each other and the registry
    (:func:`hosfl_dist.runtime.checks.check_config`). Returns the rows' configs, checked."""
    trees = {}
    for i, (name, overrides) in enumerate(variants.items()):
        progress("configs read", i, len(variants))
        try:
            trees[name] = load_config(config, overrides)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    from hosfl_dist.runtime.checks import check_config

    for i, (name, cfg) in enumerate(trees.items()):
        progress("configs checked", i, len(trees))
        try:
            check_config(cfg)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    return trees


@dataclass(frozen=True)
class Launch:
    """How a study starts its runs (its launcher options, validated)."""

    launcher: str = "inprocess"
    rules: tuple[Rule, ...] = ()
    nproc: int | None = None
    node_gib: float | None = None
    gpu_gib: float | None = None
    sbatch: tuple[str, ...] = ()


def launch_options(args: argparse.Namespace) -> Launch:
    """The launcher options of ``args``; one that the launcher does not take is refused, naming both."""
    from hosfl_dist.experiments.launch.memory import slurm_mem_gib
    from hosfl_dist.experiments.launch.worlds import parse_world, read_worlds

    launcher = getattr(args, "launcher", "inprocess")
    given = {"--nproc": args.nproc is not None, "--world": bool(args.world), "--worlds": bool(args.worlds)}
    if launcher == "inprocess" and any(given.values()):
        used = ", ".join(k for k, v in given.items() if v)
        raise ConfigError(f"{used}: every run of --launcher inprocess is one process; use --launcher torchrun or "
                          "slurm")  # fmt: skip
    slurm_only = {"--sbatch": bool(args.sbatch), "--no-wait": args.no_wait}
    if launcher != "slurm" and any(slurm_only.values()):
        used = ", ".join(k for k, v in slurm_only.items() if v)
        raise ConfigError(f"{used}: only --launcher slurm submits jobs (got --launcher {launcher})")
    if args.jobs < 1 or args.threads < 1:
        raise ConfigError(f"--jobs and --threads must be >= 1 (got {args.jobs}, {args.threads})")
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1 (got {args.nproc})")
    for flag, value in (("--node-memory", args.node_memory), ("--gpu-memory", args.gpu_memory)):
        if value is not None and not value > 0:
            raise ConfigError(f"{flag} must be a number of GiB > 0 (got {value})")
    rules = [parse_world(w) for w in args.world] + (read_worlds(args.worlds) if args.worlds else [])
    node = args.node_memory if args.node_memory is not None else slurm_mem_gib(args.sbatch)
    return Launch(launcher, tuple(rules), args.nproc, node, args.gpu_memory, tuple(args.sbatch))


def assign_worlds(config: str | None, variants: dict[str, list[str]], launch: Launch) -> dict[str, World]:
    """Each row's world (:func:`hosfl_dist.experiments.launch.worlds.assign`); one process each in-process."""
    if launch.launcher == "inprocess":
        return {name: World() for name in variants}
    from hosfl_dist.experiments.launch.worlds import assign

    return assign(config, variants, launch.rules, launch.nproc)


def check_builds(
    config: str | None,
    variants: dict[str, list[str]],
    row: str = "grid point",
    worlds: dict[str, World] | None = None,
    launch: Launch | None = None,
    progress: Callable[[str, int, int], None] = _quiet,
    built: dict[str, Any] | None = None,
) -> None:
    """Check every row's config as its run would start, before any run starts; one line per row that fails, naming
    the row and the cause (``built``: configs :func:`check_overrides` made, taken for rows of the same overrides):

    - its build (:func:`hosfl_dist.cli.precheck.check_build`: an LM's split on the meta device, a text task's files),
      once per distinct build;
    - under torchrun or Slurm its world against its roles (the server group and at least one client worker; no more
      workers than clients.total), nodes and GPUs (:func:`hosfl_dist.experiments.launch.worlds.misfit`);
    - on this machine, its devices (a CUDA run needs one);
    - with ``--node-memory`` / ``--gpu-memory`` (or Slurm's ``--mem``), the floor of its memory per node or rank
      (:mod:`hosfl_dist.experiments.launch.memory`)."""
    from hosfl_dist.cli.precheck import build_key, check_build
    from hosfl_dist.runtime.checks import load_run_config

    launch = launch or Launch()
    worlds = worlds or {}
    seen: dict[tuple[str, bool], str | None] = {}
    sizes: dict[str, Any] = {}
    builds_only = True
    failed = []
    for i, (name, overrides) in enumerate(variants.items()):
        progress("builds checked", i, len(variants))
        known = (built or {}).get(name)
        cfg = known[1] if known is not None and known[0] == overrides else load_run_config(config, overrides)
        world = worlds.get(name, World())
        key = build_key(cfg)
        if (key, world.nproc > 1) not in seen:
            try:
                check_build(cfg, world.nproc)  # in-process: one process
                seen[key, world.nproc > 1] = None
            except HosflError as exc:
                seen[key, world.nproc > 1] = str(exc)
        cause = seen[key, world.nproc > 1]
        if cause is None:
            cause = _start_cause(cfg, world, launch, key, sizes, name, row)
            builds_only = builds_only and cause is None
        if cause is not None:
            failed.append(f"{row} {name}: {cause}")
    if failed:
        rows = f"{row}s" if len(variants) > 1 else row
        what = "cannot be built" if builds_only else "cannot start"
        nothing = "nothing was submitted" if launch.launcher == "slurm" else "nothing was run"
        failed.append(f"{len(failed)} of {len(variants)} {rows} {what}: {nothing}")
        raise ConfigError("\n".join(failed))


def _start_cause(cfg: Any, world: World, launch: Launch, key: str, sizes: dict[str, Any], name: str,
                 row: str) -> str | None:  # fmt: skip
    """Why a row that builds cannot start in its world (roles, devices, memory); None if it may."""
    from hosfl_dist.experiments.launch.memory import sizes_or_none, too_big
    from hosfl_dist.experiments.launch.worlds import misfit

    if launch.launcher != "inprocess":
        why = misfit(cfg, world, launch.launcher)
        if why is not None:
            return why
    if launch.launcher != "slurm":  # this machine runs it: its devices are these
        from hosfl_dist.runtime.process.host import check_devices

        try:
            check_devices(cfg)
        except HosflError as exc:
            return str(exc)
    if launch.node_gib is None and launch.gpu_gib is None:
        return None
    if key not in sizes:
        sizes[key] = sizes_or_none(cfg)
        if sizes[key][0] is None:
            print(f"note: {row} {name}: memory not estimated: {sizes[key][1]}")
    found = sizes[key][0]
    return None if found is None else too_big(cfg, world, found, launch.node_gib, launch.gpu_gib)


def run_experiment(
    prog: str,
    args: argparse.Namespace,
    argv: list[str] | None,
    build: Build,
    plan: Plan | None = None,
    row: str = "grid point",
    row_overrides: RowOverrides | None = None,
) -> int:
    """:func:`run_rows`, then the invocation's wall time; a bad input or a run that did not complete is one line each
    (exit code 2), as :func:`guarded` says."""

    def body(start: float) -> None:
        record = run_rows(prog, args, argv, build, plan, row, row_overrides)
        if record is not None:
            complete(record, row)
            print(done_line(start, record, Path(args.out)))

    return guarded(prog, args, body)


def guarded(prog: str, args: argparse.Namespace, body: Callable[[float], None]) -> int:
    """A study's command around ``body`` (given the start time): bad input, a run that did not complete or a write
    the machine refused (full disk, quota, read-only) is one line each, exit code 2; Ctrl-C is one line naming the
    study and how to go on, exit code 130 (the runs, which the terminal's Ctrl-C reached too, checkpoint and stop
    first); the study's lock on ``--out`` (:func:`own_out`) is let go at the end."""
    start = time.perf_counter()
    try:
        body(start)
    except HosflError as exc:
        print_error(exc)
        return 2
    except OSError as exc:
        failure = write_failure(exc, denied=True)
        if failure is None:
            raise
        print_error(failure)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not the traceback of wherever the study was
        print(f"interrupted: {prog} into {args.out} stopped by Ctrl-C after {time.perf_counter() - start:.0f} s; its "
              "finished runs are kept and reused, an unfinished one resumes from its last checkpoint: run the same "
              "command again", file=sys.stderr)  # fmt: skip
        return 130
    finally:
        lock = getattr(args, "study_lock", None)
        if lock is not None:
            lock.release()
    return 0


def free_out(args: argparse.Namespace) -> None:
    """Refuse, before anything is checked or built, an ``--out`` that lies inside a run's folder (the study's files
    would go among the run's) or that a live study holds (it writes the report there)."""
    from hosfl_dist.runfolder.folder import refuse_run_in_the_way
    from hosfl_dist.runfolder.lock import STUDY_LOCK, lock_holder

    from hosfl_dist.safe_files import check_folder_entries, check_output_folder

    out = Path(args.out)
    check_output_folder(out, "--out")
    check_folder_entries(out, "--out")  # study.json, table.md, ... are replaced: never a FIFO, a device, a link out
    refuse_run_in_the_way(out, "--out", below=False)  # below it are this study's own runs
    holder = lock_holder(out, STUDY_LOCK)
    if holder is not None:
        raise ConfigError(f"--out {out} is in use by a live study ({holder}); wait for it to end or choose another "
                          "folder")  # fmt: skip


def own_out(args: argparse.Namespace) -> None:
    """Take the study's lock on ``--out`` (held until the command ends, :func:`guarded`): the record, the runs' logs
    and the report are written by this process alone."""
    from hosfl_dist.runfolder.lock import StudyLock

    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out} cannot be created: {exc.strerror or exc}") from None
    lock = StudyLock(out)
    lock.acquire()
    args.study_lock = lock


def run_rows(
    prog: str,
    args: argparse.Namespace,
    argv: list[str] | None,
    build: Build,
    plan: Plan | None = None,
    row: str = "grid point",
    row_overrides: RowOverrides | None = None,
) -> dict[str, Any] | None:
    """Check the overrides, worlds and builds of every row (with ``plan``; ``row`` names a row in the errors), build
    the runs, launch the unfinished ones (or, with ``--collect``, none), write the report of those that completed;
    returns the record of what ran, its ``missing`` runs named with their cause (None for a dry run, or a Slurm
    submission not waited for). ``args.study_specs`` holds the runs as launched (with their worlds). Except in a dry
    run, the study holds its lock on ``--out`` (:func:`own_out`) from before the first run starts.

    With ``row_overrides``, the rows of earlier invocations into ``--out`` that this one does not have stay in the
    report where their runs are what this invocation would run for them (completed, the same identity: reused and
    said to be); the others are named, left out (:func:`hosfl_dist.experiments.runs.keep_earlier`)."""
    seeds = parse_list(args.seeds, "--seeds", int)
    free_out(args)
    launch = launch_options(args)
    worlds = None
    planning = args.planning = Planning(0, 0, row)
    if plan is not None:
        variants = plan(args)
        planning.rows, planning.runs = len(variants), len(variants) * len(seeds)
        trees = check_overrides(args.config, variants, planning)
        worlds = assign_worlds(args.config, variants, launch)  # imports torch (the config's algorithm registry)
        if not args.collect:
            placed_rows = {n: [*o, *worlds[n].overrides] for n, o in variants.items()}
            built = {n: (variants[n], cfg) for n, cfg in trees.items()}
            check_builds(args.config, placed_rows, row, worlds, launch, planning, built)  # and transformers for an LM
    # the runner and the report import torch: only once the input is known to be usable
    from hosfl_dist.experiments.report import few_evaluations, write_report
    from hosfl_dist.experiments.runs import load

    specs, title, extra = build(args)
    specs = placed(specs, worlds, launch.launcher)
    args.study_specs = specs
    from hosfl_dist.experiments.runs import check_distinct

    check_distinct(args.config, specs, Path(args.out), row, planning)
    if not args.dry_run:
        own_out(args)
    kept, left = earlier_rows(prog, args, specs, row, row_overrides)
    words = argv if argv is not None else sys.argv[1:]
    record = start(prog, args, [w for w in words if w != "--collect"], specs, launch)
    if record is None:
        return None
    out = Path(args.out)
    finished, record["missing"] = gather(args.config, specs, out)
    record["reused"] = [*(str(s.out_dir) for runs in kept.values() for s in runs), *record["reused"]]
    record["earlier_rows"] = {name: [s.seed for s in runs] for name, runs in kept.items()}
    record["earlier_left_out"] = left
    extra = {
        "config": args.config,
        "command": f"python -m {prog} " + " ".join(quote_arg(a) for a in words if a != "--collect"),
        **extra,
        "launcher": launch.launcher,
        **({"worlds": {n: worlds[n].as_dict() for n in specs}} if worlds and launch.launcher != "inprocess" else {}),
        "this_invocation": record,
    }
    variants = {n: [load(s) for s in v] for n, v in kept.items()}  # the earlier rows first: they were there first
    variants |= {n: [load(s) for s in v if s.out_dir in finished] for n, v in specs.items()}
    variants = {n: runs for n, runs in variants.items() if runs}
    notes = earlier_notes(record, row)
    if kept and not args.title:  # the title built from this invocation's rows names the kept ones too
        title += f", with {', '.join(kept)} kept from earlier invocations"
    print(write_report(out, variants, args.metric, title, extra, record["missing"], notes))
    for name, runs in variants.items():
        note = few_evaluations(name, [r.rows for r in runs], args.metric, runs[0].summary.get("processed_samples"))
        if note is not None:
            print(note)
    return record


def earlier_rows(
    prog: str, args: argparse.Namespace, specs: dict[str, list[RunSpec]], row: str, row_overrides: RowOverrides | None
) -> tuple[dict[str, list[RunSpec]], list[dict[str, Any]]]:
    """The runs of earlier invocations into ``--out`` whose rows this one keeps in its report (by row), said to be
    reused, and those it leaves out, each said with why (:func:`hosfl_dist.experiments.runs.keep_earlier`)."""
    if row_overrides is None:
        return {}, []
    from hosfl_dist.experiments.launch import study
    from hosfl_dist.experiments.runs import keep_earlier

    earlier = study.earlier_runs(study.read(Path(args.out)), prog, set(specs))
    kept, left = keep_earlier(args.config, earlier, lambda name: row_overrides(args, name))
    if args.collect:  # the report again, as it stands: nothing to announce (table.md names them)
        return kept, left
    mark = "# " if args.dry_run else ""
    for name, runs in kept.items():
        for spec in runs:
            print(f"{mark}reusing {spec.out_dir} (completed, same identity: config and inputs): {row} {name} of an "
                  "earlier invocation into --out, kept in the report")  # fmt: skip
    for entry in left:
        print(f"{mark}note: {row} {entry['row']} seed {entry['seed']} of an earlier invocation into --out is left out "
              f"of the report: {entry['why']}")  # fmt: skip
    return kept, left


def earlier_notes(record: dict[str, Any], row: str) -> list[str]:
    """table.md's lines on the rows earlier invocations into its folder left in it, and those left out (the same
    whether the study runs or is collected)."""
    lines = []
    earlier = record.get("earlier_rows") or {}
    if earlier:
        rows = ", ".join(f"{name} (seed{'s' if len(s) > 1 else ''} {', '.join(map(str, s))})" for name, s in
                         earlier.items())  # fmt: skip
        lines.append(f"Kept from earlier invocations into this folder, their runs reused: {row} {rows}.")
    left = record.get("earlier_left_out") or []
    if left:
        lines += ["", "## Left out", "", f"{len(left)} run(s) of earlier invocations into this folder are not what "
                  "this invocation would run for their rows, and are not in the table or the plots:", ""]  # fmt: skip
        lines += [f"- {e['row']}, seed {e['seed']}: {e['why']}" for e in left]
    return lines


def placed(specs: dict[str, list[RunSpec]], worlds: dict[str, World] | None, launcher: str) -> dict[str, list[RunSpec]]:
    """The runs with their rows' worlds: the world's overrides after the row's; a torchrun or Slurm job gets its folder
    as an absolute path (its launch script runs elsewhere)."""
    if launcher == "inprocess" or not worlds:
        return specs
    return {
        name: [
            dataclasses.replace(
                s, overrides=[*s.overrides, *worlds[name].overrides], out_dir=s.out_dir.resolve(), world=worlds[name]
            )  # fmt: skip
            for s in runs
        ]
        for name, runs in specs.items()
    }


def start(
    prog: str, args: argparse.Namespace, words: list[str], specs: dict[str, list[RunSpec]], launch: Launch
) -> dict[str, Any] | None:
    """Launch (or submit) the runs still to do, or with ``--collect`` nothing; the record of what ran."""
    from hosfl_dist.experiments.launch import study
    from hosfl_dist.experiments.launch.slurm import queued
    from hosfl_dist.experiments.runs import launch as launch_here
    from hosfl_dist.experiments.runs import split

    runs = [s for v in specs.values() for s in v]
    out = Path(args.out)
    planning = getattr(args, "planning", None) or Planning(0, len(runs), "run")
    if args.collect:
        _, reused, _ = split(args.config, runs, announce=False, progress=planning)
        planning.done()
        return {"launched": [], "reused": [str(s.out_dir) for s in reused], "failed": [], "wall_time_s": 0.0,
                "collected": True, "launcher": launch.launcher}  # fmt: skip
    record = study.read(out)
    if launch.launcher != "slurm":
        live = queued(record, required=False)
        busy = [f"{s.out_dir} is {live[str(s.out_dir)][1].lower()} in Slurm as task {live[str(s.out_dir)][0]}"
                for s in runs if str(s.out_dir) in live]  # fmt: skip
        if busy:
            raise ConfigError("\n".join([*busy, f"{len(busy)} run(s) of this study are Slurm tasks still in the "
                                          "queue: wait for them (collect reports them) or scancel them"]))  # fmt: skip
    if not args.dry_run:
        record = study.begin(out, prog, words, launch.launcher, runs)
    if launch.launcher == "slurm":
        from hosfl_dist.experiments.launch import slurm

        planning.done()
        return slurm.launch(
            args.config, runs, out, record, args.threads, launch.sbatch, args.dry_run, args.no_wait, args.jobs
        )
    record = launch_here(args.config, runs, args.jobs, args.threads, args.dry_run, launch.launcher, planning,
                         planning.done)  # fmt: skip
    return None if args.dry_run else record


def gather(config: str | None, specs: dict[str, list[RunSpec]], out: Path) -> tuple[set[Path], list[dict[str, Any]]]:
    """The runs that completed (folders), and the others with why (row, seed, run folder, cause in one line; a
    Slurm task still queued says so)."""
    from hosfl_dist.experiments.launch import study
    from hosfl_dist.experiments.launch.slurm import queued
    from hosfl_dist.experiments.runs import is_finished, resolve, why_missing

    live = queued(study.read(out), required=False)
    finished, missing = set(), []
    for name, runs in specs.items():
        for spec in runs:
            cfg = resolve(config, spec)
            if is_finished(spec, cfg):
                finished.add(spec.out_dir)
                continue
            task = live.get(str(spec.out_dir))
            queue = None if task is None else f"{task[1].lower()} in Slurm as task {task[0]}"
            missing.append({"row": name, "seed": spec.seed, "run": str(spec.out_dir),
                            "why": why_missing(spec, cfg, queue)})  # fmt: skip
    return finished, missing


def complete(record: dict[str, Any], row: str = "grid point") -> None:
    """Refuse, naming each with its cause, a study whose runs did not all complete (its report holds the others)."""
    missing = record.get("missing") or []
    if missing:
        total = len(missing) + len(record.get("reused") or []) + len(record.get("launched") or [])
        lines = [f"{row} {m['row']} seed {m['seed']}: {m['why']}" for m in missing]
        lines.append(f"{len(missing)} of {max(total, len(missing))} run(s) did not complete: the report holds the "
                     "others and names these (Missing)")  # fmt: skip
        raise HosflError("\n".join(lines))


def done_line(start: float, record: dict[str, Any], out: Path) -> str:
    """The last line of an experiment command: its wall time from start to end, and what its runs were."""
    if record.get("collected"):
        runs = f"{len(record['reused'])} completed run(s) collected"
    else:
        runs = f"{len(record['launched'])} run(s) launched ({record['wall_time_s']} s), {len(record['reused'])} reused"
    return f"wall time of this invocation: {time.perf_counter() - start:.1f} s; {runs} -> {out}"


def print_error(exc: HosflError) -> None:
    """``error: ...`` on stderr, one line per line of the message."""
    print("\n".join(f"error: {line}" for line in str(exc).splitlines()), file=sys.stderr)


def quote_arg(arg: str) -> str:
    return arg if all(c.isalnum() or c in "-_./=:,@+" for c in arg) else repr(arg)
