"""The study's record, ``OUT/study.json``: the command that made it, its runs, and its Slurm submissions.

Written when a study starts launching (not by a dry run), and after every ``sbatch`` (a job id is never lost between
the submission and the record). The runs of earlier invocations of the same command into ``OUT`` whose rows this one
does not have are kept as ``earlier``: the report keeps their rows where their runs are what this invocation would
run for them (:func:`earlier_runs`). ``python -m hosfl_dist.experiments.collect OUT`` reads it to report the study again
from its runs as they stand; the same command run again reads it to find the runs still queued in Slurm (they are
waited for, not submitted twice). Torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hosfl_dist.errors import ConfigError

if TYPE_CHECKING:
    from hosfl_dist.experiments.runs import RunSpec

FILE = "study.json"
PROGS = ("hosfl_dist.experiments.compare", "hosfl_dist.experiments.sweep", "hosfl_dist.experiments.scaling")
"""The commands whose studies collect reports."""
MAX_BYTES = 16 << 20


def read(out: Path) -> dict[str, Any] | None:
    """The record in ``out`` (None: there is none); a file that is not one of these records is refused."""
    path = out / FILE
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as fh:
            text = fh.read(MAX_BYTES + 1)
        if len(text) > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES} bytes")
        data = json.loads(text)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not readable as a study record: {exc}") from None
    ok = (
        isinstance(data, dict)
        and data.get("prog") in PROGS
        and isinstance(data.get("argv"), list)
        and all(isinstance(a, str) for a in data["argv"])
        and isinstance(data.get("cwd"), str)
        and isinstance(data.get("submissions", []), list)
    )
    if not ok:
        raise ConfigError(f"{path} is not a study record of {', '.join(PROGS)}")
    data.setdefault("submissions", [])
    return data


def write(out: Path, record: dict[str, Any]) -> None:
    """Replace the record at once (a reader sees the old one or the new one)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(out / FILE)


def begin(out: Path, prog: str, argv: Sequence[str], launcher: str, specs: Sequence[RunSpec]) -> dict[str, Any]:
    """The record of this invocation (its command and runs), with the submissions of the earlier ones kept, and
    their runs of rows this one does not have (``earlier``)."""
    old = read(out) or {}
    record = {
        "prog": prog,
        "argv": list(argv),
        "cwd": os.getcwd(),
        "launcher": launcher,
        "runs": [
            {"row": s.variant, "seed": s.seed, "run": str(s.out_dir.resolve()), "world": s.world.as_dict()}
            for s in specs
        ],
        "earlier": earlier_runs(old, prog, {s.variant for s in specs}),
        "submissions": old.get("submissions", []),
    }
    write(out, record)
    return record


def earlier_runs(record: dict[str, Any] | None, prog: str, rows: set[str]) -> list[dict[str, Any]]:
    """The runs ``record`` holds (its invocation's and those it kept) of rows not in ``rows``, where it is a record
    of ``prog`` (a compare's rows are no sweep's): each ``{row, seed, run}``, once, in the order recorded; entries
    of another shape are left out (the record is read from a folder)."""
    if not record or record.get("prog") != prog:
        return []
    found, seen = [], set()
    for entry in [*record.get("runs", []), *record.get("earlier", [])]:
        ok = (isinstance(entry, dict) and isinstance(entry.get("row"), str) and isinstance(entry.get("run"), str)
              and isinstance(entry.get("seed"), int) and not isinstance(entry.get("seed"), bool))  # fmt: skip
        if ok and entry["row"] not in rows and entry["run"] not in seen:
            seen.add(entry["run"])
            found.append({"row": entry["row"], "seed": entry["seed"], "run": entry["run"]})
    return found
