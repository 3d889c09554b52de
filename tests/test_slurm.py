"""Slurm tier: submit slurm/hosfl.sbatch to a real Slurm cluster of one or two nodes on this machine.

slurm/local_cluster.sh starts munged, slurmctld and a slurmd per node; the job runs srun -> torchrun (2 processes
per node) -> c10d rendezvous -> the training run, so a pass proves the launch line works under Slurm, not just that
the script parses. On one node, a job preempted the way `--signal=B:TERM@...` does checkpoints, requeues itself and
resumes to the results of an uninterrupted run. On two nodes (Slurm's multiple-slurmd mode: hosfl-n1, hosfl-n2),
a job's ranks span both and equal the in-process run; a job whose second node dies (its slurmd, slurmstepd and
ranks SIGKILLed) is requeued by Slurm, resumes from its last checkpoint once the node is back and again ends equal
to the uninterrupted run; a job array lands on both nodes.
Needs root and the Debian packages slurm-wlm and munge; skipped otherwise.
Run alone with `pytest -m slurm tests/test_slurm.py`; deselect with `-m "not slurm"`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tiny import TINY_OVERRIDES, assert_same_as, read_run, run_one_thread


REPO = Path(__file__).resolve().parents[1]
SBATCH_SCRIPT = REPO / "slurm" / "hosfl.sbatch"
LOCAL_CLUSTER = REPO / "slurm" / "local_cluster.sh"
NPROC = 2
JOB_TIMEOUT_S = 120
PROBE_MODULE = "hosfl_test_slurm_probe"  # a name no user module in the checkout has (tiny.user_module)
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


def _free_ports(count: int) -> int:
    """A port p with p ... p + count - 1 free (slurmctld, then a slurmd per node), so a developer's own cluster is
    left alone."""
    for _ in range(50):
        with contextlib.ExitStack() as held:
            first = held.enter_context(socket.socket())
            first.bind(("", 0))
            port = first.getsockname()[1]
            try:
                for k in range(1, count):
                    held.enter_context(socket.socket()).bind(("", port + k))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no {count} consecutive free ports for slurmctld and slurmd")


def _run(cmd: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run from the repository root, capturing text; the caller judges the return code."""
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)


@contextlib.contextmanager
def _local_cluster(nodes: int) -> Iterator[dict[str, str]]:
    """Environment for Slurm client commands against a fresh local cluster of ``nodes`` nodes; whatever happens, it
    is torn down afterwards (`down`: leftover jobs cancelled, daemons stopped, steps of dead nodes killed)."""
    # a short path: slurmd puts per-step unix sockets (108-byte limit) under its spool directory
    state_dir = tempfile.mkdtemp(prefix="hosfl-slurm-")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env.update(PATH=SEARCH_PATH, HOSFL_SLURM_DIR=state_dir, HOSFL_SLURM_PORT=str(_free_ports(nodes + 1)))
    try:
        up = _run(["bash", str(LOCAL_CLUSTER), "up", "--nodes", str(nodes)], env)
        assert up.returncode == 0, f"local_cluster.sh up failed:\n{up.stderr}"
        env["SLURM_CONF"] = f"{state_dir}/slurm.conf"
        yield env
    finally:
        down = _run(["bash", str(LOCAL_CLUSTER), "down"], env)
        assert down.returncode == 0, f"local_cluster.sh down failed:\n{down.stderr}"


@pytest.fixture
def slurm_env() -> Iterator[dict[str, str]]:
    """A one-node cluster, named after this host."""
    with _local_cluster(1) as env:
        yield env


@pytest.fixture
def two_nodes() -> Iterator[dict[str, str]]:
    """A two-node cluster: hosfl-n1 and hosfl-n2, each with all of this machine's CPUs."""
    with _local_cluster(2) as env:
        yield env


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
    stopped = re.search(r"\[server\] interrupted: SIGTERM after round (\d+); checkpoint ([^\s;]+)", text)
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


# -- two nodes: hosfl-n1 and hosfl-n2, two slurmd daemons on this machine (Slurm's multiple-slurmd mode) -------------
NODES = ("hosfl-n1", "hosfl-n2")
TINY = [*TINY_OVERRIDES, "server.rpc_timeout_s=60"]
"""K=3 of M=6 clients: 2 nodes x 2 processes are the server (rank 0) and three client workers."""
NODE_TORCHRUN = """\
#!/usr/bin/env bash
# torchrun with each line of its output prefixed by the Slurm node it runs on; at LOGLEVEL=INFO its agent logs the
# rendezvous result (global_ranks=[...]), so the job's log says which ranks ran on which node
export LOGLEVEL=INFO
# torchrun gives node rank 0 (the server) to the agent with the lowest (address, pid): each agent gives its node's
# name as its address (the names resolve to this host), so rank 0 is on hosfl-n1 whatever the pids (they wrap)
"$PYTHON" -m torch.distributed.run --local-addr "$SLURMD_NODENAME" "$@" 2>&1 | sed -u "s/^/[$SLURMD_NODENAME] /"
exit "${PIPESTATUS[0]}"
"""
RANKS = re.compile(r"^\[(\S+)\] .*\bglobal_ranks=\[([\d, ]*)\]", flags=re.MULTILINE)


def _two_node_job(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The environment of an sbatch of hosfl.sbatch with NPROC_PER_NODE=2 whose torchrun names its node in the log.

    The config is the tiny synthetic one of tests/tiny.py, given as overrides of an empty YAML file."""
    torchrun = tmp_path / "torchrun-on-node"
    torchrun.write_text(NODE_TORCHRUN)
    torchrun.chmod(0o755)
    (tmp_path / "empty.yaml").write_text("{}\n")
    return dict(
        env,
        PYTHON=sys.executable,
        TORCHRUN=str(torchrun),
        TORCHRUN_ARGS="--tee=3",
        NPROC_PER_NODE="2",
        CONFIG=str(tmp_path / "empty.yaml"),
    )


def _ranks_by_node(log: str) -> list[dict[str, list[int]]]:
    """Per start of the job (each torchrun rendezvous), the global ranks each node ran, from torchrun's agent log."""
    starts: list[dict[str, list[int]]] = []
    for node, ranks in RANKS.findall(log):
        if not starts or node in starts[-1]:
            starts.append({})
        starts[-1][node] = [int(r) for r in ranks.split(",")]
    return starts


def _assert_spans_both_nodes(placement: dict[str, list[int]], log: str) -> None:
    assert sorted(placement) == list(NODES), log[-6000:]
    assert sorted(r for ranks in placement.values() for r in ranks) == [0, 1, 2, 3], log[-6000:]
    assert all(len(ranks) == 2 for ranks in placement.values()), log[-6000:]


def test_a_two_node_job_spans_both_nodes_and_equals_the_in_process_run(
    two_nodes: dict[str, str], tmp_path: Path
) -> None:
    out_dir, log = tmp_path / "runs", tmp_path / "job.out"
    env = _two_node_job(two_nodes, tmp_path)
    cmd = ["sbatch", "--wait", "--nodes=2", "--cpus-per-task=1", "--time=00:05:00", "--job-name=hosfl-2n"]
    try:
        sub = _run([*cmd, f"--output={log}", str(SBATCH_SCRIPT), *TINY, f"job.out_dir={out_dir}"], env, JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # the fixture's `down` cancels the job
        sub = None
    text = _read(log)
    assert sub is not None, f"job not done after {JOB_TIMEOUT_S}s; output so far:\n{text[-6000:]}"
    assert sub.returncode == 0, f"sbatch --wait exited {sub.returncode}\n{sub.stdout}{sub.stderr}\n{text[-6000:]}"
    job_id = re.search(r"Submitted batch job (\d+)", sub.stdout).group(1)
    assert _job_field(two_nodes, job_id, "JobState") == "COMPLETED", text[-6000:]
    assert _job_field(two_nodes, job_id, "NodeList") == "hosfl-n[1-2]", text[-6000:]
    assert "on hosfl-n[1-2] (2 nodes x 2 procs), rendezvous hosfl-n1:" in text, text[-6000:]

    (placement,) = _ranks_by_node(text)  # one rendezvous: 4 ranks, 2 on each node
    _assert_spans_both_nodes(placement, text)
    server_node = next(node for node, ranks in placement.items() if 0 in ranks)
    assert f"[{server_node}] [default0]:[server] world size 4: 1 server rank(s), 3 client worker(s)" in text

    assert_same_as(out_dir, run_one_thread([*TINY, f"job.out_dir={tmp_path / 'ref'}"]))


NODE_DEATH = [
    *TINY,
    "train.budget_samples=4800",  # 200 rounds of K=3 clients x 8 samples: a few seconds, on after the node's death
    "train.eval_every_samples=240",
    "checkpoint.interval_samples=240",  # a checkpoint every 10 rounds
]
CHECKPOINT = re.compile(r"round-(\d{8})")


def _last_checkpoint(out_dir: Path) -> int:
    """The round of the newest complete checkpoint, -1 without one."""
    done = [int(m.group(1)) for p in (out_dir / "checkpoints").glob("round-*") if (m := CHECKPOINT.fullmatch(p.name))]
    return max(done, default=-1)


@pytest.mark.skipif(shutil.which("ss") is None, reason="kill-node finds a node's slurmstepd by its socket: needs ss")
def test_a_job_whose_node_dies_is_requeued_and_resumes_identically(two_nodes: dict[str, str], tmp_path: Path) -> None:
    out_dir, log = tmp_path / "runs", tmp_path / "job.out"
    state_dir = Path(two_nodes["HOSFL_SLURM_DIR"])
    # the server (rank 0) on hosfl-n1, the node that lives (_two_node_job): it may still be stopping, waiting for its
    # dead workers, when the requeued job starts again (CI met that), and that start then waits for it to let go of
    # the run folder
    env = _two_node_job(two_nodes, tmp_path)
    cmd = ["sbatch", "--parsable", "--nodes=2", "--cpus-per-task=1", "--time=00:05:00", "--job-name=hosfl-node-death"]
    sub = _run([*cmd, f"--output={log}", str(SBATCH_SCRIPT), *NODE_DEATH, f"job.out_dir={out_dir}"], env)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]

    def state() -> str:
        return _job_field(two_nodes, job_id, "JobState")

    _wait_for("a first checkpoint", lambda: _last_checkpoint(out_dir) >= 0 or state() in FINISHED, log, 90)
    assert state() == "RUNNING", f"the job ended before its node died:\n{_read(log)[-6000:]}"

    # slurmd alone: the node's steps live on under their slurmstepd, and the run goes on
    os.kill(int((state_dir / "slurmd-hosfl-n2.pid").read_text()), signal.SIGKILL)
    seen = _last_checkpoint(out_dir)
    _wait_for("a checkpoint after slurmd died", lambda: _last_checkpoint(out_dir) > seen, log, 30)
    # the node dies: its slurmstepd and the ranks under it too
    kill = _run(["bash", str(LOCAL_CLUSTER), "kill-node", "hosfl-n2"], two_nodes)
    assert kill.returncode == 0, kill.stderr
    status = json.loads((out_dir / "summary.json").read_text())["status"]
    assert status != "completed", f"the run had ended when its node died:\n{_read(log)[-6000:]}"

    # the uninterrupted reference, while slurmctld waits out SlurmdTimeout
    ref = run_one_thread([*NODE_DEATH, f"job.out_dir={tmp_path / 'ref'}"])

    # slurmctld sets the silent node DOWN and requeues the job, which then waits for both nodes
    def requeued() -> bool:
        return _job_field(two_nodes, job_id, "Restarts") == "1" and state() == "PENDING"

    _wait_for("the requeue", requeued, log, 60)
    start = _run(["bash", str(LOCAL_CLUSTER), "start-node", "hosfl-n2"], two_nodes)
    assert start.returncode == 0, start.stderr
    _wait_for("job finished", lambda: state() in FINISHED, log, JOB_TIMEOUT_S)

    text = _read(log)
    assert state() == "COMPLETED" and _job_field(two_nodes, job_id, "ExitCode") == "0:0", text[-6000:]
    assert _job_field(two_nodes, job_id, "Restarts") == "1", text[-6000:]
    ctld = (state_dir / "slurmctld.log").read_text()
    assert f"requeue job JobId={job_id} due to failure of node hosfl-n2" in ctld, ctld[-3000:]
    assert f"JOB {job_id} ON hosfl-n1 CANCELLED AT" in text and "DUE TO NODE FAILURE" in text, text[-6000:]
    assert "start 2 (SLURM_RESTART_COUNT=1)" in text, text[-6000:]
    first, second = _ranks_by_node(text)
    _assert_spans_both_nodes(first, text)
    _assert_spans_both_nodes(second, text)
    assert 0 in first["hosfl-n1"] and 0 in second["hosfl-n1"], f"the server ran on the node that died: {first}"

    resumed = re.search(r"\[server\] resuming from (\S+) \(round (\d+), ", text)
    assert resumed, text[-6000:]
    assert seen < int(resumed.group(2)) < 200, (seen, resumed.group(0))  # a checkpoint written after slurmd died
    summary = assert_same_as(out_dir, ref)
    assert summary["resumed_from"] == resumed.group(1), summary


ARRAY_TASK = """\
#!/usr/bin/env bash
echo "task $SLURM_ARRAY_TASK_ID on $SLURMD_NODENAME"
sleep 2
"""


def test_a_job_array_lands_on_both_nodes(two_nodes: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "task.sh"
    script.write_text(ARRAY_TASK)
    # each task takes a whole node's CPUs, so two run at a time, one on each node
    cmd = ["sbatch", "--wait", "--array=0-3", "--cpus-per-task=2", "--time=00:01:00", "--job-name=hosfl-array"]
    sub = _run([*cmd, f"--output={tmp_path}/task-%a.out", str(script)], two_nodes, JOB_TIMEOUT_S)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    lines = [_read(tmp_path / f"task-{i}.out").strip() for i in range(4)]
    placed = [re.fullmatch(r"task (\d) on (\S+)", line) for line in lines]
    assert all(placed), lines
    assert [int(m.group(1)) for m in placed] == [0, 1, 2, 3], lines
    assert {m.group(2) for m in placed} == set(NODES), lines


ELASTIC_SCRIPT = REPO / "slurm" / "elastic.sbatch"


def test_an_elastic_job_loses_a_worker_step_and_the_retry_joins_again(
    two_nodes: dict[str, str], tmp_path: Path
) -> None:
    """slurm/elastic.sbatch: the server and each worker are job steps; a worker step killed (as a dead node's would be)
    ends only itself, the run goes on, and the step started again joins the live run as a new worker."""
    out, log = tmp_path / "run", tmp_path / "job.out"
    env = dict(two_nodes, PYTHON=sys.executable, OUT=str(out), PORT=str(_free_ports(1)), WORKERS_ON_HEAD="1",
               RETRIES="2", PYTHONPATH=str(REPO))  # fmt: skip
    overrides = [*TINY_OVERRIDES, "train.budget_samples=19200", "train.eval_every_samples=4800",
                 "server.worker_timeout_s=5", "server.min_workers=2", "server.min_clients=1"]  # fmt: skip
    cmd = ["sbatch", "--nodes=2", "--cpus-per-task=1", "--time=00:10:00", "--job-name=hosfl-elastic-test",
           f"--output={log}", str(ELASTIC_SCRIPT), *overrides]  # fmt: skip
    sub = _run(cmd, env)
    assert sub.returncode == 0, sub.stderr
    job = re.search(r"Submitted batch job (\d+)", sub.stdout).group(1)

    def live_workers() -> int:
        try:
            return len(json.loads((out / "workers.json").read_text())["workers"])
        except (OSError, ValueError, KeyError):
            return 0

    _wait_for("two workers joined", lambda: live_workers() == 2, log, 180)
    killed = _run(["scancel", "--signal=KILL", f"{job}.1"], env)  # step 0 is the server; 1 and 2 the workers
    assert killed.returncode == 0, killed.stderr
    _wait_for("the job to end", lambda: _job_field(two_nodes, job, "JobState") in FINISHED, log, 300)
    assert _job_field(two_nodes, job, "JobState") == "COMPLETED", _read(log)[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["engine"] == "elastic", summary
    p = summary["participation"]
    assert p["workers_lost"] >= 1 and p["workers_joined"] >= 3, (p, _read(log)[-4000:])
    assert "joining again" in _read(log)  # the killed step, started again
