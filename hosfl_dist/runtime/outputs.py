"""The run's record, written by one process only (the in-process runner, or rank 0 under torchrun).

In ``job.out_dir``:
- ``config.yaml``: the resolved config;
- ``metrics.jsonl``: one object per evaluation, flushed as it is written (an interrupted run keeps every line);
- ``summary.json``: final metrics, traffic totals, wall time, θc/θs digests, and ``status`` (completed / failed).

The end of a run is written here once for every runtime: :meth:`RunWriter.complete` (summary + the "done:" line)
and :meth:`RunWriter.fail` (a failed summary with the error).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from hosfl_dist.algorithms.base import ServerBase
from hosfl_dist.config import Config, dump_config
from hosfl_dist.transport.wire import PAPER_CATEGORIES


class RunWriter:
    """Writes config.yaml at once, metrics rows as they come, and summary.json at the end."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.job.out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.yaml").write_text(dump_config(cfg))
        self._metrics = open(self.dir / "metrics.jsonl", "w")  # noqa: SIM115 - kept open for the whole run
        self.history: list[dict[str, Any]] = []
        self.start = time.perf_counter()
        self.finished = False

    def log(self, row: dict[str, Any]) -> None:
        row = {**row, "wall_time_s": round(time.perf_counter() - self.start, 3)}
        self.history.append(row)
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()

    def _write(self, summary: dict[str, Any]) -> dict[str, Any]:
        summary = {**summary, "wall_time_s": round(time.perf_counter() - self.start, 3)}
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if not self._metrics.closed:
            self._metrics.close()
        self.finished = True
        return summary

    def complete(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write a completed run's summary and say so in one line."""
        summary = self._write(summary)
        last = summary["final"]
        print(
            f"done: {summary['rounds']} rounds, {summary['processed_samples']} samples, "
            f"eval_accuracy={last.get('eval_accuracy')}, wall {summary['wall_time_s']} s -> {self.cfg.job.out_dir}",
            flush=True,
        )
        return summary

    def fail(self, error: str, rounds: int | None = None) -> dict[str, Any]:
        """Record a failed run (the metrics rows written so far stay)."""
        return self._write({"status": "failed", "error": error, **({} if rounds is None else {"rounds": rounds})})


def metrics_row(server: ServerBase, t: int, processed: int, comm: dict[str, int]) -> dict[str, Any]:
    """One metrics.jsonl object: the server's evaluation statistics and train loss since the previous row."""
    loss = server.pop_train_loss()
    return {
        "round": t,
        "processed_samples": processed,
        **server.pop_eval_metrics(),
        "train_loss": None if loss is None or math.isnan(loss) else loss,
        "comm": comm,
    }


def run_summary(
    cfg: Config,
    writer: RunWriter,
    engine: str,
    rounds: int,
    processed: int,
    comm: dict[str, int],
    client_digests: dict[str, str],
    server_digest: str,
) -> dict[str, Any]:
    """summary.json of a completed run (both runtimes; torchrun adds its own fields)."""
    last = writer.history[-1] if writer.history else {}
    return {
        "status": "completed",
        "engine": engine,
        "algorithm": cfg.algorithm.name,
        "rounds": rounds,
        "processed_samples": processed,
        "final": {k: last.get(k) for k in ("eval_accuracy", "eval_loss", "train_loss")},
        "comm": {"bytes": comm, "training_total_bytes": sum(comm[c] for c in PAPER_CATEGORIES)},
        "client_digests": client_digests,
        "server_digest": server_digest,
    }


def progress_bar(cfg: Config) -> Any:
    """A samples progress bar on stderr (None with ``job.progress=false``)."""
    if not cfg.job.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.train.budget_samples, unit="samples", desc=cfg.job.name, dynamic_ncols=True)
