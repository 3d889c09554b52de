"""``--launcher slurm``: every run a task of a Slurm job array; the runs of one world share an array.

Slurm gives every task of an array the same nodes, CPUs and GPUs, so the study submits one array per world (processes,
nodes, GPUs per node). For each it writes ``OUT/slurm/<k>-<world>/tasks/<i>`` (task i's run folder, config and
overrides, one a line) and submits::

    sbatch --array=0-(n-1) --nodes=N --ntasks-per-node=1 --cpus-per-task=C [--gpus-per-node=G] --requeue \\
        --signal=B:TERM@120 --output=OUT/slurm/<k>-<world>/%A_%a.out [--sbatch OPTION...] \\
        slurm/study_array.sbatch OUT/slurm/<k>-<world>/tasks

C is the processes per node times ``--threads``. Task i writes into its run folder's log.txt and runs the product's
launch line, ``slurm/hosfl.sbatch`` (``srun``, one torchrun per node, the config's ``--check`` first), with
NPROC_PER_NODE processes per node. Preempted or at its time limit (SIGTERM to the batch shell), every rank stops at a
round boundary with a checkpoint and the task requeues itself; it starts again with ``job.resume=auto`` and continues
from that checkpoint. Ranks killed before they could say how the run ended are recorded as ``died``.

A completed run of the same identity is not submitted; a run whose task of an earlier submission of this study is
still in the queue (pending, running, requeued) is waited for, not submitted twice (``OUT/study.json`` keeps the array
ids). The study waits (``squeue`` every :data:`POLL_S` seconds) until its tasks have left the queue, a line per task
as it ends; ``--no-wait`` returns after submitting.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hosfl_dist.errors import ConfigError, HosflError
from hosfl_dist.experiments.launch import study as records
from hosfl_dist.experiments.launch.torchrun import ROOT

if TYPE_CHECKING:
    from hosfl_dist.config import Config
    from hosfl_dist.experiments.launch.worlds import World
    from hosfl_dist.experiments.runs import RunSpec

ARRAY_SCRIPT = ROOT / "slurm" / "study_array.sbatch"
RUN_SCRIPT = ROOT / "slurm" / "hosfl.sbatch"
POLL_S = 2.0
"""Seconds between two looks at the queue while the study waits."""
REQUEUED = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ConfigError(f"--launcher slurm needs {name} on PATH (a Slurm client; see slurm/README.md)")
    return path


def queued(record: dict[str, Any] | None, required: bool = True) -> dict[str, tuple[str, str]]:
    """Run folder -> (task, state) for the study's array tasks still in the queue (``12_3``, ``RUNNING``). Without
    ``squeue`` on PATH, or where it fails: nothing, unless ``required``."""
    subs = (record or {}).get("submissions") or []
    if not subs:
        return {}
    if shutil.which("squeue") is None and not required:
        return {}
    proc = subprocess.run([_tool("squeue"), "--me", "--noheader", "--array", "--format=%F|%K|%T"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    if proc.returncode != 0:
        if not required:
            return {}
        raise HosflError(f"squeue failed (exit code {proc.returncode}): {_last_line(proc.stderr)}")
    states = {}
    for line in proc.stdout.splitlines():
        array, _, rest = line.strip().partition("|")
        task, _, state = rest.partition("|")
        states[(array, task)] = state
    out = {}
    for sub in subs:
        for index, run in (sub.get("tasks") or {}).items():
            state = states.get((str(sub.get("array")), str(index)))
            if state:
                out[str(run)] = (f"{sub['array']}_{index}", state)
    return out


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def folder_name(number: int, world: World) -> str:
    """``3-nproc2``, ``4-nproc8-nodes2-gpus4``."""
    name = f"{number}-nproc{world.nproc}"
    return name + (f"-nodes{world.nodes}" if world.nodes > 1 else "") + (f"-gpus{world.gpus}" if world.gpus else "")


def sbatch_argv(
    world: World, n: int, folder: Path, threads: int, options: Sequence[str], name: str, jobs: int = 1
) -> list[str]:
    """The array's submission (our options first: an ``--sbatch`` option given again wins); ``jobs`` > 1: at most
    that many of its tasks run at once (``%jobs``)."""
    argv = [
        "sbatch",
        "--parsable",
        f"--array=0-{n - 1}" + (f"%{jobs}" if jobs > 1 else ""),
        f"--job-name={name}",
        f"--nodes={world.nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={world.per_node * threads}",
    ]
    if world.gpus:
        argv.append(f"--gpus-per-node={world.gpus}")
    argv += [f"--output={folder / '%A_%a.out'}", "--open-mode=append", "--requeue", "--signal=B:TERM@120"]
    return [*argv, *options, str(ARRAY_SCRIPT), str(folder / "tasks")]


def task_words(config: str, spec: RunSpec, start: list[str]) -> list[str]:
    """Task file lines: the run folder, the config, then the run's overrides (hosfl.sbatch puts job.resume=auto
    first)."""
    words = [str(spec.out_dir), str(Path(config).resolve()), *spec.all_overrides(), *start]
    bad = [w for w in words if "\n" in w or "\r" in w]
    if bad:
        raise ConfigError(f"{spec.variant}: an override holds a line break, which a task file cannot carry: {bad[0]!r}")
    return words


def environment(world: World, threads: int) -> dict[str, str]:
    """What the array's tasks read: the interpreter of this study, processes per node, threads, the run script; the
    caller's job token is left out (every task makes its own)."""
    env = {k: v for k, v in os.environ.items() if k != "HOSFL_JOB_TOKEN"}
    env.update(
        PYTHON=sys.executable,
        NPROC_PER_NODE=str(world.per_node),
        OMP_NUM_THREADS=str(threads),
        HOSFL_SBATCH=str(RUN_SCRIPT),
        PYTHONPATH=str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""),
    )
    return env


def submit(
    config: str,
    groups: dict[tuple[int, int, int], list[RunSpec]],
    cfgs: dict[Path, Config],
    out: Path,
    record: dict[str, Any] | None,
    threads: int,
    options: Sequence[str],
    dry_run: bool,
    jobs: int = 1,
) -> list[dict[str, Any]]:
    """One array per world; returns the submissions (also appended to the study record, written after each)."""
    from hosfl_dist.experiments.runs import start_overrides

    subs = []
    number = len((record or {}).get("submissions") or [])
    name = f"hosfl-{out.resolve().name}"[:64]
    for specs in groups.values():
        world = specs[0].world
        number += 1
        folder = out.resolve() / "slurm" / folder_name(number, world)
        argv = sbatch_argv(world, len(specs), folder, threads, options, name, jobs)
        tasks = [task_words(config, s, start_overrides(s, cfgs[s.out_dir])) for s in specs]
        if dry_run:
            env = environment(world, threads)
            print(" ".join([f"NPROC_PER_NODE={world.per_node}", f"OMP_NUM_THREADS={threads}",
                            *(shlex.quote(a) for a in argv)]))  # fmt: skip
            for i, words in enumerate(tasks):
                print(f"#   task {i}: CONFIG={shlex.quote(words[1])} {env['HOSFL_SBATCH']} "
                      + " ".join(shlex.quote(w) for w in words[2:]))  # fmt: skip
            continue
        (folder / "tasks").mkdir(parents=True, exist_ok=True)
        for i, words in enumerate(tasks):
            (folder / "tasks" / str(i)).write_text("".join(w + "\n" for w in words))
        argv[0] = _tool("sbatch")
        proc = subprocess.run(argv, capture_output=True, text=True, env=environment(world, threads), check=False)
        if proc.returncode != 0:
            raise HosflError(f"sbatch refused the array of {len(specs)} run(s) of {world.describe()} (exit code "
                             f"{proc.returncode}): {_last_line(proc.stderr)}")  # fmt: skip
        array = proc.stdout.strip().split(";")[0]
        sub = {
            "array": array,
            "folder": str(folder),
            "world": world.as_dict(),
            "tasks": {str(i): str(s.out_dir) for i, s in enumerate(specs)},
            "sbatch": argv,
            "submitted": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        if record is not None:
            record["submissions"].append(sub)
            records.write(out, record)  # at once: a job id is never lost
        subs.append(sub)
        print(f"submitted Slurm array {array}: {len(specs)} run(s) of {world.describe()} each (tasks and Slurm "
              f"output in {folder})")  # fmt: skip
    return subs


def wait(out: Path, record: dict[str, Any], specs: Sequence[RunSpec], cfgs: dict[Path, Config], collect: str) -> None:
    """Wait until the study's tasks for ``specs`` have left the queue: a line as each ends (and as one is requeued)."""
    from hosfl_dist.experiments.runs import is_finished, why_missing

    by_run = {str(s.out_dir): s for s in specs}
    live = {run: v for run, v in queued(record).items() if run in by_run}
    if not live:
        return
    print(f"waiting for {len(live)} Slurm task(s) ({', '.join(sorted({t.split('_')[0] for t, _ in live.values()}))})"
          f"; Ctrl-C stops waiting and leaves them running: {collect} reports them later", flush=True)  # fmt: skip
    t0 = time.perf_counter()
    try:
        while live:
            time.sleep(POLL_S)
            now = queued(record)
            for run, (task, state) in list(live.items()):
                spec = by_run[run]
                name = f"{spec.variant} seed {spec.seed} (Slurm task {task})"
                if run not in now:
                    del live[run]
                    cfg = cfgs[spec.out_dir]
                    took = f"{time.perf_counter() - t0:.1f} s"
                    if is_finished(spec, cfg):
                        print(f"[ok] {name}: completed, {took} after the wait began", flush=True)
                    else:
                        print(f"[FAILED] {name}: {why_missing(spec, cfg)}", flush=True)
                elif now[run][1] != state:
                    if state == "RUNNING" and now[run][1] in REQUEUED:
                        print(f"[requeued] {name}: {now[run][1].lower()} again; it resumes from its checkpoint",
                              flush=True)  # fmt: skip
                    live[run] = now[run]
    except KeyboardInterrupt:
        print(f"\nstopped waiting; {len(live)} Slurm task(s) go on: {collect} reports them later", flush=True)
        raise SystemExit(130) from None


def launch(
    config: str,
    specs: Sequence[RunSpec],
    out: Path,
    record: dict[str, Any] | None,
    threads: int,
    options: Sequence[str],
    dry_run: bool,
    no_wait: bool,
    jobs: int = 1,
) -> dict[str, Any] | None:
    """Submit the runs still to do, one array per world, and wait for them (or not: ``no_wait``); returns the record
    of what ran, or None when nothing was waited for (a dry run, ``--no-wait``)."""
    from hosfl_dist.experiments.runs import is_finished, split

    if not dry_run:
        _tool("sbatch")
    live = queued(record, required=not dry_run)
    cfgs, reused, todo = split(config, specs, dry_run)
    fresh = [s for s in todo if str(s.out_dir) not in live]
    for s in todo:
        if str(s.out_dir) in live:
            task, state = live[str(s.out_dir)]
            print(f"{'# ' if dry_run else ''}{s.out_dir}: {state.lower()} in Slurm as task {task} (submitted "
                  "before): waited for, not submitted again")  # fmt: skip
    groups: dict[tuple[int, int, int], list[RunSpec]] = {}
    for s in fresh:
        groups.setdefault(s.world.key(), []).append(s)
    start = time.perf_counter()
    subs = submit(config, groups, cfgs, out, record, threads, options, dry_run, jobs)
    if dry_run:
        return None
    collect = f"python -m hosfl_dist.experiments.collect {shlex.quote(str(out))}"
    if no_wait and todo:
        ids = sorted({sub["array"] for sub in subs} | {t.split("_")[0] for t, _ in live.values()})
        print(f"not waiting (--no-wait): Slurm array(s) {', '.join(ids)} hold {len(todo)} run(s); squeue --me shows "
              f"them; when they have ended: {collect}")  # fmt: skip
        return None
    if record is not None:
        wait(out, record, todo, cfgs, collect)
    done = [s for s in todo if is_finished(s, cfgs[s.out_dir])]
    return {
        "launched": [{"run": str(s.out_dir), "wall_time_s": _wall(s)} for s in done],
        "reused": [str(s.out_dir) for s in reused],
        "failed": [f"{s.out_dir} (see {s.out_dir / 'log.txt'})" for s in todo if s not in done],
        "wall_time_s": round(time.perf_counter() - start, 1),
        "threads": threads,
        "launcher": "slurm",
        "submitted": [{"array": sub["array"], "tasks": len(sub["tasks"]), "world": sub["world"]} for sub in subs],
    }


def _wall(spec: RunSpec) -> float | None:
    from hosfl_dist.runfolder.folder import recorded_summary

    return (recorded_summary(spec.out_dir) or {}).get("wall_time_s")


def wait_queued(out: Path) -> int:
    """Wait until none of the study's tasks is in the queue (``collect --wait``); returns how many were waited for."""
    record = records.read(out)
    live = queued(record)
    if not live:
        return 0
    print(f"waiting for {len(live)} Slurm task(s) of {out}", flush=True)
    n = len(live)
    while live:
        time.sleep(POLL_S)
        now = queued(record)
        for run in [r for r in live if r not in now]:
            print(f"[ended] Slurm task {live.pop(run)[0]}: {run}", flush=True)
    return n
