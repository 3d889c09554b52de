"""A run as the Python API hands it back: its folder and what the runtime wrote there.

    run = load_run("runs/quickstart/latest")
    run.summary["final_eval_accuracy"], [r["eval_accuracy"] for r in run.metrics]

:func:`hosfl_dist.train` returns one for the run it trained; :func:`load_run` reads any run's folder, finished or
not (the files are read when asked for, so a callback's ``on_train_start`` can hold one during the run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hosfl_dist.errors import ConfigError


class Run:
    """A run's folder: ``out_dir``, and ``summary`` (summary.json) and ``metrics`` (metrics.jsonl's rows) as they are
    on disk when read."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)

    @property
    def summary(self) -> dict[str, Any]:
        """summary.json: ``status`` running, completed, failed, interrupted (or died: see ``--status``), the totals."""
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
    folder = Path(out_dir).resolve()
    if not (folder / "summary.json").is_file():
        raise ConfigError(f"{out_dir}: not a run's folder (no summary.json)")
    return Run(folder)
