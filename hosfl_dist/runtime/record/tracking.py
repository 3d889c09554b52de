"""Experiment trackers beside metrics.jsonl (``job.loggers``): TensorBoard and Weights & Biases (offline).

Only the process that writes the run's record (rank 0, or the in-process runtime) owns them, through
:class:`~hosfl_dist.runtime.record.writer.RunRecord`. Each metrics row is logged at step = processed samples (the
paper's x-axis): evaluation accuracy and loss, train loss, the skipped contributions, cumulative traffic per category
and the wall time; the completed run's summary adds the totals, the per-worker round time and every rank's peak memory.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from hosfl_dist.config import Config, config_to_dict
from hosfl_dist.errors import ConfigError

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""Logger -> the package it needs (jsonl needs none)."""


def check_loggers(cfg: Config) -> None:
    """Refuse a logger whose package is not installed, before anything is built (one line, exit 2)."""
    for name in cfg.job.loggers:
        pkg = PACKAGES.get(name)
        if pkg is not None and importlib.util.find_spec(pkg) is None:
            raise ConfigError(f"invalid value for job.loggers: {name!r} needs the {pkg} package (pip install {pkg})")


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row, flattened (``comm/<category>``); None and non-numbers are left out."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in ("round", "processed_samples", "nonfinite"):
            continue
        if isinstance(value, dict):
            for sub, v in value.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[f"{key}/{sub}"] = float(v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def summary_scalars(summary: dict[str, Any]) -> dict[str, float]:
    """Totals of a completed run: training traffic, mean round time per worker, peak memory per rank."""
    out: dict[str, float] = {}
    if "comm" in summary:
        out["total/training_bytes"] = float(summary["comm"]["training_total_bytes"])
    for worker, st in (summary.get("transport") or {}).get("workers", {}).items():
        if st.get("rounds"):
            out[f"round_s/{worker}"] = st["round_s"] / st["rounds"]
    for m in summary.get("memory", []):
        out[f"memory/peak_rss_bytes/{m['role']}_{m['rank']}"] = float(m["peak_rss_bytes"] or 0)
        out[f"memory/param_bytes/{m['role']}_{m['rank']}"] = float(m["param_bytes"])
        if "peak_cuda_bytes" in m:
            out[f"memory/peak_cuda_bytes/{m['role']}_{m['rank']}"] = float(m["peak_cuda_bytes"])
    return out


class Trackers:
    """The trackers ``cfg.job.loggers`` names besides jsonl, writing under ``out_dir``."""

    def __init__(self, cfg: Config, out_dir: Path) -> None:
        check_loggers(cfg)
        self.tb: Any = None
        self.wandb: Any = None
        self.step = 0
        if "tensorboard" in cfg.job.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        if "wandb" in cfg.job.loggers:
            import wandb

            self.wandb = wandb.init(
                project=cfg.job.name, dir=str(out_dir), mode="offline", config=config_to_dict(cfg), reinit=True
            )

    def log(self, row: dict[str, Any]) -> None:
        self.step = int(row.get("processed_samples", self.step))
        values = scalars(row)
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, global_step=self.step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({**values, "round": row.get("round")}, step=self.step)

    def finish(self, summary: dict[str, Any]) -> None:
        values = summary_scalars(summary) if summary.get("status") in ("completed", "stopped") else {}
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, global_step=self.step)
            self.tb.add_text("status", f"{summary.get('status')}: {summary.get('error', '')}", global_step=self.step)
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.summary.update({**values, "status": summary.get("status")})
            self.wandb.finish()
            self.wandb = None
