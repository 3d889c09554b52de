"""Destinations that cannot destroy, and studies that own their folder (the hardening issue's parts 5 and 6, attacked
one class at a time): an output that is, lies inside or holds a run's folder is refused by every command that
writes; a full disk is one line and exit code 2 with the run (and an export's --out) as they were; a device the
machine cannot run is one line; a second study into a live study's --out is refused; a study never touches the log
of a run another process holds; one point is never run (or counted) twice; Ctrl-C ends a run, a study, an export and
predict in one line naming what stopped and how to go on, exit code 130."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hosfl_dist.errors import write_failure
from hosfl_dist.experiments import runs, sweep
from hosfl_dist.runfolder.lock import RunLock, StudyLock
from tiny import ROOT, TINY_OVERRIDES, run_in_process

RUN = [*TINY_OVERRIDES, "train.budget_samples=96", "checkpoint.interval_samples=48"]
HOLD = "import sys, time; from pathlib import Path; from hosfl_dist.runfolder.lock import RunLock; " \
       "RunLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(600)"  # fmt: skip


def fake_run(folder: Path) -> Path:
    """A folder that reads as a run's (config.yaml beside summary.json and a checkpoint)."""
    (folder / "checkpoints" / "round-00000002").mkdir(parents=True)
    (folder / "config.yaml").write_text("job: {name: x}\n")
    (folder / "summary.json").write_text('{"status": "completed"}\n')
    (folder / "metrics.jsonl").write_text('{"round": 0, "processed_samples": 0, "eval_accuracy": 0.5}\n')
    return folder


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


def one_line(capsys) -> str:
    """The one line a refusal says (after the lines export and predict log as their steps go)."""
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith(("[export] ", "[predict] "))]  # fmt: skip
    assert len(err) == 1, err
    return err[0]


@pytest.fixture(scope="module")
def vision_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("vision") / "run"
    run_in_process([*RUN, f"job.out_dir={out}"])
    return out


# -- destinations that cannot destroy -------------------------------------------------------------------------------
def test_every_command_that_writes_refuses_a_destination_in_a_run_folder(tmp_path, capsys):
    from hosfl_dist.centralized import pretrain
    from hosfl_dist.experiments import report
    from hosfl_dist.measure import memory, zo_dimension
    from hosfl_dist.run import main as run_main

    run = fake_run(tmp_path / "run")
    before = tree_digest(run)
    link = tmp_path / "to-run"
    link.symlink_to(run)
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    refusals = {
        "pretrain": lambda out: pretrain.main(["--config", str(config), "--out", str(out), *TINY_OVERRIDES]),
        "zo_dimension": lambda out: zo_dimension.main(["--config", str(config), "--out", str(out), *TINY_OVERRIDES]),
        "memory": lambda out: memory.main(["--model", "small_cnn", "--out", str(out)]),
        "report": lambda out: report.main([str(run), "--out", str(out)]),
    }
    for name, command in refusals.items():
        for out in (run / "metrics", link / "checkpoints" / "round-00000002" / "x"):
            assert command(out) == 2, name
            line = one_line(capsys)
            assert line.startswith(f"error: --out {out}") and f"is inside the run folder {run}:" in line, (name, line)
    # a run's job.out_dir inside another run's folder (its checkpoints, pruned with them) is refused too
    assert run_main([*RUN, f"job.out_dir={run / 'checkpoints' / 'mine'}"]) == 2
    assert f"lies inside the run folder {run}" in one_line(capsys)
    # a study's --out may hold its own runs, never lie inside a run's folder
    assert sweep.main(["--config", str(config), "--grid", "zo.mu=0.001", "--out", str(link / "study")]) == 2
    assert f"error: --out {link / 'study'} is inside the run folder {run}" in one_line(capsys)
    assert tree_digest(run) == before


def test_a_full_disk_is_one_line_and_exit_2_and_keeps_the_export_and_the_run_as_they_were(
    tmp_path, capsys, monkeypatch, vision_run
):
    from hosfl_dist.export import cli as export_cli
    from hosfl_dist.export import vision

    before = tree_digest(vision_run)
    out = tmp_path / "exported"
    out.mkdir()
    (out / "old.txt").write_text("an earlier export")
    real = vision.write_vision

    def full(restored, folder):  # half the files written, then the disk is full as safetensors reports it
        real(restored, folder)
        raise RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                           'left on device" })')  # fmt: skip

    monkeypatch.setattr(vision, "write_vision", full)
    assert export_cli.main([str(vision_run), "--out", str(out), "--force"]) == 2
    said = one_line(capsys)
    assert said == f"error: cannot write {out}: No space left on device (--out is as it was; the run untouched)"
    assert [p.name for p in out.iterdir()] == ["old.txt"] and not list(tmp_path.glob(".exported.*"))

    def stopped(restored, folder):
        raise KeyboardInterrupt

    monkeypatch.setattr(vision, "write_vision", stopped)
    assert export_cli.main([str(vision_run), "--out", str(out), "--force"]) == 130
    line = one_line(capsys)
    assert line.startswith(f"interrupted: the export of {vision_run} to {out} stopped by Ctrl-C"), line
    assert line.endswith("run the same command again")
    assert [p.name for p in out.iterdir()] == ["old.txt"] and not list(tmp_path.glob(".exported.*"))
    assert tree_digest(vision_run) == before

    # torch.save's and the kernel's words for a refused write, read alike
    torch_said = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    assert str(write_failure(torch_said, "/x")) == "cannot write /x: No space left on device"
    assert str(write_failure(OSError(30, "Read-only file system", "/x/y"))) == "cannot write /x/y: Read-only file " \
        "system"  # fmt: skip
    assert write_failure(OSError(13, "Permission denied")) is None  # a read, for all the caller knows
    assert write_failure(ValueError("no")) is None


def test_predict_refuses_a_destination_in_its_model_and_a_full_disk_leaves_out_as_it_was(
    tmp_path, capsys, monkeypatch
):
    from hosfl_dist.cli import predict

    model, data, out = tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "preds.jsonl"
    model.mkdir()
    data.write_text('{"text": "a", "label": 0}\n')
    out.write_text("earlier predictions\n")
    argv = ["--model", str(model), "--data", str(data), "--out", str(out)]
    (model / "model.safetensors").write_bytes(b"weights")
    assert predict.main([*argv[:-1], str(model / "model.safetensors")]) == 2
    assert "lies inside the --model folder: write the predictions elsewhere" in one_line(capsys)
    assert (model / "model.safetensors").read_bytes() == b"weights"
    for device in ("meta", "xla", "mps", "nonsense"):
        assert predict.main([*argv, "--device", device]) == 2
        assert "expected cpu, cuda" in one_line(capsys)

    monkeypatch.setattr(predict, "_record", lambda folder: {"task": {}})
    monkeypatch.setattr(predict, "task_of", lambda record, args: (None, None))
    monkeypatch.setattr(predict, "load_examples", lambda *a: ([], True))
    monkeypatch.setattr(predict, "load_model", lambda *a: (None, None))
    monkeypatch.setattr(predict, "predict", lambda *a, **k: ([{"index": 0}], {}))
    real = Path.write_text

    def full(self, text, *a, **k):
        if self.name.endswith(".partial"):
            real(self, text[: len(text) // 2])
            raise OSError(28, "No space left on device", str(self))
        return real(self, text, *a, **k)

    monkeypatch.setattr(Path, "write_text", full)
    argv.append("--allow-unsigned")  # the stand-in model folder holds no export's signed manifest
    assert predict.main(argv) == 2
    assert one_line(capsys) == f"error: cannot write {out.with_name('.preds.jsonl.partial')}: No space left on device"
    assert out.read_text() == "earlier predictions\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "data.jsonl", "model", "preds.jsonl"]  # fmt: skip

    def stopped(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(predict, "load_model", stopped)
    assert predict.main(argv) == 130
    assert one_line(capsys).startswith(f"interrupted: predicting {data} with {model} stopped by Ctrl-C")


def test_a_device_this_machine_cannot_run_is_one_line_for_every_command_that_takes_one(tmp_path, capsys):
    from hosfl_dist.experiments import compare
    from hosfl_dist.measure import memory
    from hosfl_dist.run import main as run_main

    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    for device in ("meta", "mps", "xla", "nonsense", *(() if _cuda() else ("cuda", "cuda:1"))):
        assert memory.main(["--model", "small_cnn", "--device", device, "--out", str(tmp_path / "m")]) == 2
        assert "--device" in one_line(capsys)
        assert run_main([*RUN, f"job.device={device}", f"job.out_dir={tmp_path / 'r'}"]) == 2
        assert "job.device" in one_line(capsys)
        study = ["--config", str(config), "--methods", "hosfl", "--out", str(tmp_path / "s"), f"job.device={device}"]
        assert compare.main(study) == 2  # a study says it per row, then how many rows cannot start
        err = capsys.readouterr().err.strip().splitlines()
        assert "job.device" in err[0] and len(err) <= 2 and all(line.startswith("error: ") for line in err), err
    assert not (tmp_path / "m").exists() and not (tmp_path / "r").exists() and not (tmp_path / "s").exists()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# -- a study owns its folder ----------------------------------------------------------------------------------------
def test_a_second_study_into_a_live_studys_out_is_refused_in_one_line(tmp_path, capsys):
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    out = tmp_path / "study"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD.replace("RunLock", "StudyLock"), str(out)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        for command in (["--dry-run"], []):
            assert sweep.main(["--config", str(config), "--grid", "zo.mu=0.001", "--out", str(out), *command]) == 2
            line = one_line(capsys)
            assert line.startswith(f"error: --out {out} is in use by a live study (pid {holder.pid} on "), line
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in out.iterdir()) == [".study.lock"]  # no record, no report, no run folder
    lock = StudyLock(out)
    lock.acquire()  # the kernel let go of the dead holder's lock
    lock.release()


def test_a_study_never_touches_the_log_of_a_run_another_process_holds(tmp_path, capsys):
    """The observed bug: a second study opened a live run's log.txt (emptying it) before the run's lock refused it.
    Now the log is opened only under the run's lock: the loser leaves the winner's bytes alone."""
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    folder = tmp_path / "study" / "runs" / "p" / "seed0"
    folder.mkdir(parents=True)
    winner = b"the winner's log: round 1\n"
    (folder / "log.txt").write_bytes(winner)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        spec = runs.RunSpec("p", 0, list(RUN), folder)
        record = runs.launch(str(config), [spec])
        assert record["launched"] == [] and record["failed"] == [f"{folder} (see {folder / 'log.txt'})"]
        said = capsys.readouterr().out
        assert "[FAILED rc=2] p seed 0" in said and f"in use by a live run (pid {holder.pid} on " in said
        assert (folder / "log.txt").read_bytes() == winner
    finally:
        holder.kill()
        holder.wait()
    # once the holder is gone the log is the study's again (and the run's lock is free for the run)
    log = runs.open_log(folder)
    log.close()
    assert (folder / "log.txt").read_bytes() == b"" and RunLock(folder).acquire() is None


def test_one_point_is_never_run_or_counted_twice(tmp_path, capsys):
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    out = tmp_path / "study"

    def refused(*grid: str) -> list[str]:
        argv = ["--config", str(config), *RUN, "--out", str(out), "--dry-run"]
        assert sweep.main([*argv, *(w for g in grid for w in ("--grid", g))]) == 2
        return capsys.readouterr().err.strip().splitlines()

    err = refused("zo.mu=1e-3,0.001")  # one value written two ways: one config
    assert err[0] == "error: grid point zo.mu=0.001 seed 0: the same run as grid point zo.mu=1e-3 seed 0 (one " \
        "config, written two ways)"  # fmt: skip
    assert err[-1].startswith("error: 1 run(s) would be counted twice")
    err = refused("job.name=a+b,a_b")  # two labels, one folder name
    assert err[0] == f"error: grid point job.name=a_b seed 0: its run folder {out}/runs/job.name=a_b/seed0 is that " \
        "of grid point job.name=a+b seed 0 too"  # fmt: skip
    err = refused("zo.mu=0.001,0.001")
    assert err == ["error: --grid zo.mu: '0.001,0.001' gives 0.001 more than once (each point runs once)"]
    # a run folder that is a link out of --out (another run's folder) is not the study's to write
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "runs" / "zo.mu=0.001").mkdir(parents=True)
    (out / "runs" / "zo.mu=0.001" / "seed0").symlink_to(elsewhere)
    err = refused("zo.mu=0.001")
    assert err[0] == f"error: grid point zo.mu=0.001 seed 0: its run folder {out}/runs/zo.mu=0.001/seed0 resolves to " \
        f"{elsewhere}, out of --out {out}"  # fmt: skip
    assert not (out / "study.json").exists()


# -- Ctrl-C: one line naming what stopped and how to go on ------------------------------------------------------------
def _interrupt_after_first_checkpoint(cmd: list[str], run_dir: Path, cwd: Path) -> subprocess.CompletedProcess:
    """``cmd`` in a session of its own, Ctrl-C to its process group (what a terminal does) once ``run_dir`` holds a
    checkpoint."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not any((run_dir / "checkpoints").glob("round-*[0-9]")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


LONG = [*TINY_OVERRIDES, "train.budget_samples=480000", "checkpoint.interval_samples=48", "job.threads=1",
        "job.progress=false"]  # fmt: skip


def test_ctrl_c_ends_a_run_in_one_line_naming_how_to_resume_it(tmp_path):
    """About 6 s on the 2-core machine (interpreter, imports, the first checkpoint, the stop)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hosfl_dist.run", *LONG, f"job.out_dir={run_dir}"]
    done = _interrupt_after_first_checkpoint(cmd, run_dir, tmp_path)
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith(("interrupted", "error"))]
    assert len(said) == 1 and said[0].startswith("interrupted: the run stopped by SIGINT after round "), said
    assert said[0].endswith(f"resume it: the same command with job.resume=auto job.out_dir={run_dir}")
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"


@pytest.mark.slow  # a study's checks and its run's start: about 15 s on the 2-core machine
def test_ctrl_c_ends_a_study_in_one_line_and_its_run_checkpoints(tmp_path):
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    out = tmp_path / "study"
    run_dir = out / "runs" / "zo.mu=0.001" / "seed0"
    cmd = [sys.executable, "-m", "hosfl_dist.experiments.sweep", "--config", str(config), *LONG, "--grid",
           "zo.mu=0.001", "--out", str(out)]  # fmt: skip
    done = _interrupt_after_first_checkpoint(cmd, run_dir, tmp_path)
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"interrupted: hosfl_dist.experiments.sweep into {out} stopped by Ctrl-C after "
        + done.stderr.split(" stopped by Ctrl-C after ")[1].split(" s;")[0]
        + " s; its finished runs are kept and reused, an unfinished one resumes from its last checkpoint: run the same "
        "command again"
    ]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert "interrupted: the run stopped by SIGINT" in (run_dir / "log.txt").read_text()


def _safetensors_error(text: str) -> Exception:
    from safetensors import SafetensorError

    return SafetensorError(text)


def _chained(text: str) -> Exception:
    try:
        raise OSError(28, "No space left on device")
    except OSError as cause:
        try:
            raise RuntimeError(text) from cause
        except RuntimeError as exc:
            return exc


@pytest.mark.parametrize(
    ("make", "text", "reason", "free"),
    [
        (_safetensors_error, "Error while serializing: I/O error: No space left on device (os error 28)",
         "No space left on device", None),
        (_safetensors_error, 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
         'left on device" })', "No space left on device", None),
        (RuntimeError, "saving failed: [Errno 122] Disk quota exceeded", "Disk quota exceeded", None),
        (_chained, "the writer gave up", "No space left on device", None),
        (RuntimeError, "I/O error while writing the shard", "No space left on device", 4096),  # the disk: no room
    ],
    ids=["safetensors-0.8", "safetensors-earlier", "errno-in-text", "raised-from", "disk-usage"],
)
def test_a_full_disk_is_read_by_its_errno_in_every_librarys_words(
    tmp_path, capsys, monkeypatch, vision_run, make, text, reason, free
):
    import shutil

    from hosfl_dist.export import cli as export_cli
    from hosfl_dist.export import vision

    before = tree_digest(vision_run)
    out = tmp_path / "exported"
    real = vision.write_vision

    def full(restored, folder):
        real(restored, folder)
        raise make(text)

    monkeypatch.setattr(vision, "write_vision", full)
    if free is None:  # a write that fails without saying why, where the disk has room: not called a full disk
        assert write_failure(RuntimeError("I/O error while writing the shard"), tmp_path) is None
    else:
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=free))
    assert export_cli.main([str(vision_run), "--out", str(out)]) == 2
    assert one_line(capsys) == f"error: cannot write {out}: {reason} (--out is as it was; the run untouched)"
    assert not out.exists() and not list(tmp_path.glob(".exported.*"))
    assert tree_digest(vision_run) == before
