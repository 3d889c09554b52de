"""Launching the runs of an experiment on this machine (one job each: a ``python -m hosfl_dist.run`` process, or a
torchrun job of the run's world), reusing the ones already finished, and reading them.

A run lives in its own folder with the outputs of ``hosfl_dist.run`` (config.yaml, metrics.jsonl, summary.json,
checkpoints/) plus ``log.txt`` (its stdout and stderr). A folder whose run finished (``completed``, or ``stopped`` by
its own ``train.early_stopping``: :func:`~hosfl_dist.runfolder.folder.finished`) and whose config.yaml is the config
the run would get now is reused as is; an unfinished run of the same config is continued
from its latest checkpoint (``job.resume=auto``); a folder holding another setting is run again
(``job.overwrite=true``). A run that did not complete is named with its one-line cause (:func:`why_missing`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hosfl_dist.config import Config
from hosfl_dist.errors import ConfigError, HosflError
from hosfl_dist.experiments.launch.worlds import World
from hosfl_dist.runfolder.folder import config_differences, finished, input_differences, recorded_summary, run_status


@dataclass
class RunSpec:
    """One run: which row of the report it belongs to (a method or a grid point), its seed and overrides."""

    variant: str
    seed: int
    overrides: list[str]
    out_dir: Path
    world: World = field(default_factory=World)
    """The processes (nodes, GPUs) its job starts with; its overrides are in ``overrides`` already."""

    def all_overrides(self) -> list[str]:
        # progress on: its lines (every tenth of the budget or minute, and the final evaluation) go to the log file
        return [*self.overrides, f"job.seed={self.seed}", f"job.out_dir={self.out_dir}", "job.progress=true"]


@dataclass
class RunData:
    spec: RunSpec
    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


def resolve(config: str | None, spec: RunSpec) -> Config:
    """The config the run will get (validates every override before anything starts)."""
    from hosfl_dist.runtime.checks import load_run_config

    try:
        return load_run_config(config, spec.all_overrides())
    except ConfigError as exc:
        raise ConfigError(f"{spec.variant} seed {spec.seed}: {exc}") from None


Progress = Callable[[str, int, int], None]
"""What a study's planning calls as it goes: (what is being checked, how many so far, of how many)."""


def _quiet(stage: str, done: int, total: int) -> None:
    pass


def check_distinct(config: str | None, specs: dict[str, list[RunSpec]], out: Path, row: str = "grid point",
                   progress: Progress = _quiet) -> None:  # fmt: skip
    """Refuse a study in which two runs are one point, which the report would count twice: two runs in one folder
    (labels that make the same folder name), or two runs of one config (``--grid zo.mu=1e-3,0.001``, a value written
    two ways); and a run folder that resolves out of ``out`` (a link to another run's folder). One line each."""
    from hosfl_dist.runfolder.identity import comparable_config

    base = out.resolve()
    folders: dict[Path, str] = {}
    configs: dict[str, str] = {}
    problems = []
    total = sum(len(runs) for runs in specs.values())
    for name, runs in specs.items():
        for spec in runs:
            progress("runs told apart", len(folders), total)
            here = f"{row} {name} seed {spec.seed}"
            folder = spec.out_dir.resolve()
            if not folder.is_relative_to(base):
                problems.append(f"{here}: its run folder {spec.out_dir} resolves to {folder}, out of --out {out}")
            if folder in folders:
                problems.append(f"{here}: its run folder {spec.out_dir} is that of {folders[folder]} too")
            folders.setdefault(folder, here)
            key = json.dumps(comparable_config(resolve(config, spec)), sort_keys=True, default=str)
            if key in configs:
                problems.append(f"{here}: the same run as {configs[key]} (one config, written two ways)")
            configs.setdefault(key, here)
    if problems:
        problems.append(f"{len(problems)} run(s) would be counted twice or written elsewhere: each point runs once, "
                        "in its own folder under --out")  # fmt: skip
        raise ConfigError("\n".join(problems))


def is_finished(spec: RunSpec, cfg: Config) -> bool:
    """A finished run (completed, or stopped by its early stopping) of exactly this config (but for how it was
    started), from inputs of the same content."""
    return (
        finished(spec.out_dir)
        and config_differences(spec.out_dir, cfg) == []
        and not input_differences(spec.out_dir, cfg)
    )


def keep_earlier(config: str | None, earlier: list[dict[str, Any]], overrides_of: Callable[[str], list[str]]) -> tuple[
    dict[str, list[RunSpec]], list[dict[str, Any]]
]:  # fmt: skip
    """The runs of earlier invocations into a study's folder (:func:`~hosfl_dist.experiments.launch.study.
    earlier_runs`) that this invocation would have made as they are: by row, the completed ones whose identity
    (config and inputs) is the one ``overrides_of(row)`` gives the row now (reused, so their rows stay in the
    report); and the others, each ``{row, seed, run, why}`` (another setting, not completed, gone)."""
    kept: dict[str, list[RunSpec]] = {}
    left: list[dict[str, Any]] = []
    for entry in earlier:
        spec = RunSpec(entry["row"], entry["seed"], [], Path(entry["run"]))
        try:
            spec.overrides = list(overrides_of(spec.variant))
            cfg = resolve(config, spec)
        except ConfigError as exc:
            left.append({**entry, "why": f"its row does not build with this invocation's settings: {exc}"})
            continue
        if is_finished(spec, cfg):
            kept.setdefault(spec.variant, []).append(spec)
        else:
            left.append({**entry, "why": why_missing(spec, cfg)})
    return kept, left


def command(config: str | None, spec: RunSpec, cfg: Config | None = None) -> list[str]:
    """The run's command: it continues an unfinished run of the same config and replaces another setting's."""
    cmd = [sys.executable, "-m", "hosfl_dist.run"]
    if config:
        cmd += ["--config", str(config)]
    return cmd + spec.all_overrides() + start_overrides(spec, cfg)


def start_overrides(spec: RunSpec, cfg: Config | None) -> list[str]:
    """``job.resume=auto`` for a folder holding this run unfinished, ``job.overwrite=true`` for one holding another
    setting (or this config over inputs of other content), nothing for an empty one."""
    diff = config_differences(spec.out_dir, cfg) if cfg is not None else None
    if diff == [] and cfg is not None and input_differences(spec.out_dir, cfg):
        diff = ["inputs (other content)"]  # the same config over other data or weights: a new run
    return [] if diff is None else ["job.resume=auto"] if not diff else ["job.overwrite=true"]


def split(config: str | None, specs: Sequence[RunSpec], dry_run: bool = False, announce: bool = True,
          progress: Progress = _quiet) -> tuple[dict[Path, Config], list[RunSpec], list[RunSpec]]:  # fmt: skip
    """Each run's config (validated), and the runs to reuse (announced) and to do."""
    todo, reused, cfgs = [], [], {}
    for i, spec in enumerate(specs):
        progress("run folders read", i, len(specs))
        cfgs[spec.out_dir] = cfg = resolve(config, spec)
        (reused if is_finished(spec, cfg) else todo).append(spec)
    for spec in reused if announce else ():  # a comment line in a dry run's list of commands
        how = run_status(spec.out_dir)
        print(f"{'# ' if dry_run else ''}reusing {spec.out_dir} ({how}, same identity: config and inputs)")
    return cfgs, reused, todo


def job(config: str | None, spec: RunSpec, cfg: Config, launcher: str) -> tuple[list[str], dict[str, str]]:
    """The run's command on this machine and the environment it adds: ``python -m hosfl_dist.run`` (inprocess), or
    ``launch/torchrun.sh`` with the run's processes (torchrun)."""
    if launcher == "inprocess":
        return command(config, spec, cfg), {}
    from hosfl_dist.experiments.launch import torchrun

    return torchrun.command(config, spec.world.nproc, spec.all_overrides() + start_overrides(spec, cfg))


def launch(
    config: str | None,
    specs: Sequence[RunSpec],
    jobs: int = 1,
    threads: int = 1,
    dry_run: bool = False,
    launcher: str = "inprocess",
    progress: Progress = _quiet,
    planned: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Run the unfinished specs on this machine, ``jobs`` at a time, each process with ``threads`` intra-op threads:
    one process each (``launcher`` inprocess) or a torchrun job of the run's world (torchrun); returns a record of
    what ran (launched, reused, failed runs, and the wall time of this invocation). ``progress`` is told how far
    the reading of the run folders is, ``planned`` called once it is done."""
    if jobs < 1 or threads < 1:
        raise ConfigError(f"--jobs and --threads must be >= 1 (got {jobs}, {threads})")
    cfgs, reused, todo = split(config, specs, dry_run, progress=progress)
    planned()
    if dry_run:
        for spec in todo:
            cmd, added = job(config, spec, cfgs[spec.out_dir], launcher)
            if launcher == "inprocess":
                print(" ".join(cmd))
            else:
                from hosfl_dist.experiments.launch.torchrun import shown

                print(shown(cmd, added))
        return {"launched": [], "reused": [str(s.out_dir) for s in reused], "failed": [], "wall_time_s": 0.0}
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env.pop("HOSFL_JOB_TOKEN", None)  # every torchrun job makes a token of its own (launch/torchrun.sh)
    start = time.perf_counter()
    watch = Watch(len(todo))
    jobs_now = Running()

    def one(spec: RunSpec) -> tuple[RunSpec, int, float]:
        if jobs_now.stopped.is_set():  # after Ctrl-C nothing starts
            return spec, NOT_STARTED, 0.0
        spec.out_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        watch.started(spec)
        log = open_log(spec.out_dir)
        if isinstance(log, str):  # a live run holds the folder: its log is not this study's to touch
            rc, said = 2, f": {log}"
        else:
            with log:
                cmd, added = job(config, spec, cfgs[spec.out_dir], launcher)
                rc = jobs_now.run(spec.out_dir, cmd, log, {**env, **added})
            said = ""
        took = time.perf_counter() - t0
        watch.ended(spec)
        world = "" if launcher == "inprocess" else f" ({spec.world.describe()})"
        how = "ok" if rc == 0 else "interrupted" if rc in CTRL_C else f"FAILED rc={rc}"
        say(f"[{how}] {spec.variant} seed {spec.seed}{world}: {took:.1f} s (its process, set-up included){said}")
        if rc in CTRL_C:  # a run stopped by Ctrl-C: the study stops with it
            jobs_now.stopped.set()
        return spec, rc, took

    pool = ThreadPoolExecutor(max_workers=jobs)
    with watch:
        futures = [pool.submit(one, spec) for spec in todo]
        try:
            results = [f.result() for f in futures]  # Ctrl-C reaches this thread, which waits
        except KeyboardInterrupt:
            jobs_now.stop(pool)  # the running runs checkpoint and record it; none starts after
            raise
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
    if jobs_now.stopped.is_set():  # a run was stopped by a Ctrl-C that woke none of this process's threads
        raise KeyboardInterrupt
    results = [r for r in results if r[1] != NOT_STARTED]
    return {
        "launched": [{"run": str(s.out_dir), "wall_time_s": round(w, 1)} for s, rc, w in results if rc == 0],
        "reused": [str(s.out_dir) for s in reused],
        "failed": [f"{s.out_dir} (see {s.out_dir / 'log.txt'})" for s, rc, _ in results if rc != 0],
        "wall_time_s": round(time.perf_counter() - start, 1),
        "jobs": jobs,
        "threads": threads,
        "launcher": launcher,
    }


def say(line: str) -> None:
    """One line on stdout in one write (runs start and finish in parallel threads)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


CTRL_C = (130, -2)
"""A run's exit code after Ctrl-C: the command's own (128 + SIGINT), or the signal's where it had no handler yet."""
NOT_STARTED = -(2**31)
"""The code of a run that Ctrl-C kept from starting."""


class Running:
    """The study's running jobs, each in a session of its own, so that a Ctrl-C reaches them once, from the study:
    the terminal's goes to the study alone, which forwards one SIGINT to each job's process group (what the terminal
    would have sent), so each run checkpoints, records that it was interrupted and stops; ``stopped`` keeps any run
    from starting after."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.procs: dict[Path, subprocess.Popen] = {}
        self.stopped = threading.Event()

    def run(self, folder: Path, cmd: list[str], log: Any, env: dict[str, str]) -> int:
        """The job's exit code (``cmd`` started with ``log`` as its output, or never where the study stopped). A study
        that ignores SIGINT (started in the background by a shell) forwards none: its jobs then stay in its process
        group, where a Ctrl-C sent to the group reaches them, and the first that stops by it stops the study."""
        own_session = signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
        with self.lock:
            if self.stopped.is_set():
                return NOT_STARTED
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=own_session)
            self.procs[folder] = proc
        try:
            return proc.wait()
        finally:
            with self.lock:
                self.procs.pop(folder, None)

    def interrupt(self) -> None:
        """One SIGINT to each running job's process group (a torchrun job's every process)."""
        with self.lock:
            procs = list(self.procs.values())
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # ended meanwhile
                os.killpg(proc.pid, signal.SIGINT)

    def stop(self, pool: ThreadPoolExecutor) -> None:
        """After Ctrl-C: start nothing more, interrupt the running jobs and wait until each has recorded its end; a
        second Ctrl-C while waiting is forwarded too (the runs then stop at once), a third stops the wait."""
        self.stopped.set()
        for _ in range(3):
            self.interrupt()
            try:
                pool.shutdown(wait=True, cancel_futures=True)
                return
            except KeyboardInterrupt:
                continue
WATCH_S = 60.0
"""How often a study says where each running point is (its log's last progress line)."""


class Watch:
    """A study's points on its stdout: ``[start] VARIANT seed S (i/n): log FOLDER/log.txt`` as each begins, and every
    :data:`WATCH_S` the newest progress line of each point still running (read from its log), so that a study
    never runs in silence until its first point ends."""

    def __init__(self, total: int) -> None:
        import threading

        self.total, self.count = total, 0
        self.running: dict[Path, tuple[RunSpec, str]] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="study-watch", daemon=True)

    def __enter__(self) -> Watch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def started(self, spec: RunSpec) -> None:
        with self.lock:
            self.count += 1
            self.running[spec.out_dir] = (spec, "")
            say(f"[start] {spec.variant} seed {spec.seed} ({self.count}/{self.total}): log {spec.out_dir / 'log.txt'}")

    def ended(self, spec: RunSpec) -> None:
        with self.lock:
            self.running.pop(spec.out_dir, None)

    def _loop(self) -> None:
        while not self.stop.wait(WATCH_S):
            with self.lock:
                for folder, (spec, shown) in list(self.running.items()):
                    line = last_progress(folder / "log.txt")
                    if line and line != shown:
                        self.running[folder] = (spec, line)
                        say(f"[running] {spec.variant} seed {spec.seed}: {line}")


def last_progress(log: Path) -> str | None:
    """The newest progress line of a run's log (``… 1,200/4,000 samples (30%) …`` or ``evaluating round …``)."""
    try:
        with open(log, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 20_000))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if " samples (" in line or ": evaluating round " in line or "budget reached" in line:
            return line.strip()
    return None


def open_log(folder: Path) -> Any:
    """The run's ``log.txt``, opened (and emptied) under the run's lock, so that the log of a run another process
    holds is never touched; the lock is let go before the run's own process takes it. A string saying who holds the
    folder where it is held."""
    from hosfl_dist.runfolder.lock import RunLock

    lock = RunLock(folder)
    try:
        lock.acquire()
    except ConfigError as exc:
        return str(exc)
    try:
        return open(folder / "log.txt", "w")  # noqa: SIM115 - the run's output goes into it until the run ends
    finally:
        lock.release()


def last_error(log: Path) -> str | None:
    """The last ``error: …`` line of a run's log (a rank's ``[worker 2] error: …`` too), without the word."""
    try:
        with open(log, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 200_000))  # the end of a long log is enough
            text = fh.read().decode(errors="replace")
    except OSError:
        return None
    found = None
    for line in text.splitlines():
        head, sep, rest = line.partition("error: ")
        if sep and (not head.strip() or head.rstrip().endswith("]")) and rest.strip():
            found = rest.strip()
    return found


def why_missing(spec: RunSpec, cfg: Config, queued: str | None = None) -> str:
    """Why the run of ``spec`` is not a completed run of ``cfg``, in one line: its record's status with the cause
    (summary.json's ``error``, else the log's last ``error:`` line), or ``queued`` (e.g. ``pending in Slurm as task
    12_3``) where the run has not ended."""
    status = run_status(spec.out_dir)
    log = spec.out_dir / "log.txt"
    cause = ((recorded_summary(spec.out_dir) or {}).get("error") if status else None) or last_error(log)
    see = f" (log: {log})" if log.is_file() else ""
    if queued is not None and status not in ("completed", "failed"):
        return queued + (f"; its run is {status}" if status else "")
    if status is None:
        return (f"not run: {cause}" if cause else "not run") + see
    if status == "completed":
        diff = config_differences(spec.out_dir, cfg) or ["inputs (other content)"]
        return f"holds a completed run of another setting ({', '.join(diff[:3])})" + see
    if status == "interrupted":
        summary = recorded_summary(spec.out_dir) or {}
        return (f"interrupted after round {summary.get('rounds')} ({cause}): the command run again resumes it from "
                f"{summary.get('checkpoint') or 'the start'}") + see  # fmt: skip
    if status == "stopped":  # by a callback: user code, not the config's own end (the config's is finished)
        stopped = (recorded_summary(spec.out_dir) or {}).get("stopped") or {}
        if config_differences(spec.out_dir, cfg) == []:
            return (f"stopped after round {stopped.get('round')} by {stopped.get('by')}: the command run again "
                    "continues it to its budget") + see  # fmt: skip
        diff = config_differences(spec.out_dir, cfg) or ["inputs (other content)"]
        return f"holds a stopped run of another setting ({', '.join(diff[:3])})" + see
    return f"{status}" + (f": {cause}" if cause else "") + see


def load(spec: RunSpec) -> RunData:
    """Metrics and summary of a finished run."""
    metrics, summary = spec.out_dir / "metrics.jsonl", spec.out_dir / "summary.json"
    if not summary.is_file():
        raise HosflError(f"run {spec.out_dir} has no summary.json (see its log.txt)")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return RunData(spec, rows, json.loads(summary.read_text()))


def safe_name(text: str) -> str:
    """A folder name for a variant label such as ``zo.num_perturbations=5,zo.mu=0.001``: one path component that
    stays in its parent (never empty, ``.``, ``..`` or hidden), at most 200 characters (a longer label keeps its first
    183 and a hash of the whole, so two long labels stay apart)."""
    name = "".join(c if c.isalnum() or c in "._=-" else "_" for c in text)
    if not name or name.startswith("."):
        name = "_" + name
    if len(name) > 200:
        name = f"{name[:183]}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    return name
