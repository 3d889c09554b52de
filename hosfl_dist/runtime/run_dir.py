"""The run's folder when the user did not choose one (``job.out_dir`` empty): every run gets its own.

    runs/<job.name>/20261123-221503/      a run started at that time (a second one in the same second gets -2)
    runs/<job.name>/latest -> 20261123-221503
    runs/<job.name>/slurm-<job id>/       under Slurm: a requeued job finds its folder again and continues it

``job.resume=auto`` (and a torchrun restart of the workers) continues ``latest``. A ``job.out_dir`` the user gave keeps
its contract: exactly that folder holds config.yaml, metrics.jsonl and summary.json. Torch-free: ``hosfl_dist.run``
resolves the folder before anything heavy is imported.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from hosfl_dist.config import Config
from hosfl_dist.runtime.env import slurm_job_id

RUNS = Path("runs")
LATEST = "latest"


def chosen(cfg: Config) -> bool:
    """Whether the user named the run's folder (then it is used exactly as given)."""
    return bool(cfg.job.out_dir)


def deterministic_out_dir(cfg: Config, restarted: bool = False) -> Path | None:
    """The folder every process of the job finds on its own (the user's, Slurm's, or ``latest`` when continuing),
    or None when a new folder has to be made (:func:`new_out_dir`, by one process)."""
    if chosen(cfg):
        return Path(cfg.job.out_dir)
    base = RUNS / cfg.job.name
    job_id = slurm_job_id()
    if job_id:
        return base / f"slurm-{job_id}"
    latest = base / LATEST
    if (cfg.job.resume == "auto" or restarted) and latest.is_symlink():
        return base / os.readlink(latest)
    return None


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


def resolve_out_dir(cfg: Config, restarted: bool = False) -> Config:
    """``cfg`` with ``job.out_dir`` set to this run's folder (made here when it is a new one; the process that calls
    this is the one that writes the run: in-process, or rank 0 under torchrun)."""
    d = deterministic_out_dir(cfg, restarted)
    if d is not None:
        if not chosen(cfg) and d.name.startswith("slurm-"):
            d.mkdir(parents=True, exist_ok=True)
            point_latest(d.parent, d.name)
        return with_out_dir(cfg, d)
    return with_out_dir(cfg, new_out_dir(cfg))
