"""What every benchmark shares: how a figure and a benchmark are declared, the record a run writes
(``<out>/<name>.json``), and the process helpers of the benchmarks that start torchrun jobs.

A benchmark module (``bench/<module>.py``) measures and returns its raw data; its ``figures(data)`` names the
declared figures in that data; :func:`write_record` puts each value beside the target and floor the declaration
(``bench/suite.py``) gives it. This module imports neither torch nor hosfl_dist, so ``python -m bench list`` is quick.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "out"  # ignored by git
SENSES = {"<=": "≤", ">=": "≥", "=": "="}

Value = float | int | bool | None


@dataclass(frozen=True)
class Figure:
    """One number a benchmark measures. ``target``: what an issue set for it, met when ``value <sense> target``;
    ``floor``: what the value cannot go below, a number, or a sentence saying how each run measures it (the run then
    records the measured number)."""

    name: str
    unit: str
    meaning: str
    target: float | bool | None = None
    sense: str = "<="
    floor: float | str | None = None

    def __post_init__(self) -> None:
        if self.sense not in SENSES:
            raise ValueError(f"figure {self.name}: sense {self.sense!r} is not one of {', '.join(SENSES)}")

    def met(self, value: Value) -> bool | None:
        """Whether ``value`` meets the target: None without a target or without a value."""
        if value is None or self.target is None:
            return None
        if self.sense == "=":
            return value == self.target
        return value <= self.target if self.sense == "<=" else value >= self.target

    def target_text(self) -> str:
        return "–" if self.target is None else f"{SENSES[self.sense]} {_short(self.target)}"

    def floor_text(self) -> str:
        if self.floor is None:
            return "–"
        return f"measured: {self.floor}" if isinstance(self.floor, str) else _short(self.floor)


@dataclass(frozen=True)
class Benchmark:
    """A benchmark of the suite: the module that measures, the options the suite runs it with, and its figures."""

    name: str
    module: str
    measures: str
    takes: str
    figures: tuple[Figure, ...]
    options: tuple[str, ...] = field(default=())
    gpu: bool = False
    """Needs a CUDA device: ``python -m bench run`` skips it, saying so, where there is none."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.figures)

    def figure(self, name: str) -> Figure:
        for f in self.figures:
            if f.name == name:
                return f
        raise KeyError(f"benchmark {self.name} declares no figure {name!r} (bench/suite.py)")

    def argv(self, out: Path, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
        """The command that runs it alone, writing ``out/<name>.json``."""
        return ["python", "-m", self.module, *self.options, *extra, "--out", display(out)]


def _short(x: float | bool) -> str:
    return str(x).lower() if isinstance(x, bool) else f"{x:g}"


def display(path: Path | str) -> str:
    """A path as a command line shows it: relative to the repository root where it lies inside it."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options every benchmark takes: where its record goes, and (from ``python -m bench run``) the suite's
    command, recorded beside its own."""
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder of the record <out>/<name>.json [bench/out]")
    p.add_argument("--via", default=None, help=argparse.SUPPRESS)
    return p


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def commit(tree: Path = ROOT) -> str:
    """A checkout's commit, "+ changes" when its tracked files differ from it; "" outside a git checkout."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
    if head.returncode != 0:
        return ""
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree, capture_output=True)
    return head.stdout.strip() + (" + changes" if dirty.stdout.strip() else "")


class Recorder:
    """Started when a benchmark starts (load average before), written when it ends (load average after)."""

    def __init__(self, bench: Benchmark, argv: list[str] | None, via: str | None = None) -> None:
        self.bench = bench
        words = list(sys.argv[1:] if argv is None else argv)
        if "--via" in words:  # the suite's command, recorded as such: not part of this one
            del words[words.index("--via") : words.index("--via") + 2]
        self.command = shlex.join(["python", "-m", bench.module, *words])
        self.via = via
        self.started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.load_before = load_average()
        self.t0 = time.perf_counter()

    def write(
        self,
        out: str | Path,
        data: Any,
        values: dict[str, Value],
        floors: dict[str, float] | None = None,
        error: str | None = None,
    ) -> Path:
        """``out/<name>.json``: every declared figure (value null where this run did not measure it), the run's
        circumstances and its raw data."""
        record = {
            "benchmark": self.bench.name,
            "measures": self.bench.measures,
            "command": self.command,
            "via": self.via,
            "started": self.started,
            "seconds": round(time.perf_counter() - self.t0, 1),
            "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores",
            "load_average": {"before": self.load_before, "after": load_average()},
            "commit": commit(),
            "error": error,
            "figures": figures_record(self.bench, values, floors or {}),
            "data": data,
        }
        path = Path(out) / f"{self.bench.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1, default=str) + "\n")
        print(f"-> {display(path)}", flush=True)
        return path


def figures_record(bench: Benchmark, values: dict[str, Value], floors: dict[str, float]) -> dict[str, dict]:
    """name -> {value, unit, target, floor, met, sense, meaning} for every declared figure, in declaration order.
    A value or floor for a name the declaration does not have is an error: the declaration is the one list."""
    for name in [*values, *floors]:
        bench.figure(name)
    out = {}
    for f in bench.figures:
        value = values.get(f.name)
        if isinstance(value, float):
            value = float(f"{value:.6g}")
        floor = floors.get(f.name, f.floor if not isinstance(f.floor, str) else None)
        out[f.name] = {
            "value": value,
            "unit": f.unit,
            "target": f.target,
            "floor": None if floor is None else float(f"{floor:.6g}"),
            "met": f.met(value),
            "sense": f.sense if f.target is not None else None,
            "meaning": f.meaning,
        }
    return out


# -- processes of torchrun jobs ------------------------------------------------------------------------------------
def torchrun_cmd(nproc: int, target: list[str]) -> list[str]:
    """torchrun on this node with c10d rendezvous on a free port; ``target`` is ``-m module ...`` or a script."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:0",
        f"--rdzv-id=bench-{uuid.uuid4().hex[:8]}",
        *target,
    ]


def ranks(launcher: int) -> dict[int, int]:
    """rank -> pid of a torchrun launcher's worker processes (read from /proc: their RANK variable)."""
    out = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = int(next(x for x in status.read_text().splitlines() if x.startswith("PPid:")).split()[1])
            if ppid != launcher:
                continue
            env = (status.parent / "environ").read_bytes().split(b"\0")
            rank = next(int(e[5:]) for e in env if e.startswith(b"RANK="))
            out[rank] = int(status.parent.name)
        except (OSError, StopIteration, ValueError):
            continue
    return out


TICK = os.sysconf("SC_CLK_TCK")


def proc_sample(pid: int) -> tuple[float, int] | None:
    """(utime+stime in seconds, VmRSS in bytes) of ``pid``, or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3, utime 14, stime 15
    cpu = (int(fields[11]) + int(fields[12])) / TICK
    rss = next((int(x.split()[1]) * 1024 for x in status.splitlines() if x.startswith("VmRSS:")), 0)
    return cpu, rss
