"""The training loop shared by both engines, the run's outputs, and the in-process engine.

Outputs in ``job.out_dir`` (written by one process only):
- ``config.yaml``: the resolved config;
- ``metrics.jsonl``: one object per evaluation, flushed as it is written (an interrupted run keeps every line);
- ``summary.json``: final metrics, traffic totals, wall time, θc/θs digests, and ``status`` (completed / failed).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hosfl_dist.algorithms.base import ServerBase, WorkerBase, get_algorithm
from hosfl_dist.comm import PAPER_CATEGORIES, CommMeter
from hosfl_dist.config import Config, dump_config
from hosfl_dist.data import build_data
from hosfl_dist.models import build_split_model
from hosfl_dist.transport import InProcessTransport, LocalCollective


class Recorder:
    """Writes the run's files; only the process that owns the server creates one."""

    def __init__(self, cfg: Config) -> None:
        self.dir = Path(cfg.job.out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.yaml").write_text(dump_config(cfg))
        self._metrics = open(self.dir / "metrics.jsonl", "w")  # noqa: SIM115 - kept open for the whole run
        self.history: list[dict[str, Any]] = []
        self.start = time.perf_counter()

    def log(self, row: dict[str, Any]) -> None:
        row = {**row, "wall_time_s": round(time.perf_counter() - self.start, 3)}
        self.history.append(row)
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        summary = {**summary, "wall_time_s": round(time.perf_counter() - self.start, 3)}
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self._metrics.close()
        return summary


def eval_points(budget: int, every: int) -> list[int]:
    """Processed-sample thresholds at which to evaluate: 0, every, 2·every, …, and the budget."""
    pts = list(range(0, budget, every)) + [budget]
    return sorted(set(pts))


def train_loop(
    cfg: Config,
    worker: WorkerBase,
    on_eval: Callable[[int, int], None],
    progress: Any = None,
) -> tuple[int, int]:
    """Run rounds until ``train.budget_samples`` processed samples; evaluate at the thresholds (leader only).

    Returns (rounds run, processed samples). Every client worker runs this loop in lockstep; ``on_eval`` runs on
    every worker after the leader evaluated (the distributed runtime sums its workers' traffic counters there).
    """
    budget = cfg.train.budget_samples
    points = eval_points(budget, cfg.train.eval_every_samples)[1:]  # 0 is evaluated before the first round
    t = processed = 0
    if worker.collective.is_leader:
        worker.evaluate(t)
    on_eval(t, processed)
    while processed < budget:
        processed += worker.run_round(t)
        t += 1
        if progress is not None:
            progress.update(min(processed, budget) - progress.n)
        if points and processed >= points[0]:
            while points and processed >= points[0]:  # a round can cross several thresholds: evaluate once
                points.pop(0)
            if worker.collective.is_leader:
                worker.evaluate(t)
            on_eval(t, processed)
    return t, processed


def metrics_row(server: ServerBase, t: int, processed: int, comm: dict[str, int]) -> dict[str, Any]:
    loss = server.pop_train_loss()
    return {
        "round": t,
        "processed_samples": processed,
        **server.pop_eval_metrics(),
        "train_loss": None if loss is None or math.isnan(loss) else loss,
        "comm": comm,
    }


def comm_summary(comm: dict[str, int]) -> dict[str, Any]:
    return {
        "bytes": comm,
        "training_total_bytes": sum(comm[c] for c in PAPER_CATEGORIES),
    }


def run_summary(
    cfg: Config,
    rec: Recorder,
    engine: str,
    rounds: int,
    processed: int,
    comm: dict[str, int],
    client_digests: dict[str, str],
    server_digest: str,
) -> dict[str, Any]:
    """summary.json of a completed run (both engines; the distributed one adds its own fields)."""
    last = rec.history[-1] if rec.history else {}
    return {
        "status": "completed",
        "engine": engine,
        "algorithm": cfg.algorithm.name,
        "rounds": rounds,
        "processed_samples": processed,
        "final": {k: last.get(k) for k in ("eval_accuracy", "eval_loss", "train_loss")},
        "comm": comm_summary(comm),
        "client_digests": client_digests,
        "server_digest": server_digest,
    }


class InProcessEngine:
    """M logical clients and the server in one process, through the same algorithm code as the distributed run."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.data = build_data(cfg)
        self.split = build_split_model(cfg, self.data.info)
        server_cls, worker_cls = get_algorithm(cfg.algorithm.name)
        self.meter = CommMeter()
        self.server: ServerBase = server_cls(cfg, self.split)
        transport = InProcessTransport(self.server, self.meter)
        if cfg.comm.inject_delay:  # emulate the client-server link (App. C.1) to measure latency hiding
            from hosfl_dist.measure.link import DelayedTransport, Link

            transport = DelayedTransport(transport, Link.from_config(cfg.comm))
        hosted = range(cfg.clients.total)
        self.worker: WorkerBase = worker_cls(cfg, self.split, self.data, hosted, transport, LocalCollective())

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        rec = Recorder(cfg)
        bar = _progress(cfg)
        t = processed = 0
        try:
            t, processed = train_loop(
                cfg, self.worker, lambda r, n: rec.log(metrics_row(self.server, r, n, self.meter.snapshot())), bar
            )
            self.worker.sync_all(t)
            digests = {"worker_0": self.worker.client_digest()}
            summary = run_summary(
                cfg, rec, "in_process", t, processed, self.meter.snapshot(), digests, self.server.server_digest()
            )
            return rec.finish(summary)
        except BaseException as exc:
            rec.finish({"status": "failed", "error": f"{type(exc).__name__}: {exc}", "rounds": t})
            raise
        finally:
            if bar is not None:
                bar.close()


def _progress(cfg: Config) -> Any:
    if not cfg.job.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.train.budget_samples, unit="samples", desc=cfg.job.name, dynamic_ncols=True)
