"""Stopping as an end of its own (docs/running.md, "Stopping early"): a callback's ``control.should_training_stop``
(HF's convention) or ``run.should_stop`` (Lightning's) ends the run after the round, which is then evaluated,
checkpointed, exported and resumed like a finished run, with ``status: "stopped"``; ``train.early_stopping`` is built
on it, in one process and under torchrun; a study reuses a point its early stopping ended and marks where it
stopped."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap

import pytest

import hosfl_dist
from hosfl_dist.config import load_config
from hosfl_dist.core.stopping import EarlyStopping, stops_at
from hosfl_dist.errors import ConfigError
from hosfl_dist.runfolder.folder import describe_status
from hosfl_dist.runfolder.identity import comparable_config, fingerprint
from hosfl_dist.runtime.checks import load_run_config
from tiny import ROOT, TINY_OVERRIDES, read_run, rows_of, torchrun, user_folder, user_module

STOPS_MOD = user_module("stops")

STOPS = '''
"""Callbacks that end a run early, each in its own way."""
import hosfl_dist


class StopAt(hosfl_dist.Callback):
    """HF's convention: on the leader worker under torchrun."""

    AT = 20

    def on_round_end(self, round, info, control):
        if round >= self.AT:
            control.should_training_stop = True


class StopAt4(StopAt):
    AT = 4


class StopAtLast(StopAt):
    AT = 10  # the tiny run's last round


class StopOnRow(hosfl_dist.Callback):
    """Lightning's convention: the Run of on_train_start, on rank 0 under torchrun."""

    def on_train_start(self, run):
        self.run = run

    def on_evaluate(self, row):
        if row["round"] >= 5:
            self.run.should_stop = True


class EndBoom(hosfl_dist.Callback):
    def on_train_end(self, summary):
        raise ValueError("boom at the end")
'''

LONG = [*TINY_OVERRIDES, "train.budget_samples=720", "train.eval_every_samples=168"]
"""30 rounds of 24 samples, evaluated at rounds 7, 14, 21, 28 and 30: round 20 is not an evaluation point."""
EARLY = [
    "train.eval_every_samples=24",
    "train.early_stopping.metric=eval_accuracy",
    "train.early_stopping.patience=2",
    "train.early_stopping.min_delta=1",  # an accuracy never rises by more than 1: it stops after 2 evaluations
]


@pytest.fixture
def stops(tmp_path, monkeypatch):
    user_folder(tmp_path, monkeypatch, {"stops": STOPS})
    module = importlib.import_module(STOPS_MOD)

    yield module
    sys.modules.pop(STOPS_MOD, None)


def run_command(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hosfl_dist.run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_a_callback_that_stops_at_round_20_ends_stopped_exportable_and_resumable(tmp_path, stops):
    from hosfl_dist.export.cli import main as export_main

    out = tmp_path / "stopped"
    run = hosfl_dist.train(None, [*LONG, f"job.out_dir={out}", "job.plots=true"], callbacks=[stops.StopAt()])
    summary = run.summary
    assert summary["status"] == "stopped" and summary["rounds"] == 20 and summary["processed_samples"] == 480
    assert summary["stopped"] == {"by": f"callback {STOPS_MOD}:StopAt.on_round_end", "reason": "", "round": 20,
                                  "processed_samples": 480, "budget_samples": 720}  # fmt: skip
    assert [r["round"] for r in run.metrics] == [0, 7, 14, 20]  # the stop's round is evaluated
    assert summary["final"]["eval_accuracy"] == run.metrics[-1]["eval_accuracy"]
    assert summary["client_digests"] and summary["server_digest"] and summary["comm"]["training_total_bytes"] > 0
    assert (out / "checkpoints/round-00000020/meta.json").is_file() and (out / "curves.png").is_file()
    said = f"{out}: stopped early (callback {STOPS_MOD}:StopAt.on_round_end), 20 rounds"
    assert describe_status(out).startswith(said)

    exported = tmp_path / "export"
    assert export_main([str(out), "--out", str(exported)]) == 0
    card = (exported / "README.md").read_text()
    assert "round 20" in card and "`stopped`" in card

    again = hosfl_dist.train(None, [*LONG, f"job.out_dir={out}", "job.resume=auto"])  # without the callback
    resumed = again.summary
    assert resumed["status"] == "completed" and resumed["rounds"] == 30
    assert resumed["resumed_from"].endswith("round-00000020")
    assert [r["round"] for r in again.metrics] == [0, 7, 14, 20, 21, 28, 30]  # nothing lost, the rest appended
    reference = hosfl_dist.train(None, [*LONG, f"job.out_dir={tmp_path / 'reference'}"]).summary
    assert resumed["client_digests"] == reference["client_digests"]  # the stop changed no bit of the run
    assert resumed["server_digest"] == reference["server_digest"]
    assert resumed["comm"]["training_total_bytes"] == reference["comm"]["training_total_bytes"]


def test_run_should_stop_ends_the_run_after_its_round_and_a_stop_in_the_last_round_changes_nothing(tmp_path, stops):
    out = tmp_path / "row"
    run = hosfl_dist.train(None, [*TINY_OVERRIDES, f"job.out_dir={out}"], callbacks=[stops.StopOnRow()])
    assert run.summary["status"] == "stopped" and run.summary["rounds"] == 5
    assert run.summary["stopped"]["by"] == f"callback {STOPS_MOD}:StopOnRow.on_evaluate"
    assert [r["round"] for r in run.metrics] == [0, 5]  # the round of the row that asked, evaluated once
    with pytest.raises(ConfigError, match="not a live run's"):
        hosfl_dist.load_run(out).should_stop = True

    last = hosfl_dist.train(None, [*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'last'}"], callbacks=[stops.StopAtLast()])
    assert last.summary["status"] == "completed" and "stopped" not in last.summary  # the run ended as it would have


def test_early_stopping_ends_the_run_and_a_resume_of_it_has_nothing_to_do(tmp_path):
    from hosfl_dist.runtime.record.writer import done_line

    out = tmp_path / "early"
    args = [*TINY_OVERRIDES, *EARLY, f"job.out_dir={out}"]
    hosfl_dist.train(None, args)
    rows, summary = read_run(out)
    assert "48 samples (stopped early, of a budget of 240: train.early_stopping)," in done_line(summary, out)
    assert summary["status"] == "stopped" and [r["round"] for r in rows] == [0, 1, 2]
    assert summary["stopped"]["by"] == "train.early_stopping" and summary["stopped"]["round"] == 2
    assert "2 evaluation(s) without a rise of more than 1 from the best" in summary["stopped"]["reason"]
    assert (out / "checkpoints/round-00000002").is_dir()

    again = run_command(*args, "job.resume=auto")
    assert again.returncode == 0, again.stderr[-2000:]
    said = f"done: {out} holds this run, stopped early by train.early_stopping after round 2; nothing to do"
    assert again.stdout.strip() == f"{said} (job.resume=auto)"
    assert read_run(out) == (rows, summary)  # untouched


def test_early_stopping_follows_the_rows_in_either_direction():
    rows = [{"round": r, "eval_loss": v, "train_loss": t} for r, v, t in
            [(0, 2.0, None), (5, 1.0, 1.5), (10, 0.95, 1.4), (15, 0.99, 1.41), (20, 0.97, 1.45)]]  # fmt: skip
    section = load_config(None, ["train.early_stopping.metric=eval_loss", "train.early_stopping.patience=2"])
    assert stops_at(rows, section.train.early_stopping)["round"] == 20  # auto: a loss falls; 0.95 stays the best
    assert stops_at(rows[:4], section.train.early_stopping) is None
    wide = load_config(None, ["train.early_stopping.metric=eval_loss", "train.early_stopping.patience=2",
                              "train.early_stopping.min_delta=0.1"]).train.early_stopping  # fmt: skip
    assert stops_at(rows, wide)["round"] == 15  # 0.95 is no fall of more than 0.1 from 1.0
    rising = EarlyStopping("eval_loss", 1, mode="max")
    assert [rising.update(r) is not None for r in rows] == [False, True, True, True, True]
    train = EarlyStopping("train_loss", 2)  # round 0 has none: not an evaluation of it
    assert [train.update(r) is not None for r in rows] == [False, False, False, False, True]
    assert EarlyStopping.of(load_config(None, []).train.early_stopping) is None  # off by default


def test_early_stopping_is_identity_when_on_and_refuses_a_metric_the_rows_lack():
    base = fingerprint({"config": comparable_config(load_config(None, TINY_OVERRIDES))})
    idle = load_config(None, [*TINY_OVERRIDES, "train.early_stopping.patience=9"])  # off: no metric
    assert fingerprint({"config": comparable_config(idle)}) == base  # earlier runs keep their fingerprints
    on = load_config(None, [*TINY_OVERRIDES, *EARLY])
    assert fingerprint({"config": comparable_config(on)}) != base
    with pytest.raises(ConfigError, match=r"train.early_stopping.metric: 'eval_f1' \(the metrics rows of "
                       r"data.name=synthetic hold eval_accuracy, eval_loss, train_loss\)"):  # fmt: skip
        load_run_config(None, [*TINY_OVERRIDES, "train.early_stopping.metric=eval_f1"])
    for bad, said in (("metric=accuracy", "a metrics row's eval_<name> or train_loss"), ("patience=0", ">= 1"),
                      ("min_delta=-1", ">= 0"), ("mode=up", "mode")):  # fmt: skip
        with pytest.raises(ConfigError, match=said):
            load_config(None, [f"train.early_stopping.{bad}"])


@pytest.mark.multiprocess
@pytest.mark.slow  # two torchrun jobs and a run in one process: 35 s on the 2-core machine
def test_early_stopping_and_a_leaders_callback_stop_every_worker_under_torchrun(tmp_path, stops):
    one = hosfl_dist.train(None, [*TINY_OVERRIDES, *EARLY, "job.threads=1", f"job.out_dir={tmp_path / 'one'}"])
    out = tmp_path / "dist"
    rc, log, _ = torchrun(3, ["-m", "hosfl_dist.run", *TINY_OVERRIDES, *EARLY, f"job.out_dir={out}"])
    assert rc == 0, log[-3000:]
    rows, summary = read_run(out)
    assert summary["status"] == "stopped" and summary["stopped"]["by"] == "train.early_stopping"
    assert rows == rows_of(one.out_dir) and summary["rounds"] == one.summary["rounds"] == 2  # the rows rank 0 wrote
    assert summary["client_digests"]["worker_1"] == summary["client_digests"]["worker_2"]  # every worker stopped

    led = tmp_path / "led"
    watched = [f"job.callbacks=[{STOPS_MOD}:StopAt4, {STOPS_MOD}:EndBoom]"]
    rc, log, _ = torchrun(3, ["-m", "hosfl_dist.run", *TINY_OVERRIDES, *watched, f"job.out_dir={led}"])
    assert rc == 0, log[-3000:]
    rows, summary = read_run(led)
    assert summary["status"] == "stopped" and summary["rounds"] == 4 and [r["round"] for r in rows] == [0, 4]
    assert summary["stopped"]["by"] == f"callback {STOPS_MOD}:StopAt4.on_round_end"  # the leader worker's, heard by all
    assert summary["callback_error"] == f"callback {STOPS_MOD}:EndBoom.on_train_end raised ValueError: boom at the end"
    assert summary["client_digests"] and summary["final"]["eval_accuracy"] == rows[-1]["eval_accuracy"]


@pytest.mark.slow  # a study of two methods, then the same command again: 20 s on the 2-core machine
def test_a_study_point_that_stopped_early_is_marked_with_where_and_reused(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(textwrap.dedent("""\
        data: {name: synthetic}
        model: {name: small_cnn, width: 4}
        split: {cut: 1}
        clients: {total: 6, per_round: 3, batch_size: 8}
        zo: {num_perturbations: 3}
        train: {budget_samples: 120, eval_every_samples: 24}
        job: {progress: false, plots: false}
    """))
    early = [f"--method-set=hosfl:{o}" for o in EARLY[1:]]
    command = [sys.executable, "-m", "hosfl_dist.experiments.compare", "--config", str(config), "--methods",
               "hosfl,sfl", *early, "--out", str(tmp_path / "study")]  # fmt: skip
    res = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    table = (tmp_path / "study/table.md").read_text()
    head = next(line for line in table.splitlines() if line.startswith("| method"))
    assert head.rstrip(" |").endswith("stopped early")
    hosfl = next(line for line in table.splitlines() if line.startswith("| HO-SFL"))
    sfl = next(line for line in table.splitlines() if line.startswith("| SFL"))
    assert hosfl.endswith("| seed 0: round 2, 48 samples |") and sfl.endswith("| – |")
    rows = {r["variant"]: r for r in json.loads((tmp_path / "study/table.json").read_text())["rows"]}
    assert rows["hosfl"]["stopped"] == [{"round": 2, "processed_samples": 48, "by": "train.early_stopping"}]
    assert rows["sfl"]["stopped"] == [None] and rows["hosfl"]["processed_samples"] == 48

    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"reusing {tmp_path / 'study/runs/hosfl/seed0'} (stopped, same identity" in again.stdout
    assert "0 run(s) launched" in again.stdout
