"""What the tests share: the tiny synthetic-data run, and a torchrun launcher for the multi-process tiers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

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


ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 240


def torchrun(nproc: int, target: list[str], timeout: float = LAUNCH_TIMEOUT_S) -> tuple[int, str, float]:
    """``torchrun`` with c10d rendezvous on a free port; the process tree is killed if it outlives ``timeout``."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:0",
        f"--rdzv-id={uuid.uuid4().hex[:8]}",
        *target,
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s:\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, time.perf_counter() - start


def read_run(out_dir: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("wall_time_s")
    return rows, json.loads((out_dir / "summary.json").read_text())
