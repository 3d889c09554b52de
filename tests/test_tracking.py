"""Experiment tracking (job.loggers): TensorBoard event files written by the run's writer and read back."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tiny import ROOT, TINY_OVERRIDES, run_in_process

from hosfl_dist.config import load_config
from hosfl_dist.errors import ConfigError
from hosfl_dist.runtime.record.tracking import check_loggers, scalars


def _events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_gets_every_metrics_row_and_the_run_totals(tmp_path):
    _, _, summary, rows = run_in_process([*TINY_OVERRIDES, "job.loggers=[jsonl, tensorboard]",
                                          f"job.out_dir={tmp_path}"])  # fmt: skip
    events = _events(tmp_path / "tensorboard")
    steps = [r["processed_samples"] for r in rows]
    assert events["eval_accuracy"] == [(s, pytest.approx(r["eval_accuracy"])) for s, r in zip(steps, rows)]
    sent = events["comm/uplink_activations"]
    assert [v for _, v in sent] == [float(r["comm"]["uplink_activations"]) for r in rows]
    assert events["total/training_bytes"] == [(steps[-1], float(summary["comm"]["training_total_bytes"]))]
    assert any(tag.startswith("memory/peak_rss_bytes/in-process") for tag in events)
    assert (tmp_path / "metrics.jsonl").is_file()  # jsonl is always on


def test_a_logger_must_be_known_and_installed():
    with pytest.raises(ConfigError, match=r"job\.loggers.*unknown logger 'csv'"):
        load_config(None, ["job.loggers=[csv]"])
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ConfigError, match=r"'wandb' needs the wandb package"):
            check_loggers(load_config(None, ["job.loggers=[jsonl, wandb]"]))
        res = subprocess.run([sys.executable, "-m", "hosfl_dist.run", "job.loggers=[wandb]", "--check"], cwd=ROOT,
                             capture_output=True, text=True)  # fmt: skip
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and "pip install wandb" in res.stderr


def test_rows_are_flattened_to_numbers():
    row = {"round": 3, "processed_samples": 96, "eval_accuracy": 0.5, "eval_loss": None, "comm": {"eval": 10}}
    assert scalars(row) == {"eval_accuracy": 0.5, "comm/eval": 10.0}
