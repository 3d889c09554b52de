"""Signals from outside to a running torchrun job, as an operator or the kernel deliver them, and what became of the
run: Ctrl-C to the whole process group checkpoints and a resume finishes it; a client worker stopped by SIGSTOP
runs the server's wait out, the job fails and ``torchrun --max-restarts`` restarts it from the last checkpoint.
Either way the run ends with the rows, digests and traffic of an uninterrupted run.

The faults a process injects into itself at a chosen round (SIGKILL of a worker, the leader or the server, SIGTERM
to the launcher) are tests/test_restart.py's; here the signal comes at whatever moment the job has reached after its
first checkpoint. Measured once on the 2-core machine (results/faults/README.md): the SIGINT case's processes were
gone 2.0 s after the signal, the SIGSTOP case's 50.9 s after it (a 20 s RPC timeout + torchrun's 30 s stop wait).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tiny import ROOT, TINY_OVERRIDES, assert_same_as, run_one_thread

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

RUN = [*TINY_OVERRIDES, "train.budget_samples=4800", "train.eval_every_samples=1200",
       "checkpoint.interval_samples=48"]  # fmt: skip
"""200 rounds of K=3 clients of 8 samples (long enough to be running when the signal comes), a checkpoint every
second round."""


def launch(args: list[str], log: Path, restarts: int = 0) -> subprocess.Popen:
    """torchrun, 1 server + 2 client workers, in a session of its own (its process group receives Ctrl-C)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=3",
           "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", f"--rdzv-id={uuid.uuid4().hex[:8]}",
           f"--max-restarts={restarts}", "-m", "hosfl_dist.run", *args]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True)


def ranks(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's processes (their RANK variable, read from /proc)."""
    out = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            lines = status.read_text().splitlines()
            if int(next(x for x in lines if x.startswith("PPid:")).split()[1]) != launcher:
                continue
            env = (status.parent / "environ").read_bytes().split(b"\0")
            out[int(next(e[5:] for e in env if e.startswith(b"RANK=")))] = int(status.parent.name)
        except (OSError, StopIteration, ValueError):
            continue
    return out


def status_of(out: Path) -> str | None:
    try:
        return json.loads((out / "summary.json").read_text()).get("status")
    except (OSError, ValueError):
        return None


def first_checkpoint(out: Path, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if any(p.is_dir() and not p.name.endswith(".partial") for p in (out / "checkpoints").glob("round-*")):
            return
        assert proc.poll() is None, (
            f"the job ended (rc {proc.returncode}) before its first checkpoint:\n" + (log.read_text()[-3000:])
        )
        time.sleep(0.02)
    pytest.fail("no checkpoint within 240 s:\n" + log.read_text()[-3000:])


def finish(proc: subprocess.Popen, timeout: float, out: Path | None = None) -> set[str]:
    """Wait for the launcher (its process group killed if it outlives ``timeout``); the statuses summary.json showed
    meanwhile."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            if out is not None and (s := status_of(out)):
                seen.add(s)
            if time.monotonic() > deadline:
                pytest.fail(f"the job did not end within {timeout} s")
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return seen


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same run uninterrupted, in one process with one thread: torchrun's results equal it bit for bit."""
    out = tmp_path_factory.mktemp("reference")
    return run_one_thread([*RUN, f"job.out_dir={out}"])


def test_ctrl_c_to_the_process_group_checkpoints_and_a_resume_finishes_identically(tmp_path, reference):
    out, log = tmp_path / "run", tmp_path / "log"
    args = [*RUN, f"job.out_dir={out}"]
    proc = launch(args, log)
    first_checkpoint(out, proc, log)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the launching terminal does
    finish(proc, 120)
    assert proc.returncode != 0, log.read_text()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted", (summary, log.read_text()[-3000:])
    t = summary["rounds"]
    assert 0 < t < 200 and summary["error"] == f"SIGINT after round {t}"
    assert summary["checkpoint"].endswith(f"round-{t:08d}") and Path(summary["checkpoint"]).is_dir()
    resumed = launch([*args, "job.resume=auto"], log)
    finish(resumed, 240)
    assert resumed.returncode == 0, log.read_text()[-3000:]
    summary = assert_same_as(out, reference)
    assert summary["resumed_from"].endswith(f"round-{t:08d}")


def test_a_stopped_worker_runs_the_wait_out_and_torchrun_restarts_the_job_identically(tmp_path, reference):
    """SIGSTOP to a client worker: the server's wait for it runs out after server.rpc_timeout_s, the job fails and
    records it, torchrun kills what is left (the stopped process after its 30 s stop wait) and starts the job again,
    which resumes from the last checkpoint."""
    out, log = tmp_path / "run", tmp_path / "log"
    # whichever wait meets the stopped worker first runs out: a call to the server (rpc), or the all_reduce of a round
    # in which the stopped worker hosts no sampled client (collective)
    proc = launch([*RUN, "server.rpc_timeout_s=10", "server.collective_timeout_s=10", f"job.out_dir={out}"], log,
                  restarts=1)  # fmt: skip
    try:
        first_checkpoint(out, proc, log)
        pids = ranks(proc.pid)
        assert sorted(pids) == [0, 1, 2], pids
        os.kill(pids[2], signal.SIGSTOP)
        seen = finish(proc, 300, out)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "failed" in seen, (seen, text[-3000:])  # the first attempt recorded its failure before the restart
    assert "resuming from" in text
    summary = assert_same_as(out, reference)
    assert Path(summary["resumed_from"]).name.startswith("round-")
