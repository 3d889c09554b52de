"""The run's folder: which one a run writes into, and whether it may.

When the user named no folder (``job.out_dir`` empty) every run gets its own::

    runs/<job.name>/20261123-221503/      a run started at that time (a second one in the same second gets -2)
    runs/<job.name>/latest -> 20261123-221503
    runs/<job.name>/slurm-<job id>/       under Slurm: a requeued job finds its folder again and continues it

``job.resume=auto`` (and a torchrun restart of the workers) continues ``latest``. A ``job.out_dir`` the user gave keeps
its contract: exactly that folder holds config.yaml, metrics.jsonl and summary.json.

A folder that holds another run is refused unless ``job.resume=auto`` (continue it, when its config is this run's) or
``job.overwrite=true`` (replace it): :func:`check_out_dir` checks without changing anything (``hosfl_dist.run
--check``), :func:`prepare_out_dir` makes the folder ready. Torch-free: ``hosfl_dist.run`` resolves and checks the
folder before anything heavy is imported.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from hosfl_dist.config import Config, config_to_dict
from hosfl_dist.errors import ConfigError
from hosfl_dist.runtime.process.launch import slurm_job_id

RUNS = Path("runs")
LATEST = "latest"
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json")
CHECKPOINTS = "checkpoints"
"""The folder of a run's checkpoints (see :mod:`hosfl_dist.runtime.checkpoint`)."""
VOLATILE_KEYS = {"job": ("out_dir", "resume", "overwrite", "progress", "device", "interface", "loggers", "threads")}
"""Keys that may differ between a run and its resumption (how it is started, not what it computes)."""


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


def config_differences(folder: Path, cfg: Config) -> list[str] | None:
    """The keys in which the run that ``folder`` holds differs from ``cfg`` (None: the folder holds no config),
    apart from how the run is started (the job keys of VOLATILE_KEYS)."""
    saved = folder / "config.yaml"
    if not saved.is_file():
        return None
    try:
        theirs = yaml.safe_load(saved.read_text()) or {}
    except yaml.YAMLError:
        return ["config.yaml (unreadable)"]
    return _differences(_comparable(theirs), _comparable(config_to_dict(cfg)))


def input_files(cfg: Config) -> dict[str, dict[str, str]]:
    """The files a run reads that its config names only by path, with their SHA-256 (``model.pretrained``), so a
    result says which weights it started from, and a finished run is reused only while the file is the same."""
    path = cfg.model.pretrained
    if not path or not Path(path).is_file():
        return {}
    st = Path(path).stat()
    return {"model.pretrained": {"path": str(path), "sha256": _file_sha256(str(path), st.st_mtime_ns, st.st_size)}}


@functools.lru_cache(maxsize=16)
def _file_sha256(path: str, mtime_ns: int, size: int) -> str:
    """file_sha256 once per version of a file: compare / sweep check every run of a grid against the same one."""
    from hosfl_dist.core.digest import file_sha256  # torch: imported where a run's inputs are hashed

    return file_sha256(path)


def input_differences(folder: Path, cfg: Config) -> list[str]:
    """The inputs the run in ``folder`` recorded with another SHA-256 than the files have now (none for a summary
    written before inputs were recorded)."""
    try:
        recorded = json.loads((folder / "summary.json").read_text()).get("inputs") or {}
    except (OSError, ValueError):
        return []
    now = input_files(cfg) if recorded else {}
    return [key for key, rec in recorded.items() if key in now and now[key]["sha256"] != rec.get("sha256")]


def run_status(folder: Path) -> str | None:
    """The status summary.json records in ``folder`` (None: no summary)."""
    try:
        return str(json.loads((folder / "summary.json").read_text()).get("status", "unknown"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "unknown"


def _comparable(cfg: dict[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in cfg.items()}
    for section, keys in VOLATILE_KEYS.items():
        for k in keys:
            out.get(section, {}).pop(k, None)
    return out


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differences(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]


def holds_run(d: Path) -> bool:
    """Whether folder ``d`` holds a run's files or checkpoints."""
    return any((d / f).exists() for f in (*RUN_FILES, CHECKPOINTS))


def check_out_dir(cfg: Config, restarted: bool = False) -> Path:
    """Refuse an unusable job.out_dir, or one that holds a run this one may not continue or replace, without
    changing anything (``hosfl_dist.run --check`` runs it before torchrun starts the job)."""
    d = Path(cfg.job.out_dir)
    for parent in [d, *d.parents]:
        if parent.exists():
            if parent.is_file():
                where = "is a file" if parent == d else f"lies under a file ({parent})"
                raise ConfigError(f"job.out_dir {d} {where}, not a folder")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ConfigError(f"job.out_dir {d} is not writable ({parent}: permission denied)")
            break
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


def completed_already(cfg: Config) -> bool:
    """``job.resume=auto`` on a folder whose run (this config) completed: nothing is left to do, and nothing there
    may be touched (a finished result is never replaced by its own continuation)."""
    d = Path(cfg.job.out_dir)
    return cfg.job.resume == "auto" and run_status(d) == "completed" and config_differences(d, cfg) == []


def prepare_out_dir(cfg: Config, restarted: bool = False) -> Path | None:
    """Make job.out_dir ready for this run; the checkpoint to resume from, or None to start afresh.

    A folder that holds a run is continued with ``job.resume=auto`` (or when torchrun restarted the job) if its
    config is this run's, replaced with ``job.overwrite=true``, and refused otherwise.
    """
    from hosfl_dist.runtime.checkpoint import latest_checkpoint

    d = check_out_dir(cfg, restarted)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"job.out_dir {d} cannot be created: {exc.strerror or exc}") from None
    probe = d / ".write_test"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"job.out_dir {d} is not writable: {exc.strerror or exc}") from None
    if not holds_run(d):
        return None
    if cfg.job.overwrite:
        clear_run(d)
        return None
    ckpt = latest_checkpoint(d)
    if ckpt is None:  # nothing to continue from: the partial run is replaced
        clear_run(d)
    return ckpt


def clear_run(d: Path) -> None:
    """Remove a run's files and checkpoints from its folder (other files are left alone)."""
    for f in RUN_FILES:
        (d / f).unlink(missing_ok=True)
    shutil.rmtree(d / CHECKPOINTS, ignore_errors=True)
