"""A newcomer's first runs: a folder per run unless one is chosen, threads chosen and said, the last evaluation and
the best one in the rows, the emulated link announced."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from hosfl_dist.config import load_config
from hosfl_dist.runtime.process.host import SMALL_MODEL_PARAMS, free_cores, set_threads
from hosfl_dist.runtime.record.progress import show_eval
from hosfl_dist.runfolder.folder import deterministic_out_dir, resolve_out_dir
from hosfl_dist.transport.link import describe_link, describe_traffic
from tiny import TINY_OVERRIDES, run_in_process


def test_runs_without_a_chosen_folder_get_their_own(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="hosfl_dist")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    first = run_in_process([*TINY_OVERRIDES, "job.name=mine"])[0].job.out_dir
    second = run_in_process([*TINY_OVERRIDES, "job.name=mine"])[0].job.out_dir
    assert first != second and Path(first).parent == Path(second).parent == Path("runs/mine")
    for d in (first, second):  # the second run replaced nothing of the first
        assert json.loads(Path(d, "summary.json").read_text())["status"] == "completed"
    assert os.readlink("runs/mine/latest") == Path(second).name
    assert f"run folder {first}" in caplog.text and f"run folder {second}" in caplog.text


def test_a_chosen_folder_is_used_exactly(tmp_path):
    d = tmp_path / "exactly here"
    cfg = run_in_process([*TINY_OVERRIDES, f"job.out_dir={d}"])[0]
    assert Path(cfg.job.out_dir) == d
    files = [".lock", "checkpoints", "config.yaml", "metrics.jsonl", "participation.jsonl", "summary.json"]
    assert sorted(p.name for p in d.iterdir()) == files
    assert [p.name for p in (d / "checkpoints").iterdir()] == ["round-00000010"]  # the final one (checkpoint.final)


def test_slurm_and_resume_find_their_folder_again(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["job.name=x"])
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert deterministic_out_dir(cfg) == Path("runs/x/slurm-4242")  # a requeued job continues it
    assert resolve_out_dir(cfg).job.out_dir == "runs/x/slurm-4242" and os.readlink("runs/x/latest") == "slurm-4242"
    monkeypatch.delenv("SLURM_JOB_ID")
    assert deterministic_out_dir(cfg) is None  # a new run: a new folder
    made = resolve_out_dir(cfg).job.out_dir
    assert Path(made).is_dir() and os.readlink("runs/x/latest") == Path(made).name
    resumed = load_config(None, ["job.name=x", "job.resume=auto"])
    assert deterministic_out_dir(resumed) == Path(made)  # job.resume=auto continues latest


def test_best_evaluation_beside_the_last(tmp_path):
    _, _, summary, rows = run_in_process([*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'r'}"])
    for i, row in enumerate(rows):
        seen = rows[: i + 1]
        best = max(r["eval_accuracy"] for r in seen)
        assert row["best_eval_accuracy"] == best
        assert row["best_round"] == next(r["round"] for r in seen if r["eval_accuracy"] == best)
    assert summary["final"]["best_eval_accuracy"] == rows[-1]["best_eval_accuracy"]
    assert summary["final"]["eval_accuracy"] == rows[-1]["eval_accuracy"]


def test_threads_auto_follows_the_environment_then_the_model_size():
    before = torch.get_num_threads()
    try:
        cfg = load_config(None, [])
        assert set_threads(cfg, 10**9, {"OMP_NUM_THREADS": "3"})[0] == 3 == torch.get_num_threads()
        n, why = set_threads(cfg, SMALL_MODEL_PARAMS - 1, {})
        assert n == 1 and "one" in why
        cores = len(os.sched_getaffinity(0))
        n, why = set_threads(cfg, SMALL_MODEL_PARAMS, {}, load=0.1)
        assert n == cores and f"({cores} cores less the 1-minute load average 0.10, at least 1)" in why  # idle
        assert set_threads(cfg, SMALL_MODEL_PARAMS, {}, load=cores + 3.0)[0] == 1  # a loaded one: one thread
        assert set_threads(load_config(None, ["job.threads=2"]), 10, {"OMP_NUM_THREADS": "1"})[0] == 2
    finally:
        torch.set_num_threads(before)


def test_auto_threads_take_the_cores_the_load_leaves_free():
    # docs/running.md, "Threads": on 2 cores under a load of 2-5 one thread beat two for the 135M LM (25.6 s vs 59.0 s)
    assert [free_cores(2, load) for load in (0.0, 0.3, 0.6, 1.0, 1.4, 2.0, 5.0)] == [2, 2, 1, 1, 1, 1, 1]
    assert free_cores(16, 4.2) == 12 and free_cores(16, 40.0) == 1


def test_the_thread_line_says_where_omp_num_threads_came_from():
    before = torch.get_num_threads()
    try:
        cfg = load_config(None, [])
        _, alone = set_threads(cfg, 10, {"OMP_NUM_THREADS": "1"})
        _, torchrun = set_threads(cfg, 10, {"OMP_NUM_THREADS": "1", "WORLD_SIZE": "3", "RANK": "1"})
    finally:
        torch.set_num_threads(before)
    assert "torchrun" not in alone and "--threads" in alone  # an experiment command's run, or the shell
    assert "torchrun's" in torchrun


def test_without_a_terminal_progress_is_a_log_line_every_tenth_or_minute(monkeypatch, caplog):
    from hosfl_dist.runtime.record import progress

    caplog.set_level(logging.INFO, logger="hosfl_dist")
    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    shown = progress.Progress(load_config(None, ["train.budget_samples=1000", "job.name=p"]), terminal=False)
    assert shown.bar is None
    for done in range(0, 1001, 25):  # rounds of 25 samples, 1 s each
        clock[0] += 1.0
        shown.advance_to(done)
        if done == 500:
            shown.show({"round": 20, "eval_accuracy": 0.5, "eval_loss": 1.25})
    shown.close()
    lines = [r.getMessage() for r in caplog.records if r.name == progress.__name__]
    assert len(lines) == 10 and all("\r" not in line and len(line) < 200 for line in lines)
    assert lines[0].startswith("p: 100/1,000 samples (10%), 5 s, 20 samples/s")
    assert lines[-1].endswith("1,000/1,000 samples (100%), 41 s, 24 samples/s; round 20: eval_accuracy 50.0%, "
                              "eval_loss 1.25")  # fmt: skip
    caplog.clear()  # a slow run: a line a minute between the tenths
    slow = progress.Progress(load_config(None, ["train.budget_samples=1000"]), terminal=False)
    for done in (1, 2, 3):
        clock[0] += progress.LINE_SECONDS
        slow.advance_to(done)
    assert len([r for r in caplog.records if r.name == progress.__name__]) == 3
    quiet = progress.Progress(load_config(None, ["job.progress=false"]), terminal=False)
    assert quiet.bar is None and not quiet.lines  # job.progress=false: nothing at all


def test_progress_counts_what_done_says_and_names_the_final_evaluation(tmp_path, caplog):
    """A budget that is no multiple of a round's samples (250 of rounds of 24): the last progress line counts the
    samples done: and summary.json count (264), and the final evaluation has a line of its own after it."""
    from hosfl_dist.runtime.record import progress

    caplog.set_level(logging.INFO, logger="hosfl_dist")
    _, _, summary, _ = run_in_process([*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'r'}", "job.progress=true",
                                       "train.budget_samples=250", "job.name=p"])  # fmt: skip
    lines = [r.getMessage() for r in caplog.records if r.name == progress.__name__]
    assert summary["processed_samples"] == 264
    counted = [line for line in lines if " samples (" in line]
    assert counted[-1].startswith("p: 264/264 samples (100%)"), counted
    final = lines.index("p: evaluating round 11 (final) …")
    assert final > lines.index(counted[-1])


def test_an_in_process_run_leaves_the_thread_count_as_it_found_it(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hosfl_dist")
    before = torch.get_num_threads()
    run_in_process([*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'r'}", "job.threads=1"])
    assert torch.get_num_threads() == before
    assert "threads: 1 intra-op (job.threads)" in caplog.text


class Bar:
    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.text = text


def test_the_progress_bar_shows_the_last_evaluation():
    bar = Bar()
    show_eval(bar, {"round": 7, "eval_accuracy": 0.8531, "eval_loss": 0.41234, "train_loss": 1.0})
    assert bar.text == "round 7: eval_accuracy 85.3%, eval_loss 0.412"
    show_eval(None, {"round": 1})  # no bar (job.progress=false): nothing to do


def test_the_emulated_link_is_announced_and_summed_up():
    cfg = load_config(None, ["comm.inject_delay=true", "comm.uplink_mbps=10", "comm.rtt_ms=40"])
    line = describe_link(cfg.comm)
    assert "uplink 10 Mb/s" in line and "RTT 40 ms" in line
    stats = {"messages": 3, "uplink_bytes": 2 * 2**20, "downlink_bytes": 10, "delay_uplink_s": 1.6,
             "delay_downlink_s": 0.02}  # fmt: skip
    assert describe_traffic(stats).startswith("emulated link carried 3 messages: 2 MiB up (1.6 s of delay)")


@pytest.mark.parametrize("bad", ["job.threads=-1", "job.out_dir=' '"])
def test_bad_job_keys_are_refused(bad):
    with pytest.raises(Exception, match=bad.split("=")[0]):
        load_config(None, [bad])


def test_traffic_lines_that_carry_the_same_bytes_are_one_line_named_by_both(tmp_path):
    """z up and λ down carry nearly the same bytes: curves.png draws one line, 'up: activations ≈ down: gradients',
    so neither hides under the other."""
    from hosfl_dist.runtime.record.curves import curves_figure

    _, _, _, rows = run_in_process([*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'r'}"])
    fig = curves_figure({"r": rows}, "r")
    labels = fig.axes[2].get_legend_handles_labels()[1]
    assert "up: activations ≈ down: gradients" in labels and "down: gradients" not in labels, labels


def test_a_completed_run_draws_its_curves_and_the_report_draws_several(tmp_path, capsys):
    from hosfl_dist.experiments.report import main as report

    a, b = tmp_path / "a", tmp_path / "b"
    run_in_process([*TINY_OVERRIDES, "job.plots=true", f"job.out_dir={a}"])
    run_in_process([*TINY_OVERRIDES, "algorithm.name=sfl", f"job.out_dir={b}"])
    assert (a / "curves.png").read_bytes().startswith(b"\x89PNG") and not (b / "curves.png").exists()
    assert report([str(b)]) == 0 and (b / "curves.png").is_file()
    both = tmp_path / "both.png"
    assert report([str(a), str(b), "--out", str(both)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(both) and both.stat().st_size > 10_000
    assert report([str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'none'}: no readable metrics.jsonl")


def test_a_torchrun_restart_resumes_its_own_folder_never_another_runs_latest(tmp_path, monkeypatch):
    """``torchrun --max-restarts`` without job.out_dir: a restart (TORCHELASTIC_RESTART_COUNT>0) continues the folder
    its first attempt chose, even when another run of the same job.name started meanwhile and took ``latest``."""
    from hosfl_dist.runtime.process.launch import launch_env

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    cfg = load_config(None, ["job.name=x"])
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}

    def env(run_id: str, restart: int):
        return launch_env({**torchrun, "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": str(restart)})

    first = env("job-a", 0)
    mine = resolve_out_dir(cfg, restarted=False, pin=first.invocation).job.out_dir
    # another run of job.name x started meanwhile: a folder of its own, and latest
    other = resolve_out_dir(cfg, restarted=False, pin=env("job-b", 0).invocation).job.out_dir
    assert other != mine and os.readlink("runs/x/latest") == Path(other).name
    again = env("job-a", 1)
    for resume in ("never", "auto"):
        restarted = load_config(None, ["job.name=x", f"job.resume={resume}"])
        assert resolve_out_dir(restarted, restarted=True, pin=again.invocation).job.out_dir == mine
    # a static rendezvous says "none" for every job: the invocation is then torchrun's agent (this test's process)
    assert env("none", 0).invocation == env("", 1).invocation != first.invocation
    assert env("none", 0).invocation.startswith(f"agent:{os.getppid()}")
    # a restart whose first attempt pinned nothing (it failed before making a folder) gets a new folder, not latest
    fresh = resolve_out_dir(cfg, restarted=True, pin=env("job-c", 1).invocation).job.out_dir
    assert fresh not in (mine, other) and Path(fresh).is_dir()
