"""Who holds a run's folder: the lock of the process that writes the run (:class:`RunLock`), read by whoever asks
whether a run is live (:func:`lock_holder`), and waited for by a requeued Slurm job (:func:`wait_for_earlier_start`);
and who holds a study's folder (:class:`StudyLock`: compare, sweep, scaling and collect, for the whole command).
Torch-free."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

from hosfl_dist.config.environment import slurm_start
from hosfl_dist.errors import ConfigError

LOCK = ".lock"
"""The file a live run holds an exclusive lock on (:class:`RunLock`)."""
STUDY_LOCK = ".study.lock"
"""The file a live study holds an exclusive lock on, in its ``--out`` (:class:`StudyLock`)."""


class RunLock:
    """An exclusive lock on a run's folder (``flock`` on ``<folder>/.lock``), held by the process that writes the run
    from its start to its end: another run, a resume or an overwrite into the folder is refused while it lives, and
    the kernel releases it when the process dies however it dies, so a reader can tell a live run from a dead one
    (:func:`lock_holder`). Local file systems; NFS honours flock only where its mount does."""

    FILE = LOCK
    NAME = "job.out_dir"
    HOLDER = "a live run"

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._fd: int | None = None

    def acquire(self) -> None:
        import fcntl
        import socket

        try:
            fd = os.open(self.folder / self.FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigError(f"{self.NAME} {self.folder}: cannot lock it ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = lock_holder(self.folder, self.FILE) or "a process that holds its lock"
            raise ConfigError(f"{self.NAME} {self.folder} is in use by {self.HOLDER} ({holder}); wait for it to end "
                              "or choose another folder") from None  # fmt: skip
        except OSError as exc:
            os.close(fd)
            raise ConfigError(f"{self.NAME} {self.folder}: cannot lock it ({exc.strerror or exc})") from None
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        job = slurm_start()
        of_job = f", Slurm job {job[0]} start {job[1]}" if job else ""
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}{of_job}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


class StudyLock(RunLock):
    """An exclusive lock on a study's ``--out`` (``<out>/.study.lock``), held by a compare, sweep, scaling or collect
    command for its whole life: a second study into the folder is refused in one line naming the holder, and only
    the holder writes the study's record and report (study.json, table.md, table.json, the plots, scaling.md)."""

    FILE = STUDY_LOCK
    NAME = "--out"
    HOLDER = "a live study"


def lock_holder(folder: Path, name: str = LOCK) -> str | None:
    """Who holds ``folder``'s run lock (``name``: or another of its locks; ``pid … on host, since …``), or None when
    no live process does."""
    import fcntl

    try:
        fd = os.open(Path(folder) / name, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.read(fd, 512).decode(errors="replace").strip() or "a live process"
        except OSError:
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


_SLURM_START = re.compile(r", Slurm job ([0-9]+) start ([0-9]+)$")


def wait_for_earlier_start(folder: Path, limit_s: float) -> str | None:
    """Who holds ``folder``'s run lock (:func:`lock_holder`), after waiting for it to let go where the holder is an
    earlier start of this process's own Slurm job, at most ``limit_s``.

    A job requeued because a node died can start again while its first start's processes on the nodes that lived
    are still stopping (their server waits ``server.rpc_timeout_s`` for the dead workers after Slurm's SIGTERM, and
    with proctrack/linuxproc a rank whose torchrun was killed first is no longer Slurm's to kill). The new start
    waits for them instead of failing on a folder that is about to be free; any other holder is answered at once."""
    holder = lock_holder(folder)
    job = slurm_start()
    if holder is None or job is None:
        return holder
    found = _SLURM_START.search(holder)
    if found is None or found.group(1) != job[0] or int(found.group(2)) >= job[1]:
        return holder
    print(f"job.out_dir {folder} is still held by start {found.group(2)} of this Slurm job ({holder}); waiting up to "
          f"{limit_s:g} s for it to stop", file=sys.stderr, flush=True)  # fmt: skip
    deadline = time.monotonic() + limit_s
    while holder is not None and time.monotonic() < deadline:
        time.sleep(0.5)
        holder = lock_holder(folder)
    if holder is not None:
        return f"{holder}; start {found.group(2)} of this job did not stop within {limit_s:g} s: end that process"
    return None
