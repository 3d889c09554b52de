"""A run is never silently wrong: checkpoints prove themselves, resume refuses another run, a live run owns its folder,
and every ending the process can see is recorded (the integrity issue's classes, attacked one by one)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hosfl_dist.errors import ConfigError, Interrupted
from hosfl_dist.run import main
from hosfl_dist.runfolder import folder as folder_mod
from hosfl_dist.runfolder import identity as identity_mod
from hosfl_dist.runfolder import lock as lock_mod
from hosfl_dist.runfolder.checkpoints import checkpoint_folders, verify_checkpoint
from hosfl_dist.runfolder.folder import run_status
from hosfl_dist.runfolder.lock import lock_holder
from hosfl_dist.runtime.record.writer import RunRecord
from tiny import ROOT, TINY_OVERRIDES, lm_overrides, rows_of, run_in_process, stop_at, write_text_files

RUN = [*TINY_OVERRIDES, "train.budget_samples=480", "checkpoint.interval_samples=48", "checkpoint.keep=3"]
"""Twenty rounds of K=3 clients of 8 samples, a checkpoint every second round, the three newest kept."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    _, _, summary, _ = run_in_process([*RUN, f"job.out_dir={out}"])
    return out, summary


def interrupted(tmp_path: Path, monkeypatch, round_idx: int = 9) -> Path:
    """A run stopped after round ``round_idx`` + 1 with checkpoints of rounds 6, 8 and 10 (keep=3)."""
    out = tmp_path / "run"
    stop_at(monkeypatch, "hosfl", round_idx)
    with pytest.raises(Interrupted):
        run_in_process([*RUN, f"job.out_dir={out}"])
    monkeypatch.undo()
    assert [p.name for p in checkpoint_folders(out)] == ["round-00000010", "round-00000008", "round-00000006"]
    return out


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    path.write_bytes(bytes(data))


def _shard(ckpt: Path) -> Path:
    return next((ckpt / "model").glob("__0_*.distcp"))


CORRUPTIONS = {
    "flipped shard bytes": (lambda c: _flip(_shard(c)), "model/__0_0.distcp: hash mismatch"),
    "truncated state.pt": (lambda c: (c / "state.pt").write_bytes((c / "state.pt").read_bytes()[:1000]),
                           "state.pt: 1000 bytes, the manifest says"),
    "deleted state.pt": (lambda c: (c / "state.pt").unlink(), "state.pt: missing"),
    "deleted model/.metadata": (lambda c: (c / "model" / ".metadata").unlink(), "model/.metadata: missing"),
    "deleted manifest": (lambda c: (c / "manifest.json").unlink(), "no manifest.json"),
    "edited manifest": (lambda c: (c / "manifest.json").write_text(
        (c / "manifest.json").read_text().replace('"round": 10', '"round": 11')), "manifest.json altered"),
}  # fmt: skip


# -- checkpoints that prove themselves --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_a_corrupt_newest_checkpoint_is_named_and_the_newest_intact_one_resumes_to_the_same_result(
    tmp_path, monkeypatch, caplog, reference, kind
):
    ref_dir, ref = reference
    out = interrupted(tmp_path, monkeypatch)
    corrupt, said = CORRUPTIONS[kind]
    corrupt(out / "checkpoints" / "round-00000010")
    caplog.set_level(logging.WARNING, logger="hosfl_dist")
    _, _, got, _ = run_in_process([*RUN, f"job.out_dir={out}", "job.resume=auto"])
    assert f"resuming from round 8: round 10 failed verification ({said}" in caplog.text
    assert got["status"] == "completed" and got["resumed_from"].endswith("round-00000008")
    assert got["client_digests"] == ref["client_digests"] and got["server_digest"] == ref["server_digest"]
    assert rows_of(out) == rows_of(ref_dir) and got["comm"] == ref["comm"]


def test_with_no_intact_checkpoint_resume_stops_in_one_line(tmp_path, monkeypatch, capsys):
    out = interrupted(tmp_path, monkeypatch)
    for ckpt in checkpoint_folders(out):
        _flip(_shard(ckpt))
    rc = main([*RUN, f"job.out_dir={out}", "job.resume=auto"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith(f"error: job.out_dir {out}: no checkpoint verifies (round 10: ")
    assert "Traceback" not in "\n".join(err)
    assert json.loads((out / "summary.json").read_text())["status"] == "interrupted"  # nothing was touched


def test_a_checkpoint_lists_every_file_and_retention_keeps_the_last_verified_one(tmp_path, monkeypatch):
    out = interrupted(tmp_path, monkeypatch)
    newest = out / "checkpoints" / "round-00000010"
    manifest = json.loads((newest / "manifest.json").read_text())
    on_disk = {p.relative_to(newest).as_posix() for p in newest.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk and manifest["round"] == 10
    assert manifest["identity"]["config"]["clients"]["optim"]["lr"] == 1e-2 and verify_checkpoint(newest) is None
    # a save whose result does not verify (the disk did not keep it) removes nothing older
    from hosfl_dist.runtime import checkpoint as ckpt_mod

    real = ckpt_mod.verify_checkpoint

    def failing_new_saves(folder, rank=None, digest=None):
        return "hash mismatch (injected)" if folder.name > newest.name else real(folder, rank, digest)

    monkeypatch.setattr(ckpt_mod, "verify_checkpoint", failing_new_saves)
    _, _, got, _ = run_in_process([*RUN, f"job.out_dir={out}", "job.resume=auto"])
    assert got["status"] == "completed"
    assert [p.name for p in checkpoint_folders(out)][-3:] == ["round-00000010", "round-00000008", "round-00000006"]


# -- resume refuses another run ---------------------------------------------------------------------------------------
def test_resume_compares_with_the_checkpoint_not_with_config_yaml(tmp_path, monkeypatch, capsys):
    out = interrupted(tmp_path, monkeypatch)
    (out / "config.yaml").unlink()  # what every start rewrites says nothing
    rc = main([*RUN, f"job.out_dir={out}", "job.resume=auto", "clients.optim.lr=0.02", "server.optim.lr=0.02"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and err.startswith(f"error: job.out_dir {out} holds a different run (its config differs in ")
    assert "clients.optim.lr" in err and "server.optim.lr" in err
    for key in ("job.threads=2", "train.eval_batch_size=64", "zo.perturb_batch=2"):  # what can change a bit is identity
        assert main([*RUN, f"job.out_dir={out}", "job.resume=auto", key]) == 2
        assert key.split("=")[0] in capsys.readouterr().err
    # how a run is started is not: progress bar, loggers
    _, _, got, _ = run_in_process([*RUN, f"job.out_dir={out}", "job.resume=auto", "job.progress=true"])
    assert got["status"] == "completed"


def test_a_key_added_later_counts_only_off_the_value_every_earlier_run_had():
    """zo.perturb_batch came after runs were recorded: at 1 (what they all ran) it is left out of the identity, so
    their fingerprints stand; at 2 it differs from them like any key."""
    from hosfl_dist.config import load_config

    now = identity_mod.comparable_config(load_config(None, TINY_OVERRIDES))
    assert "perturb_batch" not in now["zo"]
    earlier = {"config": dict(now, zo=dict(now["zo"])), "inputs": {}}  # an identity recorded before the key
    assert identity_mod.identity_differences(earlier, {"config": now, "inputs": {}}) == []
    batched = identity_mod.comparable_config(load_config(None, [*TINY_OVERRIDES, "zo.perturb_batch=2"]))
    assert identity_mod.identity_differences(earlier, {"config": batched, "inputs": {}}) == [
        "config key zo.perturb_batch"
    ]
    assert identity_mod.fingerprint({"config": batched}) != identity_mod.fingerprint({"config": now})
    recorded_at_default = {"config": dict(now, zo={**now["zo"], "perturb_batch": 1}), "inputs": {}}
    assert identity_mod.identity_differences(recorded_at_default, {"config": now, "inputs": {}}) == []
    # server.reshard_after_forward only says whether gathered weights are kept: not identity at any value
    kept = identity_mod.comparable_config(load_config(None, [*TINY_OVERRIDES, "server.reshard_after_forward=false"]))
    assert "reshard_after_forward" not in kept["server"] and kept == now


def test_resume_refuses_changed_input_files_and_other_code(tmp_path, monkeypatch, capsys):
    (tmp_path / "text").mkdir()
    files = write_text_files(tmp_path / "text")
    out = tmp_path / "run"
    run = [*lm_overrides(out, files), "train.budget_samples=32", "checkpoint.interval_samples=8"]
    stop_at(monkeypatch, "hosfl", 1)
    with pytest.raises(Interrupted):
        run_in_process(run)
    monkeypatch.undo()
    train = files / "sst2.jsonl"
    original = train.read_text()
    train.write_text(original.replace("gorgeous", "dreadful"))  # same path, other labels' text
    changed = r"was written by another run \(input data.eval \(.*sst2.jsonl: its content differs\)"
    with pytest.raises(ConfigError, match=changed):
        run_in_process([*run, "job.resume=auto"])
    train.write_text(original)
    real = identity_mod.code_identity()
    other = {**real, "source_sha256": "0" * 64}
    monkeypatch.setattr(identity_mod, "code_identity", lambda: other)
    with pytest.raises(ConfigError, match=r"was written by other code .*job.allow_code_change=true resumes anyway"):
        run_in_process([*run, "job.resume=auto"])
    _, _, got, _ = run_in_process([*run, "job.resume=auto", "job.allow_code_change=true"])
    assert got["status"] == "completed" and got["resumed_with_other_code"]["checkpoint"] == real
    assert got["fingerprint"] and got["code"] == other and set(got["inputs"]) == {"data.train", "data.eval"}


# -- a live run owns its folder ---------------------------------------------------------------------------------------
HOLD = "import sys, time; from pathlib import Path; from hosfl_dist.runfolder.lock import RunLock; " \
       "RunLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(600)"  # fmt: skip


def test_a_run_another_process_holds_is_refused_naming_the_holder_and_a_dead_one_reads_died(tmp_path, capsys):
    out = tmp_path / "run"
    run_in_process([*RUN, f"job.out_dir={out}", "train.budget_samples=48"])
    summary = json.loads((out / "summary.json").read_text())
    summary["status"] = "running"  # as a run killed mid-way leaves it
    (out / "summary.json").write_text(json.dumps(summary))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert run_status(out) == "running" and f"pid {holder.pid} on " in lock_holder(out)
        for extra in (["job.overwrite=true"], ["job.resume=auto"], []):
            assert main([*RUN, f"job.out_dir={out}", *extra]) == 2
            err = capsys.readouterr().err.strip().splitlines()[-1]
            assert err.startswith(f"error: job.out_dir {out} is in use by a live run (pid {holder.pid} on "), err
        assert main(["--check", *RUN, f"job.out_dir={out}", "job.overwrite=true"]) == 2
    finally:
        holder.kill()
        holder.wait()
    assert run_status(out) == "died" and lock_holder(out) is None
    assert main(["--status", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"{out}: died: its processes ended without recording how")
    assert json.loads((out / "summary.json").read_text())["status"] == "running"  # --status alone writes nothing
    assert main(["--status", str(out), "--record-death"]) == 0
    recorded = json.loads((out / "summary.json").read_text())
    assert recorded["status"] == "died" and "--record-death" in recorded["error"]
    assert main(["--status", str(out)]) == 0 and "recorded in summary.json" in capsys.readouterr().out


HOLD_FOR = HOLD.replace("time.sleep(600)", "time.sleep(float(sys.argv[2]))")
HOLD_UNTIL_TOLD = HOLD.replace("time.sleep(600)", "sys.stdin.read()")  # lets go when its stdin closes


def _hold(out: Path, seconds: float | None, job: str, start: int) -> subprocess.Popen:
    """A process that holds ``out``'s run lock as start ``start`` of Slurm job ``job``: for ``seconds``, or (None)
    until its stdin is closed."""
    env = {**os.environ, "SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": str(start - 1)}
    script, more = (HOLD_UNTIL_TOLD, []) if seconds is None else (HOLD_FOR, [str(seconds)])
    holder = subprocess.Popen([sys.executable, "-c", script, str(out), *more], cwd=ROOT, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_requeued_slurm_job_waits_for_its_earlier_start_to_let_go_and_nothing_else(tmp_path, monkeypatch, capsys):
    """A job requeued after a node died can start while its first start's server, on a node that lived, is still
    stopping: the new start waits for that holder (bounded), and refuses any other one at once."""
    out = tmp_path / "run"
    run = [*RUN, f"job.out_dir={out}", "train.budget_samples=48", "server.rpc_timeout_s=5"]
    run_in_process(run)
    run.append("job.resume=auto")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # this process is start 2 of job 77

    holder = _hold(out, None, "77", 1)  # start 1 of this job, stopping

    class LetGoOnceWaitedFor:  # the wait's clock: start 1 lets go only once start 2 waits for it, whatever the load
        def __getattr__(self, name: str):
            return getattr(time, name)

        @staticmethod
        def sleep(seconds: float) -> None:
            holder.stdin.close()
            time.sleep(seconds)

    try:
        assert "Slurm job 77 start 1" in lock_holder(out)
        with monkeypatch.context() as m:
            m.setattr(lock_mod, "time", LetGoOnceWaitedFor())
            assert main(["--check", *run]) == 0
        assert holder.wait(60) == 0 and lock_holder(out) is None  # it waited for the holder to end
        assert f"still held by start 1 of this Slurm job (pid {holder.pid} on " in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()

    for job, start in (("78", 1), ("77", 2)):  # another job's run, or this very start's: refused at once
        holder = _hold(out, 600, job, start)
        try:
            assert main(["--check", *run]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1, err  # the refusal alone: no "waiting up to 65 s" first, it did not wait
            assert err[0].startswith(f"error: job.out_dir {out} is in use by a live run (pid {holder.pid} on "), err
            assert err[0].endswith(f"Slurm job {job} start {start}); wait for it to end or choose another folder"), err
        finally:
            holder.kill()
            holder.wait()

    monkeypatch.setattr(folder_mod, "EARLIER_START_GRACE_S", 0.0)  # an earlier start that never stops: bounded
    holder = _hold(out, 600, "77", 1)
    try:
        assert main(["--check", *run]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "start 1 of this job did not stop within 5 s: end that process" in err, err
    finally:
        holder.kill()
        holder.wait()
    assert main(["--check", *run]) == 0  # once it is gone


@pytest.mark.slow  # 14 s: a live run beside a second one
def test_overwriting_a_live_run_is_refused_and_the_live_run_completes_with_its_rows(tmp_path):
    out = tmp_path / "run"
    live = [*TINY_OVERRIDES, "train.budget_samples=240", "train.eval_every_samples=48", "comm.inject_delay=true",
            "comm.rtt_ms=100", f"job.out_dir={out}"]  # 10 rounds of several link delays each: long enough to meet
    # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "hosfl_dist.run", *live], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0][-2000:]
            time.sleep(0.2)
        # paused (it keeps its lock, as a live run does) while the other starts: on a loaded machine the other's
        # start-up (importing torch) can outlast the whole live run
        assert proc.poll() is None, proc.communicate()[0][-2000:]
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            again = [sys.executable, "-m", "hosfl_dist.run", *live, "job.seed=1", "job.overwrite=true"]
            other = subprocess.run(again, cwd=ROOT, capture_output=True, text=True, timeout=120)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        refused = f"error: job.out_dir {out} is in use by a live run (pid {proc.pid} on "
        assert other.returncode == 2 and other.stderr.strip().splitlines()[-1].startswith(refused), other.stderr
        assert proc.wait(timeout=300) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = json.loads((out / "summary.json").read_text())
    rows = rows_of(out)
    assert summary["status"] == "completed" and [r["round"] for r in rows] == list(range(0, 11, 2))
    assert "seed: 0" in (out / "config.yaml").read_text()


# -- records that cannot lie ------------------------------------------------------------------------------------------
def test_a_full_disk_is_recorded_as_failed_in_one_line(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real = RunRecord.log

    def full(self, row):
        if row["round"] > 0:
            raise OSError(28, "No space left on device")
        return real(self, row)

    monkeypatch.setattr(RunRecord, "log", full)
    assert main([*RUN, f"job.out_dir={out}"]) == 2  # the machine refused a write: one line, exit code 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"error: cannot write {out}: No space left on device"
    assert "Traceback" not in err and err.count("error:") == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == "OSError: [Errno 28] No space left on device"
    assert not (out / "summary.json.tmp").exists() and lock_holder(out) is None


def test_when_even_the_failure_cannot_be_written_stderr_says_so_and_readers_see_died(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real_log, real_dump = RunRecord.log, RunRecord._dump

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(RunRecord, "log", lambda self, row: full() if row["round"] > 0 else real_log(self, row))
    monkeypatch.setattr(RunRecord, "_dump", lambda self, s: full() if s["status"] != "running" else real_dump(self, s))
    assert main([*RUN, f"job.out_dir={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any(line.startswith(f"error: could not record the failure in {out}/summary.json: ") for line in err), err
    assert err[-1] == f"error: cannot write {out}: No space left on device"
    assert not (out / "summary.json.tmp").exists()
    assert json.loads((out / "summary.json").read_text())["status"] == "running" and run_status(out) == "died"


def test_a_metrics_line_cut_short_does_not_break_the_resume(tmp_path, monkeypatch, reference):
    ref_dir, ref = reference
    out = interrupted(tmp_path, monkeypatch)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"round": 12, "processed_samples": 28')  # the process died while writing this line
    _, _, got, _ = run_in_process([*RUN, f"job.out_dir={out}", "job.resume=auto"])
    assert got["client_digests"] == ref["client_digests"] and rows_of(out) == rows_of(ref_dir)


def _ranks_of(marker: str) -> list[int]:
    """The pids of a torchrun job's ranks (torchrun put TORCHELASTIC_RUN_ID in their environment), by a word of their
    command line."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (proc / "cmdline").read_bytes().decode(errors="replace") and b"TORCHELASTIC_RUN_ID=" in (
                proc / "environ"
            ).read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
@pytest.mark.multiprocess
def test_launch_torchrun_sh_records_a_job_whose_ranks_were_killed_as_died(tmp_path):
    """SIGKILL to every rank (an OOM killer, a lost node): nothing in the job can record it, the launcher does."""
    out = tmp_path / "run"
    args = [*TINY_OVERRIDES, "train.budget_samples=480", "checkpoint.interval_samples=48", "comm.inject_delay=true",
            "comm.rtt_ms=100", f"job.out_dir={out}"]  # fmt: skip
    env = {**os.environ, "NPROC": "3", "VENV": str(Path(sys.executable).parents[1])}
    proc = subprocess.Popen(["bash", "launch/torchrun.sh", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not (out / "checkpoints" / "round-00000002").is_dir():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        ranks = _ranks_of(f"job.out_dir={out}")
        assert len(ranks) == 3
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
        log, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "died", log[-3000:]
    assert f"{out}: died: its processes ended without recording how" in log


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a 2 MB tmpfs needs root (CI runs as root)")
@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(), reason="dataset-fashion-mnist missing")
def test_a_disk_that_fills_during_a_checkpoint_is_recorded_as_failed_in_one_line(tmp_path, capsys):
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True)
    try:
        out = mount / "run"
        args = ["--config", "configs/quickstart.yaml", "train.budget_samples=3072", "checkpoint.interval_samples=1024",
                "job.progress=false", f"job.out_dir={out}"]  # fmt: skip
        cwd = Path.cwd()
        os.chdir(ROOT)
        try:
            rc = main(args)
        finally:
            os.chdir(cwd)
        err = capsys.readouterr().err.strip().splitlines()[-1]
        summary = json.loads((out / "summary.json").read_text())
        assert rc == 2 and err.startswith(f"error: cannot write {out}: No space left on device (writing the checkpoint")
        assert summary["status"] == "failed"
        assert summary["error"].startswith("OSError: [Errno 28] No space left on device (writing the checkpoint")
        assert not list(out.rglob("*.tmp")) and not list(out.rglob("*.partial"))
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_an_input_this_process_cannot_see_is_recorded_not_fatal():
    """Rank 0 of a multi-node job reads no training data and may not see it: the identity says so."""
    from hosfl_dist.config import load_config

    cfg = load_config(None, ["data.name=fashion_mnist", "data.root=/nonexistent/fashion"])
    got = identity_mod.input_files(cfg)
    assert list(got) == ["data"] and got["data"]["unreadable"].startswith("data.root /nonexistent/fashion does not")
