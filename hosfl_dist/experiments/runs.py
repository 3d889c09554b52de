"""Launching the runs of an experiment (one subprocess each), reusing the ones already finished, and reading them.

A run lives in its own folder with the outputs of ``hosfl_dist.run`` (config.yaml, metrics.jsonl, summary.json,
checkpoints/) plus ``log.txt`` (its stdout and stderr). A folder whose summary says ``completed`` and whose
config.yaml is the config the run would get now is reused as is; an unfinished run of the same config is continued
from its latest checkpoint (``job.resume=auto``); a folder holding another setting is run again
(``job.overwrite=true``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hosfl_dist.config import Config, load_config
from hosfl_dist.errors import ConfigError, HosflError
from hosfl_dist.runtime.record.folder import config_differences, input_differences, run_status


@dataclass
class RunSpec:
    """One run: which row of the report it belongs to (a method or a grid point), its seed and overrides."""

    variant: str
    seed: int
    overrides: list[str]
    out_dir: Path

    def all_overrides(self) -> list[str]:
        return [*self.overrides, f"job.seed={self.seed}", f"job.out_dir={self.out_dir}", "job.progress=false"]


@dataclass
class RunData:
    spec: RunSpec
    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


def resolve(config: str | None, spec: RunSpec) -> Config:
    """The config the run will get (validates every override before anything starts)."""
    try:
        return load_config(config, spec.all_overrides())
    except ConfigError as exc:
        raise ConfigError(f"{spec.variant} seed {spec.seed}: {exc}") from None


def is_finished(spec: RunSpec, cfg: Config) -> bool:
    """A completed run of exactly this config (but for how it was started), from inputs of the same content."""
    return (
        run_status(spec.out_dir) == "completed"
        and config_differences(spec.out_dir, cfg) == []
        and not input_differences(spec.out_dir, cfg)
    )


def command(config: str | None, spec: RunSpec, cfg: Config | None = None) -> list[str]:
    """The run's command: it continues an unfinished run of the same config and replaces another setting's."""
    cmd = [sys.executable, "-m", "hosfl_dist.run"]
    if config:
        cmd += ["--config", str(config)]
    diff = config_differences(spec.out_dir, cfg) if cfg is not None else None
    if diff == [] and cfg is not None and input_differences(spec.out_dir, cfg):
        diff = ["inputs (other content)"]  # the same config over other data or weights: a new run
    start = [] if diff is None else ["job.resume=auto"] if not diff else ["job.overwrite=true"]
    return cmd + spec.all_overrides() + start


def launch(
    config: str | None, specs: Sequence[RunSpec], jobs: int = 1, threads: int = 1, dry_run: bool = False
) -> dict[str, Any]:
    """Run the unfinished specs, ``jobs`` at a time, each with ``threads`` intra-op threads; returns a record of
    what ran (launched, reused, failed runs, and the wall time of this invocation)."""
    if jobs < 1 or threads < 1:
        raise ConfigError(f"--jobs and --threads must be >= 1 (got {jobs}, {threads})")
    todo = []
    reused = []
    cfgs = {}
    for spec in specs:
        cfgs[spec.out_dir] = cfg = resolve(config, spec)
        (reused if is_finished(spec, cfg) else todo).append(spec)
    for spec in reused:  # a comment line in a dry run's list of commands
        print(f"{'# ' if dry_run else ''}reusing {spec.out_dir} (completed, same identity: config and inputs)")
    if dry_run:
        for spec in todo:
            print(" ".join(command(config, spec, cfgs[spec.out_dir])))
        return {"launched": [], "reused": [str(s.out_dir) for s in reused], "failed": [], "wall_time_s": 0.0}
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    start = time.perf_counter()

    def one(spec: RunSpec) -> tuple[RunSpec, int, float]:
        spec.out_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(spec.out_dir / "log.txt", "w") as log:
            cmd = command(config, spec, cfgs[spec.out_dir])
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
        took = time.perf_counter() - t0
        line = f"[{'ok' if rc == 0 else f'FAILED rc={rc}'}] {spec.variant} seed {spec.seed}: {took:.1f} s\n"
        sys.stdout.write(line)  # one write per line: runs finish in parallel threads
        sys.stdout.flush()
        return spec, rc, took

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(one, todo))
    return {
        "launched": [{"run": str(s.out_dir), "wall_time_s": round(w, 1)} for s, rc, w in results if rc == 0],
        "reused": [str(s.out_dir) for s in reused],
        "failed": [f"{s.out_dir} (see {s.out_dir / 'log.txt'})" for s, rc, _ in results if rc != 0],
        "wall_time_s": round(time.perf_counter() - start, 1),
        "jobs": jobs,
        "threads": threads,
    }


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
