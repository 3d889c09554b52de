"""Slurm tier: submit slurm/hosfl.sbatch to a real one-node Slurm cluster on this machine.

slurm/local_cluster.sh starts munged, slurmctld and slurmd; the job runs srun -> torchrun (2 processes) ->
c10d rendezvous -> a gloo all_reduce, so a pass proves the launch line works under Slurm, not just that the
script parses. A second test preempts a running job the way `--signal=B:TERM@...` does and checks that it
checkpoints, requeues itself and resumes to the results of an uninterrupted run.
Needs root and the Debian packages slurm-wlm and munge; skipped otherwise.
Run alone with `pytest -m slurm tests/test_slurm.py`; deselect with `-m "not slurm"`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tiny import read_run, run_one_thread


REPO = Path(__file__).resolve().parents[1]
SBATCH_SCRIPT = REPO / "slurm" / "hosfl.sbatch"
LOCAL_CLUSTER = REPO / "slurm" / "local_cluster.sh"
NPROC = 2
JOB_TIMEOUT_S = 120
PROBE_MODULE = "slurm_probe"
SEARCH_PATH = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"  # daemons live in sbin, often not on a user's PATH


@dataclass(frozen=True)
class Target:
    """What the job runs: torchrun -m `module` --config `config` *`overrides` ("{tmp}" is the test's tmp_path)."""

    module: str
    config: str
    overrides: tuple[str, ...]


PROBE = Target(PROBE_MODULE, "configs/quickstart.yaml", ("probe.answer=42", "job.name=slurm-test"))
QUICKSTART = Target(
    "hosfl_dist.run",
    "configs/quickstart.yaml",
    ("train.budget_samples=256", "train.eval_every_samples=256", "job.out_dir={tmp}/runs"),
)
# The product itself: rank 0 serves, rank 1 is the client worker. PROBE (a bare gloo all_reduce) isolates
# Slurm/rendezvous problems from the runtime's when debugging the cluster set-up.
TARGET = QUICKSTART

PROBE_SOURCE = """\
import os, sys
import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo")  # env:// from torchrun: MASTER_ADDR/PORT, RANK, WORLD_SIZE
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)  # sum_r (r + 1) = W (W + 1) / 2
print(f"PROBE rank={rank} world={world} sum={int(total.item())} argv={sys.argv[1:]}", flush=True)
dist.destroy_process_group()
"""


def _skip_reason() -> str:
    missing = [
        cmd
        for cmd in ("sbatch", "scontrol", "slurmctld", "slurmd", "munged", "runuser")
        if shutil.which(cmd, path=SEARCH_PATH) is None
    ]
    if missing:
        return f"Slurm tier needs {', '.join(missing)} (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "Slurm tier needs root to start munged/slurmctld/slurmd"
    return ""


SKIP_REASON = _skip_reason()
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,  # 20-35 s and 40-45 s: each brings up munged, slurmctld and slurmd, then runs torchrun jobs
    pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON or "n/a"),
]


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (slurmctld, slurmd), so a developer's own cluster is left alone."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair for slurmctld/slurmd")


def _run(cmd: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run from the repository root, capturing text; the caller judges the return code."""
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture
def slurm_env() -> Iterator[dict[str, str]]:
    """Environment for Slurm client commands against a fresh local cluster, torn down afterwards."""
    # a short path: slurmd puts per-step unix sockets (108-byte limit) under its spool directory
    state_dir = tempfile.mkdtemp(prefix="hosfl-slurm-")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env.update(PATH=SEARCH_PATH, HOSFL_SLURM_DIR=state_dir, HOSFL_SLURM_PORT=str(_free_port_pair()))
    try:
        up = _run(["bash", str(LOCAL_CLUSTER), "up"], env)
        assert up.returncode == 0, f"local_cluster.sh up failed:\n{up.stderr}"
        env["SLURM_CONF"] = f"{state_dir}/slurm.conf"
        yield env
    finally:
        down = _run(["bash", str(LOCAL_CLUSTER), "down"], env)
        assert down.returncode == 0, f"local_cluster.sh down failed:\n{down.stderr}"


def _job_field(env: dict[str, str], job_id: str, field: str) -> str:
    shown = _run(["scontrol", "show", "job", job_id], env).stdout
    match = re.search(rf"\b{field}=(\S+)", shown)
    assert match, f"no {field} in 'scontrol show job {job_id}':\n{shown}"
    return match.group(1)


def test_sbatch_runs_torchrun_ranks(slurm_env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / f"{PROBE_MODULE}.py").write_text(PROBE_SOURCE)
    env = dict(
        slurm_env,
        PYTHON=sys.executable,
        NPROC_PER_NODE=str(NPROC),
        CONFIG=TARGET.config,
        HOSFL_MODULE=TARGET.module,
        TORCHRUN_ARGS="--tee=3",  # prefix each worker's lines with [default<local rank>]:
        PYTHONPATH=str(tmp_path),
    )
    overrides = [o.format(tmp=tmp_path) for o in TARGET.overrides]
    out_file = tmp_path / "job.out"
    cmd = [
        "sbatch",
        "--wait",
        "--nodes=1",
        "--cpus-per-task=1",
        "--time=00:05:00",
        "--job-name=hosfl-test",
        f"--output={out_file}",
        str(SBATCH_SCRIPT),
        *overrides,
    ]
    try:
        sub = _run(cmd, env, timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # the fixture's `down` cancels the job
        sub = None
    log = out_file.read_text() if out_file.exists() else "<no output file>"
    assert sub is not None, f"job not done after {JOB_TIMEOUT_S}s; output so far:\n{log}"
    assert sub.returncode == 0, f"sbatch --wait exited {sub.returncode}\n{sub.stdout}{sub.stderr}\njob output:\n{log}"

    job_id = re.search(r"Submitted batch job (\d+)", sub.stdout).group(1)
    assert _job_field(slurm_env, job_id, "JobState") == "COMPLETED", log
    assert _job_field(slurm_env, job_id, "ExitCode") == "0:0", log

    # every local rank of the one torchrun spoke, and nothing beyond them
    speakers = set(re.findall(r"^\[default(\d+)\]:", log, flags=re.MULTILINE))
    assert speakers == {str(r) for r in range(NPROC)}, log
    if TARGET.module == PROBE_MODULE:
        probes = re.findall(r"PROBE rank=(\d+) world=(\d+) sum=(\d+) argv=(.*)", log)
        assert sorted(int(rank) for rank, *_ in probes) == list(range(NPROC)), log
        expected_argv = str(["--config", TARGET.config, "job.resume=auto", *overrides])
        for _, world, total, argv in probes:
            assert (int(world), int(total), argv) == (NPROC, NPROC * (NPROC + 1) // 2, expected_argv), log
    else:
        summary = json.loads((tmp_path / "runs" / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["engine"] == "torchrun", summary
        assert summary["processed_samples"] >= 256, summary


PREEMPT = (
    "train.budget_samples=1280",  # ten rounds of K=4 clients x 32 samples
    "train.eval_every_samples=128",  # a metrics row every round, so progress shows in metrics.jsonl
    "data.train_max_samples=2560",
    "data.eval_max_samples=256",
    "checkpoint.interval_samples=256",
    "job.progress=false",
)
"""The quickstart, small enough that a round takes about a second: the job is still training when it is signalled."""
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _wait_for(what: str, ready: Callable[[], bool], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {timeout} s; job output:\n{_read(log)[-6000:]}")
        time.sleep(0.2)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else f"<no {path.name}>"


def test_a_signalled_job_checkpoints_requeues_and_resumes_identically(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    out_dir, log = tmp_path / "runs", tmp_path / "job.out"
    overrides = [*PREEMPT, f"job.out_dir={out_dir}"]
    env = dict(
        slurm_env,
        PYTHON=sys.executable,
        NPROC_PER_NODE=str(NPROC),
        CONFIG=QUICKSTART.config,
        TORCHRUN_ARGS="--tee=3",
    )
    cmd = ["sbatch", "--parsable", "--nodes=1", "--cpus-per-task=1", "--time=00:05:00", "--job-name=hosfl-preempt"]
    sub = _run([*cmd, f"--output={log}", str(SBATCH_SCRIPT), *overrides], env)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]

    def state() -> str:
        return _job_field(slurm_env, job_id, "JobState")

    def metrics_rows() -> int:
        metrics = out_dir / "metrics.jsonl"
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    _wait_for("two metrics rows (rounds 0 and 1)", lambda: metrics_rows() >= 2 or state() in FINISHED, log, 120)
    assert state() == "RUNNING", f"the job ended before it was signalled:\n{_read(log)}"
    # what `--signal=B:TERM@<lead>` does at the lead time before the job's end: SIGTERM to the batch shell alone
    signal = _run(["scancel", "--signal=TERM", "--batch", job_id], slurm_env)
    assert signal.returncode == 0, signal.stderr

    # the uninterrupted reference, while the job stops and starts again: in-process, one intra-op thread like each
    # torchrun process
    ref_rows, ref = run_one_thread([*PREEMPT, f"job.out_dir={tmp_path / 'ref'}"], str(REPO / QUICKSTART.config))

    _wait_for("job finished", lambda: state() in FINISHED, log, JOB_TIMEOUT_S)
    text = _read(log)
    assert state() == "COMPLETED", text
    assert _job_field(slurm_env, job_id, "ExitCode") == "0:0", text
    assert _job_field(slurm_env, job_id, "Restarts") == "1", text
    assert re.search(r"hosfl\.sbatch: \[[\d:]+\] SIGTERM from Slurm", text), text
    stopped = re.search(r"\[server\] interrupted: SIGTERM after round (\d+); checkpoint (\S+)", text)
    assert stopped, text
    t, checkpoint = int(stopped.group(1)), stopped.group(2)
    assert 1 <= t < 10 and checkpoint == str(out_dir / "checkpoints" / f"round-{t:08d}"), text
    assert "(run interrupted); requeueing job" in text and "start 2 (SLURM_RESTART_COUNT=1)" in text, text
    assert f"[server] resuming from {checkpoint} (round {t}, {128 * t} samples)" in text, text

    rows, summary = read_run(out_dir)
    assert summary["status"] == "completed" and summary["resumed_from"] == checkpoint, summary
    # the same client weights (in-process names its one worker worker_0, torchrun by rank) and server weights
    assert sorted(summary["client_digests"].values()) == sorted(ref["client_digests"].values())
    assert summary["server_digest"] == ref["server_digest"]
    assert summary["comm"] == ref["comm"] and summary["processed_samples"] == ref["processed_samples"] == 1280
    assert rows == ref_rows  # every row once: those after the checkpoint were dropped and written again
