"""The run's folder: which one a run writes into, whether it may, and how the run in it stands.

When the user named no folder (``job.out_dir`` empty) every run gets its own::

    runs/<job.name>/20261123-221503/      a run started at that time (a second one in the same second gets -2)
    runs/<job.name>/latest -> 20261123-221503
    runs/<job.name>/slurm-<job id>/       under Slurm: a requeued job finds its folder again and continues it

``job.resume=auto`` continues ``latest``. A torchrun restart of the workers continues the folder its own first attempt
chose, never ``latest`` (another run of the same ``job.name`` may have started meanwhile): the first attempt pins it
in ``runs/<job.name>/.torchrun/<hash>``, named after the torchrun invocation (its rendezvous id, or its agent process),
and a restart reads that pin. A ``job.out_dir`` the user gave keeps its contract: exactly that folder holds
config.yaml, metrics.jsonl and summary.json.

A folder that holds another run is refused unless ``job.resume=auto`` (continue it, when its config is this run's) or
``job.overwrite=true`` (replace it): :func:`check_out_dir` checks without changing anything (``hosfl_dist.run
--check``), :func:`prepare_out_dir` makes the folder ready. How the run stands (:func:`run_status`,
:func:`describe_status`: ``hosfl_dist.run --status``) is its summary.json read beside its lock (:mod:`.lock`): a run
recorded as running that no live process holds died. Torch-free: ``hosfl_dist.run`` resolves and checks the folder
before anything heavy is imported.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from hosfl_dist.config import Config
from hosfl_dist.config.environment import slurm_job_id
from hosfl_dist.errors import ConfigError
from hosfl_dist.runfolder.checkpoints import CHECKPOINTS, checkpoint_folders, signed_manifest
from hosfl_dist.runfolder.signing import load_key
from hosfl_dist.runfolder.lock import RunLock, lock_holder, wait_for_earlier_start
from hosfl_dist.safe_files import check_folder_entries, check_output_folder, replace_file
from hosfl_dist.safe_yaml import load_file

RUNS = Path("runs")
LATEST = "latest"
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "participation.jsonl")


def chosen(cfg: Config) -> bool:
    """Whether the user named the run's folder (then it is used exactly as given)."""
    return bool(cfg.job.out_dir)


def deterministic_out_dir(cfg: Config, restarted: bool = False, pin: str = "") -> Path | None:
    """The folder every process of the job finds on its own (the user's, Slurm's, the one a torchrun invocation
    ``pin`` pinned when ``restarted``, or ``latest`` when continuing), or None when a new folder has to be made
    (:func:`new_out_dir`, by one process)."""
    if chosen(cfg):
        return Path(cfg.job.out_dir)
    base = RUNS / cfg.job.name
    job_id = slurm_job_id()
    if job_id:
        return base / f"slurm-{job_id}"
    if restarted and pin:  # this invocation's own folder; none pinned: its first attempt made none, so a new one
        return pinned_out_dir(base, pin)
    latest = base / LATEST
    if (cfg.job.resume == "auto" or restarted) and latest.is_symlink():
        return base / os.readlink(latest)
    return None


PINS = ".torchrun"
"""The folder of ``runs/<job.name>`` that holds, per torchrun invocation, the name of the run folder it chose."""


def _pin_file(base: Path, pin: str) -> Path:
    return base / PINS / hashlib.sha256(pin.encode()).hexdigest()[:24]


def pinned_out_dir(base: Path, pin: str) -> Path | None:
    """The run folder under ``base`` that the torchrun invocation ``pin`` chose on its first attempt, or None (none
    pinned, or a pin that names no folder of ``base``)."""
    try:
        name = _pin_file(base, pin).read_text(encoding="utf-8").strip()
    except (OSError, ValueError):
        return None
    if not name or name in (".", "..", LATEST, PINS) or "/" in name or "\\" in name or not (base / name).is_dir():
        return None
    return base / name


def pin_out_dir(d: Path, pin: str) -> None:
    """Record (atomically) that the torchrun invocation ``pin`` writes the run folder ``d`` (under runs/<job.name>)."""
    path = _pin_file(d.parent, pin)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, d.name + "\n", tmp=path.with_name(f".{path.name}.{os.getpid()}"))


def new_out_dir(cfg: Config) -> Path:
    """Create ``runs/<job.name>/<start time>`` (unique: -2, -3, … within one second) and point ``latest`` at it."""
    base = RUNS / cfg.job.name
    base.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        d = base / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            d.mkdir()
        except FileExistsError:
            continue
        point_latest(base, d.name)
        return d
    raise RuntimeError(f"no free run folder under {base} for {stamp}")


def point_latest(base: Path, name: str) -> None:
    """``base/latest`` -> ``name``, replaced atomically (a reader sees the old link or the new one)."""
    tmp = base / f".{LATEST}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(name)
    tmp.replace(base / LATEST)


def with_out_dir(cfg: Config, d: Path | str) -> Config:
    return dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, out_dir=str(d)))


def resolve_out_dir(cfg: Config, restarted: bool = False, pin: str = "") -> Config:
    """``cfg`` with ``job.out_dir`` set to this run's folder (made here when it is a new one; the process that calls
    this is the one that writes the run: in-process, or rank 0 under torchrun). ``pin``: the torchrun invocation
    (:attr:`~hosfl_dist.runtime.process.launch.LaunchEnv.invocation`), whose restarts find this folder again."""
    d = deterministic_out_dir(cfg, restarted, pin)
    if d is not None:
        if not chosen(cfg) and d.name.startswith("slurm-"):
            d.mkdir(parents=True, exist_ok=True)
            point_latest(d.parent, d.name)
    else:
        d = new_out_dir(cfg)
    if pin and not chosen(cfg) and not d.name.startswith("slurm-"):
        pin_out_dir(d, pin)
    return with_out_dir(cfg, d)


def recorded_config(folder: Path) -> dict[str, Any] | None:
    """The config of the run ``folder`` holds, as identity (:func:`~.identity.comparable`): from its newest checkpoint
    whose manifest is intact and signed by this user's key (what a resume continues; an unsigned or forged manifest
    says nothing here), else from its config.yaml; None when it holds neither."""
    from hosfl_dist.runfolder.identity import comparable

    key = load_key() if checkpoint_folders(folder) else None
    for ckpt in checkpoint_folders(folder):
        manifest = signed_manifest(ckpt, key)
        config = ((manifest or {}).get("identity") or {}).get("config")
        if isinstance(config, dict):
            return config
    saved = folder / "config.yaml"
    if not saved.is_file():
        return None
    try:
        theirs = load_file(saved, "config.yaml") or {}
    except (OSError, ConfigError):  # too big, an alias bomb, a duplicate key: not a config this project wrote
        return {"config.yaml": "unreadable"}
    return comparable(theirs) if isinstance(theirs, dict) else {"config.yaml": "unreadable"}


def config_differences(folder: Path, cfg: Config) -> list[str] | None:
    """The config keys in which the run that ``folder`` holds differs from ``cfg`` (None: it holds no config), apart
    from how a run is started (:data:`~.identity.RUNTIME_ONLY`)."""
    from hosfl_dist.runfolder.identity import comparable_config, config_key_differences

    theirs = recorded_config(folder)
    return None if theirs is None else config_key_differences(theirs, comparable_config(cfg))


def input_differences(folder: Path, cfg: Config) -> list[str]:
    """The inputs the run in ``folder`` recorded with another content than they have now, or that one of the two
    runs reads and the other does not (a summary written before every input was recorded: the inputs it names)."""
    from hosfl_dist.runfolder.identity import identity_differences, input_files

    summary = recorded_summary(folder) or {}
    recorded = summary.get("inputs") or {}
    if not isinstance(recorded, dict) or not recorded:
        return []
    now = input_files(cfg)
    if "fingerprint" not in summary:  # written by an earlier version, which recorded model.pretrained alone
        now = {role: entry for role, entry in now.items() if role in recorded}
    return identity_differences({"inputs": recorded}, {"inputs": now}, code=False)


def recorded_summary(folder: Path) -> dict[str, Any] | None:
    """summary.json of ``folder`` (None: none, or unreadable)."""
    try:
        data = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def run_status(folder: Path) -> str | None:
    """How the run in ``folder`` stands (None: no summary): what summary.json records, except that a run recorded as
    ``running`` whose folder no live process holds is ``died`` (killed before it could record its end)."""
    if not (folder / "summary.json").exists():
        return None
    summary = recorded_summary(folder)
    if summary is None:
        return "unknown"
    status = str(summary.get("status", "unknown"))
    if status == "running" and lock_holder(folder) is None:
        return "died"  # what a reader makes of it; --status --record-death writes it into summary.json
    return status


DIED = "its processes ended without recording how (killed, out of memory, or the machine went down)"


def describe_status(folder: Path) -> str:
    """One line on how the run in ``folder`` stands (``python -m hosfl_dist.run --status DIR``)."""
    status = run_status(folder)
    if status is None:
        return f"{folder}: holds no run" if not holds_run(folder) else f"{folder}: a run without summary.json"
    summary = recorded_summary(folder) or {}
    if status == "running":
        return f"{folder}: running ({lock_holder(folder)})" + _live_workers(folder)
    if status in ("completed", "stopped"):
        final = summary.get("final") or {}
        stopped = summary.get("stopped") or {}
        why = ": ".join(str(part) for part in (stopped.get("by"), stopped.get("reason")) if part)
        early = f" early ({why})" if status == "stopped" else ""
        note = f"; then {summary['callback_error']}" if summary.get("callback_error") else ""
        return (f"{folder}: {status}{early}, {summary.get('rounds')} rounds, {summary.get('processed_samples')} "
                f"samples, eval_accuracy {final.get('eval_accuracy')}{note}")  # fmt: skip
    if status == "died":
        said = "recorded in summary.json" if summary.get("status") == "died" else "summary.json still says running"
        return f"{folder}: died: {DIED} (started {summary.get('started', '?')}; {said})"
    if status == "interrupted":
        then = f"resume from {summary['checkpoint']}" if summary.get("checkpoint") else "it holds no checkpoint"
        return f"{folder}: interrupted: {summary.get('error')}; {then}"
    return f"{folder}: {status}" + (f": {summary['error']}" if summary.get("error") else "")


def _live_workers(folder: Path) -> str:
    """An elastic run's live workers (its ``workers.json``), as the end of its status line."""
    try:
        record = json.loads((folder / "workers.json").read_text())
        workers = record["workers"]
        since = max(0.0, time.time() - float(record.get("written_at", time.time())))  # the file's age
        shown = []
        for name, w in workers.items():
            heard = float(w["last_heard_s"]) + since
            beat = float(w.get("timeout_s", 30)) / 4  # a worker beats every quarter of server.worker_timeout_s
            state = f"silent for {heard:.0f} s: a heartbeat missed" if heard > 2 * beat else f"heard {heard:.0f} s ago"
            shown.append(f"{name} (pid {w.get('pid', '?')} on {w.get('host', '?')}, {len(w['clients'])} clients, "
                         f"{state})")  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""
    lost, joined = record.get("workers_lost", 0), record.get("workers_joined", 0)
    return f"; elastic: {len(shown)} live worker(s): {', '.join(shown) or 'none'}; {joined} joined, {lost} lost"


def record_death(folder: Path) -> bool:
    """Write ``died`` into the summary.json of a run that :func:`run_status` finds dead (its summary says running and
    no live process holds its folder); True if it did. Under the folder's lock, so a run starting meanwhile is left
    alone."""
    if run_status(folder) != "died":
        return False
    lock = RunLock(folder)
    try:
        lock.acquire()
    except ConfigError:  # a run took the folder meanwhile: it is not dead
        return False
    try:
        summary = recorded_summary(folder)
        if summary is None or summary.get("status") != "running":
            return False
        summary.update(status="died", error=f"{DIED} (found and recorded by --record-death)")
        replace_file(folder / "summary.json", json.dumps(summary, indent=2) + "\n")
        return True
    finally:
        lock.release()


def holds_run(d: Path) -> bool:
    """Whether folder ``d`` holds a run's files or checkpoints."""
    return any((d / f).exists() for f in (*RUN_FILES, CHECKPOINTS))


def run_in_the_way(dest: Path, most: int = 100_000, below: bool = True) -> Path | None:
    """A run folder that writing ``dest`` (a file or a folder a command would replace) could destroy: one that holds
    ``dest`` (``dest`` resolved through its symlinks, then each folder above it), or, with ``below``, one below a
    ``dest`` folder (its first ``most`` folders looked at). None when there is none."""
    target = dest.resolve()
    for folder in (target, *target.parents):
        if _is_run(folder):
            return folder
    if below and target.is_dir():
        for i, (folder, _, _) in enumerate(os.walk(target, followlinks=False)):
            if i >= most:
                break
            if _is_run(Path(folder)):
                return Path(folder)
    return None


def refuse_run_in_the_way(dest: Path, flag: str, below: bool = True) -> None:
    """Refuse, in one line, a destination ``dest`` (given as ``flag``) that is, lies inside or (with ``below``) holds
    a run's folder (:func:`run_in_the_way`): whatever a command writes there could replace a run's record or
    checkpoints."""
    run = run_in_the_way(dest, below=below)
    if run is not None:
        where = "holds" if run != dest.resolve() and run.is_relative_to(dest.resolve()) else "is inside"
        raise ConfigError(f"{flag} {dest} {where} the run folder {run}: write it elsewhere (a run's files are never "
                          "replaced)")  # fmt: skip


def _is_run(d: Path) -> bool:
    """A run's folder: its config.yaml beside its summary, metrics or checkpoints (a config.yaml alone is not one)."""
    try:
        return (d / "config.yaml").is_file() and any((d / f).exists() for f in (*RUN_FILES[1:], CHECKPOINTS))
    except OSError:  # a folder that cannot be read is not known to be a run
        return False


EARLIER_START_GRACE_S = 60.0
"""How much longer than ``server.rpc_timeout_s`` a restarted Slurm job waits for its earlier start to let go."""


def check_out_dir(cfg: Config, restarted: bool = False, locked: bool = False) -> Path:
    """Refuse an unusable job.out_dir, one a live run holds, or one that holds a run this one may not continue or
    replace, without changing anything (``hosfl_dist.run --check`` runs it before torchrun starts the job).
    ``locked``: this process holds the folder's lock already."""
    d = Path(cfg.job.out_dir)
    check_output_folder(d, "job.out_dir")  # a device, a FIFO, a file: refused before anything is made
    check_folder_entries(d, "job.out_dir")  # metrics.jsonl a FIFO, summary.json a link out of the folder
    for parent in [d, *d.parents]:
        if parent.exists():
            if parent.is_file():
                where = "is a file" if parent == d else f"lies under a file ({parent})"
                raise ConfigError(f"job.out_dir {d} {where}, not a folder")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ConfigError(f"job.out_dir {d} is not writable ({parent}: permission denied)")
            break
    around = next((p for p in d.resolve().parents if _is_run(p)), None)
    if around is not None:  # its files would go among another run's (a checkpoint's folder, pruned with it)
        raise ConfigError(f"job.out_dir {d} lies inside the run folder {around}; choose a folder of its own")
    holder = None if locked else wait_for_earlier_start(d, cfg.server.rpc_timeout_s + EARLIER_START_GRACE_S)
    if holder is not None:
        raise ConfigError(f"job.out_dir {d} is in use by a live run ({holder}); wait for it to end or choose another "
                          "folder")  # fmt: skip
    if not holds_run(d) or cfg.job.overwrite:
        return d
    if cfg.job.resume == "auto" or restarted:
        diff = config_differences(d, cfg)
        if diff:
            raise ConfigError(
                f"job.out_dir {d} holds a different run (its config differs in {', '.join(diff[:5])}); "
                "choose another folder or set job.overwrite=true"
            )
        return d
    raise ConfigError(
        f"job.out_dir {d} holds a run (status: {run_status(d) or 'no summary'}); set job.resume=auto to continue it or "
        "job.overwrite=true to replace it"
    )


def finished(folder: Path) -> bool:
    """Whether the run in ``folder`` ended as its config says a run ends: it completed its budget, or its own
    ``train.early_stopping`` stopped it (the same criterion, applied to the same rows, would stop it again). A run a
    callback or ``run.should_stop`` stopped (user code, not part of the run's identity) is not: ``job.resume=auto``
    continues it from its final checkpoint toward its budget."""
    status = run_status(folder)
    if status == "completed":
        return True
    stopped = (recorded_summary(folder) or {}).get("stopped")
    return status == "stopped" and isinstance(stopped, dict) and stopped.get("by") == EARLY_STOPPING


EARLY_STOPPING = "train.early_stopping"
"""summary.json's ``stopped.by`` of a run its own early-stopping criterion ended."""


def completed_already(cfg: Config) -> bool:
    """``job.resume=auto`` on a folder whose run (this config) is :func:`finished`: nothing is left to do, and nothing
    there may be touched (a finished result is never replaced by its own continuation)."""
    d = Path(cfg.job.out_dir)
    return cfg.job.resume == "auto" and finished(d) and config_differences(d, cfg) == []


def prepare_out_dir(cfg: Config, restarted: bool = False) -> tuple[list[Path], RunLock]:
    """Make job.out_dir ready for this run and lock it: the checkpoints a resume may start from (newest first; none
    to start afresh), and the lock this process holds until the run ends.

    A folder that holds a run is continued with ``job.resume=auto`` (or when torchrun restarted the job) if its
    config is this run's, replaced with ``job.overwrite=true``, and refused otherwise; a folder a live run holds is
    refused whatever the keys say.
    """
    d = check_out_dir(cfg, restarted)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"job.out_dir {d} cannot be created: {exc.strerror or exc}") from None
    lock = RunLock(d)
    lock.acquire()  # refuses a run that started between the check and here
    try:
        check_out_dir(cfg, restarted, locked=True)  # under the lock: what the folder holds cannot change any more
    except BaseException:
        lock.release()
        raise
    if not holds_run(d):
        return [], lock
    if cfg.job.overwrite:
        clear_run(d)
        return [], lock
    found = checkpoint_folders(d)
    if not found:  # nothing to continue from: the partial run is replaced
        clear_run(d)
    return found, lock


def clear_run(d: Path) -> None:
    """Remove a run's files and checkpoints from its folder (other files are left alone)."""
    for f in RUN_FILES:
        (d / f).unlink(missing_ok=True)
    shutil.rmtree(d / CHECKPOINTS, ignore_errors=True)
