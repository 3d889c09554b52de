"""The run's record, written by one process only (the in-process runner, or rank 0 under torchrun).

In ``job.out_dir``:
- ``config.yaml``: the resolved config;
- ``metrics.jsonl``: one object per evaluation, flushed as it is written (an interrupted run keeps every line);
- ``summary.json``: written when the run starts (``status: running``) and rewritten by every ending: ``completed``
  (final metrics, traffic totals, wall time, θc/θs digests), ``failed`` (with the error) or ``interrupted``;
- ``checkpoints/`` (see :mod:`hosfl_dist.runtime.checkpoint`).

Both files are strict JSON: a non-finite number is written as null and its key listed under ``nonfinite``.
A folder that holds another run is refused unless ``job.resume=auto`` (continue it) or ``job.overwrite=true``
(:func:`prepare_out_dir`). The end of a run is written here once for every runtime.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from hosfl_dist.algorithms.base import ServerBase
from hosfl_dist.config import Config, config_to_dict, dump_config
from hosfl_dist.core.digest import file_sha256
from hosfl_dist.errors import ConfigError, NonFiniteError
from hosfl_dist.runtime.tracking import Trackers
from hosfl_dist.transport.wire import PAPER_CATEGORIES

RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json")
BEST_KEYS = ("best_eval_accuracy", "best_round")
EVAL_SHOWN = ("eval_accuracy", "eval_f1", "eval_exact_match", "eval_loss")
"""The evaluation statistics the progress bar shows (those a task reports)."""
CHECKPOINTS = "checkpoints"
VOLATILE_KEYS = {"job": ("out_dir", "resume", "overwrite", "progress", "device", "interface", "loggers", "threads")}
"""Keys that may differ between a run and its resumption (how it is started, not what it computes)."""


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


class RunWriter:
    """Writes config.yaml and a ``running`` summary at once, metrics rows as they come, and the final summary.

    Resuming (``rows_until``: the round of the checkpoint), the metrics rows up to that round are kept and later
    ones (written after the checkpoint by the interrupted run) are dropped; wall time continues from ``wall_s``.
    """

    def __init__(
        self, cfg: Config, engine: str, rows_until: int | None = None, wall_s: float = 0.0, resumed: str = ""
    ) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.job.out_dir)
        self.engine = engine
        (self.dir / "config.yaml").write_text(dump_config(cfg))
        self.history: list[dict[str, Any]] = []
        if rows_until is not None and (self.dir / "metrics.jsonl").is_file():
            for line in (self.dir / "metrics.jsonl").read_text().splitlines():
                row = json.loads(line)
                if row["round"] <= rows_until:
                    self.history.append(row)
        self._metrics = open(self.dir / "metrics.jsonl", "w")  # noqa: SIM115 - kept open for the whole run
        for row in self.history:
            self._metrics.write(strict_dumps(row) + "\n")
        self._metrics.flush()
        self.trackers = Trackers(cfg, self.dir)  # job.loggers beyond jsonl (TensorBoard, W&B offline)
        for row in self.history:
            self.trackers.log(row)
        self.start = time.perf_counter() - wall_s
        self.finished = False
        inputs = input_files(cfg)
        self.base = {
            "engine": engine,
            "algorithm": cfg.algorithm.name,
            **({"inputs": inputs} if inputs else {}),
            **({"resumed_from": resumed} if resumed else {}),
        }
        self._dump({"status": "running", **self.base, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})

    @property
    def wall_s(self) -> float:
        return time.perf_counter() - self.start

    def log(self, row: dict[str, Any]) -> dict[str, Any]:
        """Write one metrics row (adding wall time and the best evaluation so far); returns it as written."""
        row = {**row, **self._best(row), "wall_time_s": round(self.wall_s, 3)}
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
        tmp = self.dir / "summary.json.tmp"
        tmp.write_text(strict_dumps(summary, indent=2) + "\n")
        tmp.replace(self.dir / "summary.json")  # a reader never sees half a file

    def _write(self, summary: dict[str, Any]) -> dict[str, Any]:
        summary = {**self.base, **summary, "wall_time_s": round(self.wall_s, 3)}
        self._dump(summary)
        if not self._metrics.closed:
            self._metrics.close()
        self.trackers.finish(summary)
        self.finished = True
        return summary

    def complete(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write a completed run's summary and say so in one line."""
        summary = self._write(summary)
        last = summary["final"]
        best = (
            ""
            if last.get("best_eval_accuracy") is None
            else f" (best {_fraction(last['best_eval_accuracy'])} at round {last['best_round']})"
        )
        print(
            f"done: {summary['rounds']} rounds, {summary['processed_samples']} samples, "
            f"eval_accuracy={_fraction(last.get('eval_accuracy'))}{best}, wall {summary['wall_time_s']} s -> "
            f"{self.dir}\n"
            "      metrics.jsonl: one row per evaluation; summary.json: totals, traffic, memory; plots and tables of "
            "several runs: python -m hosfl_dist.experiments.compare",
            flush=True,
        )
        return summary

    def fail(self, error: str, rounds: int | None = None) -> dict[str, Any]:
        """Record a failed run (the metrics rows written so far stay)."""
        return self._write({"status": "failed", "error": error, **({} if rounds is None else {"rounds": rounds})})

    def interrupt(self, why: str, rounds: int | None, checkpoint: str | None) -> dict[str, Any]:
        """Record a run stopped by a signal, with the checkpoint it can resume from (job.resume=auto)."""
        return self._write({"status": "interrupted", "error": why, "rounds": rounds, "checkpoint": checkpoint})


def metrics_row(server: ServerBase, t: int, processed: int, comm: dict[str, int]) -> dict[str, Any]:
    """One metrics.jsonl object: the server's evaluation statistics and train loss since the previous row.

    A non-finite evaluation loss or accuracy stops the run (:class:`NonFiniteError`): it has diverged.
    """
    loss = server.pop_train_loss()
    metrics = server.pop_eval_metrics()
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
        "final": {
            **{k: last.get(k) for k in ("eval_accuracy", "eval_loss", "train_loss")},
            **{k: last[k] for k in BEST_KEYS if k in last},
        },
        "comm": {"bytes": comm, "training_total_bytes": sum(comm[c] for c in PAPER_CATEGORIES)},
        "client_digests": client_digests,
        "server_digest": server_digest,
    }


def _fraction(value: Any) -> str:
    """An accuracy for the console: 4 decimals (metrics.jsonl and summary.json keep every digit)."""
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def show_eval(bar: Any, row: dict[str, Any] | None) -> None:
    """The last evaluation beside the progress bar (e.g. ``round 120: eval_accuracy 85.3%, eval_loss 0.412``)."""
    if bar is None or not row:
        return
    shown = [f"{k} {row[k]:.1%}" if k.endswith(("accuracy", "f1", "exact_match")) else f"{k} {row[k]:.3g}"
             for k in EVAL_SHOWN if isinstance(row.get(k), (int, float))]  # fmt: skip
    bar.set_postfix_str(f"round {row['round']}: " + ", ".join(shown), refresh=True)


def announce(lines: list[str]) -> None:
    """What the run is about to do, before the progress bar (one line each, flushed)."""
    for line in lines:
        print(line, flush=True)


def progress_bar(cfg: Config) -> Any:
    """A samples progress bar on stderr (None with ``job.progress=false``)."""
    if not cfg.job.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.train.budget_samples, unit="samples", desc=cfg.job.name, dynamic_ncols=True)
