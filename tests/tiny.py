"""The tiny synthetic-data run that the in-process, baseline and distributed tests share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hosfl_dist.config import Config, load_config
from hosfl_dist.runtime.inprocess import InProcessRunner

TINY_OVERRIDES = [
    "data.name=synthetic",
    "model.name=small_cnn",
    "model.width=4",
    "split.cut=1",
    "clients.total=6",
    "clients.per_round=3",
    "clients.batch_size=8",
    "zo.num_perturbations=3",
    "clients.optim.lr=1e-2",
    "server.optim.lr=1e-2",
    "train.budget_samples=240",
    "train.eval_every_samples=120",
    "train.eval_batch_size=250",
    "job.progress=false",
]


def runner(overrides: list[str]) -> InProcessRunner:
    """An in-process runner set up (data, model, server, worker built) but not trained."""
    return InProcessRunner(load_config(None, overrides)).setup()


def run_in_process(overrides: list[str]) -> tuple[Config, InProcessRunner, dict[str, Any], list[dict[str, Any]]]:
    """Train with the in-process runtime; return (config, runner, summary, metrics rows)."""
    r = runner(overrides)
    summary = r.run()
    rows = [json.loads(line) for line in Path(r.cfg.job.out_dir, "metrics.jsonl").read_text().splitlines()]
    return r.cfg, r, summary, rows
