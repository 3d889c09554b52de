"""The run's record, written by one process only (the in-process runtime, or rank 0 under torchrun).

In ``job.out_dir`` (see :mod:`hosfl_dist.runfolder.folder`):
- ``config.yaml``: the resolved config;
- ``metrics.jsonl``: one object per evaluation, flushed as it is written (an interrupted run keeps every line);
- ``participation.jsonl``: one object per round run, who was sampled, counted, delivered, dropped (and when), late,
  and whether the round was skipped (:mod:`hosfl_dist.algorithms.participation`; ``clients.participation`` replays
  it), written up to each metrics row and checkpoint;
- ``summary.json``: written when the run starts (``status: running``) and rewritten by every ending: ``completed``
  (final metrics, traffic totals, wall time, θc/θs digests), ``stopped`` (the same, for a run asked to end before its
  budget, with ``stopped``: by what, why, where), ``failed`` (with the error) or ``interrupted``;
- ``checkpoints/`` (see :mod:`hosfl_dist.runtime.checkpoint`).

Both files are strict JSON: a non-finite number is written as null and its key listed under ``nonfinite``. The end
of a run is written here once for every runtime.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

from hosfl_dist.algorithms.participation import ParticipationPlan, add
from hosfl_dist.config import Config, dump_config
from hosfl_dist.errors import NonFiniteError
from hosfl_dist.runfolder.identity import fingerprint
from hosfl_dist.runtime.build import round_plan
from hosfl_dist.runtime.record.tracking import Trackers
from hosfl_dist.safe_files import replace_file
from hosfl_dist.transport.wire import PAPER_CATEGORIES

logger = logging.getLogger(__name__)

BEST_KEYS = ("best_eval_accuracy", "best_round")


def finite_json(obj: Any, path: str = "") -> tuple[Any, list[str]]:
    """``obj`` with every non-finite float replaced by None, and the dotted keys where that happened."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None, [path]
    if isinstance(obj, dict):
        out, bad = {}, []
        for k, v in obj.items():
            out[k], b = finite_json(v, f"{path}.{k}" if path else str(k))
            bad += b
        return out, bad
    if isinstance(obj, (list, tuple)):
        pairs = [finite_json(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        return [p[0] for p in pairs], [b for p in pairs for b in p[1]]
    return obj, []


def strict_dumps(obj: dict[str, Any], **kwargs: Any) -> str:
    """Strict JSON of a row or summary: non-finite values become null and are named under ``nonfinite``."""
    clean, bad = finite_json(obj)
    if bad:
        clean["nonfinite"] = bad
    return json.dumps(clean, allow_nan=False, **kwargs)


class RunRecord:
    """Writes config.yaml and a ``running`` summary at once, metrics rows as they come, and the final summary.

    Resuming (``rows_until``: the round of the checkpoint), the metrics rows up to that round are kept and later
    ones (written after the checkpoint by the interrupted run) are dropped; wall time continues from ``wall_s``.
    """

    def __init__(
        self,
        cfg: Config,
        engine: str,
        rows_until: int | None = None,
        wall_s: float = 0.0,
        resumed: str = "",
        identity: dict[str, Any] | None = None,
        notes: dict[str, Any] | None = None,
        plan: ParticipationPlan | None = None,
    ) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.job.out_dir)
        self.engine = engine
        (self.dir / "config.yaml").write_text(dump_config(cfg))
        self.history: list[dict[str, Any]] = []
        if rows_until is not None:
            self.history = kept_rows(self.dir / "metrics.jsonl", rows_until)
        keep = [strict_dumps(row) for row in self.history]
        supersede(self.dir / "metrics.jsonl", lambda i, line: i < len(keep) and _same_json(line, keep[i]), rows_until)
        self._metrics = open(self.dir / "metrics.jsonl", "w")  # noqa: SIM115 - kept open for the whole run
        for row in self.history:
            self._metrics.write(strict_dumps(row) + "\n")
        self._metrics.flush()
        self.trackers = Trackers(cfg, self.dir)  # job.loggers beyond jsonl (TensorBoard, W&B offline)
        for row in self.history:
            self.trackers.log(row)
        self.participation = ParticipationRecord(cfg, self.dir, rows_until, self.history, plan)
        self.start = time.perf_counter() - wall_s
        self.finished = False
        self.summary: dict[str, Any] = {}
        """The summary the run ended with (once it ended)."""
        identity = identity or {}
        self.base = {
            "engine": engine,
            "algorithm": cfg.algorithm.name,
            **({"inputs": identity["inputs"]} if identity.get("inputs") else {}),
            **({"fingerprint": fingerprint(identity), "code": identity.get("code")} if identity else {}),
            **({"environment": identity["environment"]} if identity.get("environment") else {}),
            **({"resumed_from": resumed} if resumed else {}),
            **(notes or {}),
        }
        self._dump({"status": "running", **self.base, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})

    @property
    def wall_s(self) -> float:
        return time.perf_counter() - self.start

    def log(self, row: dict[str, Any]) -> dict[str, Any]:
        """Write one metrics row (adding wall time and the best evaluation so far); returns it as written."""
        participants = self.participation.delivered_since_last_row(row["round"])
        row = {**row, "participants": participants, **self._best(row), "wall_time_s": round(self.wall_s, 3)}
        self.history.append(row)
        self._metrics.write(strict_dumps(row) + "\n")
        self._metrics.flush()
        self.trackers.log(row)
        return row

    def _best(self, row: dict[str, Any]) -> dict[str, Any]:
        """``best_eval_accuracy`` and ``best_round``: the highest evaluation accuracy up to this row (the first round
        that reached it), beside the last one (the authors' code reports the best over evaluations)."""
        scored = [r for r in [*self.history, row] if r.get("eval_accuracy") is not None]
        if "eval_accuracy" not in row or not scored:
            return {}
        best = max(scored, key=lambda r: (r["eval_accuracy"], -r["round"]))
        return {"best_eval_accuracy": best["eval_accuracy"], "best_round": best["round"]}

    def _dump(self, summary: dict[str, Any]) -> None:
        # a reader never sees half a file; a full disk leaves the previous summary, not an empty file beside it
        replace_file(self.dir / "summary.json", strict_dumps(summary, indent=2) + "\n")

    def rounds_run(self, t: int) -> None:
        """Rounds 0..t-1 have run (a checkpoint of round t): participation.jsonl is written up to there."""
        self.participation.through(t)

    def _write(self, summary: dict[str, Any]) -> dict[str, Any]:
        summary = {**self.base, **summary, "wall_time_s": round(self.wall_s, 3)}
        self._dump(summary)
        self.summary = summary
        if not self._metrics.closed:
            self._metrics.close()
        self.participation.close()
        self.trackers.finish(summary)
        self.finished = True
        return summary

    def note(self, key: str, value: Any) -> dict[str, Any]:
        """Add ``key`` to the summary the run ended with (what came after its end: ``callback_error``), the rest of it
        as written; returns it."""
        self.summary = {**self.summary, key: value}
        self._dump(self.summary)
        return self.summary

    def complete(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write a completed (or stopped) run's summary (:func:`completed_summary` plus what the runtime adds), and its
        curves."""
        summary = self._write(summary)
        if self.cfg.job.plots:
            from hosfl_dist.runtime.record.curves import write_curves

            early = ", stopped early" if summary.get("status") == "stopped" else ""
            title = (f"{self.cfg.job.name}: {self.cfg.algorithm.name}, {summary['rounds']} rounds, "
                     f"{summary['processed_samples']} samples{early} ({self.dir})")  # fmt: skip
            try:
                write_curves(self.dir / "curves.png", {self.cfg.algorithm.name: self.history}, title)
            except Exception as exc:  # noqa: BLE001 - a plot never fails a finished run
                logger.warning(f"curves.png not drawn: {type(exc).__name__}: {exc}")
        return summary

    def completed_summary(
        self, rounds: int, processed: int, comm: dict[str, int], client_digests: dict[str, str], server_digest: str
    ) -> dict[str, Any]:
        """The fields of a completed run's summary.json that every runtime writes (each adds its own beside them)."""
        last = self.history[-1] if self.history else {}
        return {
            "status": "completed",
            "engine": self.engine,
            "algorithm": self.cfg.algorithm.name,
            "rounds": rounds,
            "processed_samples": processed,
            "final": {
                **{k: last.get(k) for k in ("eval_accuracy", "eval_loss", "train_loss")},
                **{k: v for k, v in last.items() if k.startswith("eval_") and k not in ("eval_accuracy", "eval_loss")},
                **{k: last[k] for k in BEST_KEYS if k in last},
            },
            "comm": {"bytes": comm, "training_total_bytes": sum(comm[c] for c in PAPER_CATEGORIES)},
            "participation": self.participation.totals_through(rounds),
            "client_digests": client_digests,
            "server_digest": server_digest,
        }

    def fail(self, error: str, rounds: int | None = None) -> dict[str, Any]:
        """Record a failed run (the metrics rows written so far stay)."""
        return self._write({"status": "failed", "error": error, **({} if rounds is None else {"rounds": rounds})})

    def interrupt(self, why: str, rounds: int | None, checkpoint: str | None) -> dict[str, Any]:
        """Record a run stopped by a signal, with the checkpoint it can resume from (job.resume=auto; None: it holds
        none, and starts afresh)."""
        return self._write({"status": "interrupted", "error": why, "rounds": rounds, "checkpoint": checkpoint})


class ParticipationRecord:
    """participation.jsonl and the counts beside it: each metrics row's ``participants`` (client-rounds delivered
    since the previous row) and summary.json's ``participation``. Written from the run's plan, which the server and
    every worker follow; resuming at round r, the rounds before r are written again from it."""

    def __init__(
        self,
        cfg: Config,
        folder: Path,
        resumed_at: int | None,
        rows: list[dict[str, Any]],
        plan: ParticipationPlan | None = None,
    ) -> None:
        self.plan = plan if plan is not None else round_plan(cfg).participation
        self.counts = dict.fromkeys(("sampled", "delivered", "dropped", "late", "rounds_skipped"), 0)
        self.written = 0
        upto = resumed_at or 0  # the rounds a resumed run writes again, each as the plan (restored) has it
        again = [json.dumps(self.plan.round(r).record()) for r in range(upto)]
        supersede(folder / "participation.jsonl", lambda i, line: i < upto and _same_json(line, again[i]), resumed_at)
        self._file = open(folder / "participation.jsonl", "w")  # noqa: SIM115 - kept open for the whole run
        self.reported = 0
        self.workers: Callable[[], dict[str, int]] | None = None
        """Elastic runs: the workers lost and joined so far (0 and 0 otherwise)."""
        if resumed_at is not None:
            self.through(rows[-1]["round"] if rows else 0)
            self.reported = self.counts["delivered"]  # the kept rows' participants
            self.through(resumed_at)

    def through(self, t: int) -> None:
        """Write the rounds before t that are not written yet."""
        if self._file.closed:
            return
        for r in range(self.written, t):
            p = self.plan.round(r)
            self._file.write(json.dumps(p.record()) + "\n")
            add(self.counts, p)
        self.written = max(self.written, t)
        self._file.flush()

    def delivered_since_last_row(self, t: int) -> int:
        """Client-rounds delivered since the previous metrics row (a row of round t: rounds before t have run)."""
        self.through(t)
        out, self.reported = self.counts["delivered"] - self.reported, self.counts["delivered"]
        return out

    def totals_through(self, rounds: int) -> dict[str, int]:
        """summary.json's ``participation`` over the rounds before ``rounds``."""
        self.through(rounds)
        workers = self.workers() if self.workers is not None else {"workers_lost": 0, "workers_joined": 0}
        return {**self.counts, **workers}

    def close(self) -> None:
        self._file.close()


SUPERSEDED = ".superseded.jsonl"


def supersede(path: Path, kept: Callable[[int, str], bool], resumed_at: int | None) -> int:
    """Keep every line of ``path`` a new start of the run will not write again as it is: those ``kept(i, line)``
    refuses are appended to ``<name>.superseded.jsonl`` beside it, after a line that says when and why (a resume
    from round r: the lines written after its checkpoint; a start afresh: every line). Returns how many."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except (FileNotFoundError, IsADirectoryError):
        return 0
    gone = [line for i, line in enumerate(lines) if line.strip() and not kept(i, line)]
    if not gone:
        return 0
    why = {"superseded": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "file": path.name, "lines": len(gone),
           "by": f"a resume from round {resumed_at}" if resumed_at is not None else "a start afresh"}  # fmt: skip
    with open(path.with_name(path.stem + SUPERSEDED), "a") as fh:
        fh.write(json.dumps(why) + "\n" + "".join(line + "\n" for line in gone))
    logger.info(f"{len(gone)} line(s) of {path.name} that this run does not continue kept in "
                f"{path.stem + SUPERSEDED}")  # fmt: skip
    return len(gone)


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


def kept_rows(path: Path, rows_until: int) -> list[dict[str, Any]]:
    """The metrics rows of ``path`` up to round ``rows_until`` (those a resumed run keeps). A line that does not parse
    (the process died while writing it) ends the rows: nothing after it was written whole."""
    rows: list[dict[str, Any]] = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return rows
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            break
        if isinstance(row, dict) and isinstance(row.get("round"), int) and row["round"] <= rows_until:
            rows.append(row)
    return rows


def record_gap(folder: Path, cfg: Config, round_: int, processed: int) -> str | None:
    """Why the record in ``folder`` cannot be continued from a checkpoint of ``round_`` after ``processed`` samples,
    or None. A run evaluates when its samples pass each ``train.eval_every_samples`` and the budget, and writes the
    row before the checkpoint of that round; a checkpoint past the newest evaluation metrics.jsonl holds came from
    elsewhere (copied in from a run ahead of this one): resumed, it would leave the rows between missing. A folder
    without metrics.jsonl (checkpoints alone, carried to a new folder) starts its record at the checkpoint."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return None
    budget, every = cfg.train.budget_samples, cfg.train.eval_every_samples
    due = budget if processed >= budget else processed // every * every  # the newest evaluation at or before it
    rows = kept_rows(path, round_)
    held = max((r["processed_samples"] for r in rows if isinstance(r.get("processed_samples"), int)), default=-1)
    if held >= due:
        return None
    newest = f"rows up to round {rows[-1]['round']} ({held} samples)" if rows else "no row"
    return (f"metrics.jsonl holds {newest} and lacks the evaluation at {due} samples, which a run writes before its "
            f"checkpoint of round {round_} ({processed} samples): the checkpoint was not written by this run (copied "
            "in from a run ahead of it?); resumed, the rows between would be missing")


def metrics_row(server: Any, evaluator: Any, t: int, processed: int, comm: dict[str, int]) -> dict[str, Any]:
    """One metrics.jsonl object: the evaluation server's statistics and the server's train loss since the previous
    row.

    A non-finite evaluation loss or accuracy stops the run (:class:`NonFiniteError`): it has diverged.
    """
    loss = server.pop_train_loss()
    metrics = evaluator.pop_metrics()
    bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise NonFiniteError(f"round {t}: evaluation gave non-finite {', '.join(bad)} (the run has diverged)")
    return {
        "round": t,
        "processed_samples": processed,
        **metrics,
        "train_loss": None if loss is None or math.isnan(loss) else loss,
        "nonfinite_skipped": server.pop_skipped(),
        "comm": comm,
    }


def done_line(summary: dict[str, Any], folder: str | Path) -> str:
    """What the command line says when a run completed (or stopped early: what asked)."""
    last = summary["final"]
    best = (
        ""
        if last.get("best_eval_accuracy") is None
        else f" (best {_fraction(last['best_eval_accuracy'])} at round {last['best_round']})"
    )
    curves = "curves.png: the curves; " if (Path(folder) / "curves.png").is_file() else ""
    stopped = summary.get("stopped") or {}
    early = (f" (stopped early, of a budget of {stopped.get('budget_samples', 0):,}: {stopped.get('by')})"
             if summary.get("status") == "stopped" else "")  # fmt: skip
    return (
        f"done: {summary['rounds']} rounds, {summary['processed_samples']:,} samples{early}, "
        f"eval_accuracy={_fraction(last.get('eval_accuracy'))}{best}, wall {summary['wall_time_s']} s -> {folder}\n"
        f"      metrics.jsonl: one row per evaluation; summary.json: totals, traffic, memory; {curves}several runs' "
        "curves: python -m hosfl_dist.experiments.report DIR...; the model: python -m hosfl_dist.export "
        f"{folder} --out DIR"
    )


def _fraction(value: Any) -> str:
    """An accuracy for the console: 4 decimals (metrics.jsonl and summary.json keep every digit)."""
    return f"{value:.4f}" if isinstance(value, float) else str(value)
