"""A run as the Python API hands it back: its folder and what the runtime wrote there.

    run = load_run("runs/quickstart/latest")
    run.summary["final_eval_accuracy"], [r["eval_accuracy"] for r in run.metrics]

:func:`hosfl_dist.train` returns one for the run it trained; :func:`load_run` reads any run's folder, finished or
not (the files are read when asked for, so a callback's ``on_train_start`` can hold one during the run). The one
``on_train_start`` is given can also end the run early: ``run.should_stop = True`` (Lightning's convention) stops it
after the current round, as a callback's ``control.should_training_stop`` does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hosfl_dist.errors import ArgumentError, ConfigError


class Run:
    """A run's folder: ``out_dir``, and ``summary`` (summary.json) and ``metrics`` (metrics.jsonl's rows) as they are
    on disk when read."""

    def __init__(self, out_dir: str | Path, control: Any = None) -> None:
        self.out_dir = Path(_path("Run", out_dir))
        self._control = control
        """The live run's stop request (the runtime's ``TrainingControl``), for the one ``on_train_start`` is given."""

    @property
    def should_stop(self) -> bool:
        """Whether the run was asked to stop after the current round; set it to True to ask (only the ``Run`` a
        callback's ``on_train_start`` is given belongs to a live run)."""
        return bool(self._control is not None and self._control.should_training_stop)

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ArgumentError(f"Run.should_stop takes True or False, not {type(value).__name__} ({value!r:.60})")
        if self._control is None:
            raise ConfigError(f"Run({str(self.out_dir)!r}) is not a live run's: only the Run a callback's "
                              "on_train_start is given can stop its run")  # fmt: skip
        self._control.should_training_stop = self._control.should_training_stop or value

    @property
    def summary(self) -> dict[str, Any]:
        """summary.json: ``status`` running, completed, stopped (ended early: ``stopped`` says by what), failed,
        interrupted (or died: see ``--status``), the totals."""
        path = self.out_dir / "summary.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """metrics.jsonl: one dict per evaluation, in the order written."""
        path = self.out_dir / "metrics.jsonl"
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    @property
    def status(self) -> str:
        return self.summary.get("status", "")

    def __repr__(self) -> str:
        return f"Run({str(self.out_dir)!r}, status={self.status!r})"


def load_run(out_dir: str | Path) -> Run:
    """The run in ``out_dir`` (a folder that holds a summary.json; ``runs/<name>/latest`` is followed)."""
    folder = Path(_path("load_run", out_dir)).resolve()
    if not (folder / "summary.json").is_file():
        raise ConfigError(f"{out_dir}: not a run's folder (no summary.json)")
    return Run(folder)


def _path(where: str, value: Any) -> str | os.PathLike[str]:
    """``value`` where a run's folder is meant: a str or a path (ArgumentError in one line otherwise)."""
    if isinstance(value, str) or (isinstance(value, os.PathLike) and isinstance(os.fspath(value), str)):
        return value
    raise ArgumentError(f"{where}: out_dir must be a run's folder as a str or a pathlib.Path, not "
                        f"{type(value).__name__} ({value!r:.60})")  # fmt: skip
