"""The torchrun runtime: role map and round gate (pure), then real torchrun launches on CPU (gloo + TensorPipe).

Each launch runs ``torch.distributed.run`` with c10d rendezvous on ``localhost:0`` (a free port, the rendezvous the
Slurm script uses), in its own session so that a timeout kills the whole process tree. A launch costs seconds of
imports per process, so each one checks several properties against one in-process reference run.

Exactness: a torchrun process runs with OMP_NUM_THREADS=1, and float32 conv/matmul kernels block their sums by
thread count, so the reference runs the in-process engine with one intra-op thread too; then the arithmetic is the
same and results must be bit-identical (metrics, θc and θs digests), not merely close.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from hosfl_dist.algorithms.hosfl import HOSFLServer
from hosfl_dist.comm import CONTROL
from hosfl_dist.config import load_config
from hosfl_dist.distributed.env import launch_env, role_map
from hosfl_dist.distributed.front import ServerFront
from hosfl_dist.engine import InProcessEngine
from hosfl_dist.errors import ConfigError
from hosfl_dist.models import build_split_model
from tiny import TINY_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 240
TINY = [*TINY_OVERRIDES, "server.rpc_timeout_s=60"]


# ------------------------------------------------------------------------------------------------------------------
# Pure tier: roles, environment, the server front's round gate


def test_role_map_spreads_clients_round_robin_and_refuses_worlds_that_do_not_fit():
    cfg = load_config(None, TINY)
    roles = role_map(cfg, 3)
    assert roles.server_ranks == (0,) and roles.worker_ranks == (1, 2) and roles.leader == 1
    assert roles.hosted == {1: (0, 2, 4), 2: (1, 3, 5)}
    fsdp = role_map(load_config(None, [*TINY, "server.ranks=2"]), 5)
    assert fsdp.server_ranks == (0, 1) and [fsdp.role(r) for r in range(3)] == ["server", "server-shard", "worker"]
    assert sorted(sum(fsdp.hosted.values(), ())) == list(range(6))
    with pytest.raises(ConfigError, match=r"world size 2 does not fit.*server.ranks=2.*need 3 processes"):
        role_map(load_config(None, [*TINY, "server.ranks=2"]), 2)
    with pytest.raises(ConfigError, match=r"world size 9 does not fit.*8 client workers for clients.total=6.*most 7"):
        role_map(cfg, 9)


def test_launch_env_reads_torchrun_variables_and_rejects_partial_ones():
    assert launch_env({}) is None
    env = launch_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (env.rank, env.world_size, env.local_rank) == (2, 4, 0)
    with pytest.raises(ConfigError, match="MASTER_ADDR, MASTER_PORT not set"):
        launch_env({"RANK": "0", "WORLD_SIZE": "2"})


class _Rows:
    def __init__(self):
        self.rows = []

    def log(self, row):
        self.rows.append(row)


def test_front_holds_a_round_t_sync_until_round_t_minus_1_is_closed():
    """A worker may ask for round t's history before the leader reported v̄^{t-1}: the front must not answer early."""
    cfg = load_config(None, TINY)
    split = build_split_model(cfg, {"num_classes": 4, "input_shape": (1, 8, 8)})
    front = ServerFront(HOSFLServer(cfg, split), _Rows(), None)
    early = front.serve("sync", {"t": 1, "client": 4, "since": 0})
    assert not early.done()  # round 0 is not closed yet
    front.serve("finish_round", {"t": 0, "scalars": torch.ones(3), "sampled": torch.tensor([0, 1, 2])}).wait()
    got = early.wait()
    assert got["hist_seeds"].shape == (1, 3) and torch.equal(got["hist_scalars"], torch.ones(1, 3))
    assert front.serve("plan", {"t": 5}).done()  # the plan reads no history
    with pytest.raises(AttributeError, match="not a server method declared with @wire"):
        front.serve("_forward_backward", {"t": 0, "batch": None})  # RPC reaches declared calls only


def test_dry_run_prints_the_role_map_without_starting_anything():
    res = subprocess.run(
        [sys.executable, "-m", "hosfl_dist.run", "--dry-run", "--nproc", "4", *TINY, "server.ranks=2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "world size 4: 2 server rank(s), 2 client worker(s)" in res.stdout
    assert "rank 2: worker       hosts 3 logical clients [0, 2, 4] (leader)" in res.stdout


# ------------------------------------------------------------------------------------------------------------------
# Multi-process tier


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


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The in-process engine on the tiny config, with one intra-op thread like every torchrun process."""
    out = tmp_path_factory.mktemp("inproc")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        InProcessEngine(load_config(None, [*TINY, f"job.out_dir={out}"])).run()
    finally:
        torch.set_num_threads(threads)
    return read_run(out)


def assert_same_run(dist_dir: Path, reference, n_workers: int) -> dict:
    """Bit-identical metrics and digests; identical traffic except the per-worker copies of the round plan."""
    rows, summary = read_run(dist_dir)
    ref_rows, ref_summary = copy.deepcopy(reference)  # shared by the tests of this module
    assert summary["status"] == "completed" and summary["engine"] == "torchrun"
    digests = summary["client_digests"]
    assert len(digests) == n_workers and set(digests.values()) == set(ref_summary["client_digests"].values())
    assert summary["server_digest"] == ref_summary["server_digest"]
    assert len(rows) == len(ref_rows)
    cfg = load_config(None, TINY)
    plan_bytes = cfg.clients.per_round * 8  # the sampled ids (int64), fetched by every worker every round
    for row, ref in zip(rows, ref_rows):
        comm, ref_comm = row.pop("comm"), dict(ref.pop("comm"))
        assert row == ref  # round, processed samples, eval accuracy/loss and train loss: exactly equal
        ref_comm[CONTROL] += (n_workers - 1) * row["round"] * plan_bytes
        assert comm == ref_comm
    paper = {k: v for k, v in summary["comm"]["bytes"].items() if k != CONTROL}
    assert paper == {k: v for k, v in ref_summary["comm"]["bytes"].items() if k != CONTROL}
    assert summary["comm"]["training_total_bytes"] == ref_summary["comm"]["training_total_bytes"]
    return summary


ORDER_SCRIPT = textwrap.dedent(
    """
    # Runs hosfl_dist.run with the leader's submits delayed (its clients arrive last) and the server logging arrivals.
    import json, os, sys, time
    from hosfl_dist.distributed import front, rpc_transport
    from hosfl_dist.run import main

    rank, log = int(os.environ["RANK"]), os.environ["ARRIVALS"]
    if rank == 1:
        call_async = rpc_transport.RPCTransport.call_async
        def late(self, method, **kwargs):
            if method == "submit":
                time.sleep(0.15)
            return call_async(self, method, **kwargs)
        rpc_transport.RPCTransport.call_async = late
    if rank == 0:
        serve = front.ServerFront.serve
        def logged(self, method, kwargs):
            if method == "submit":
                with open(log, "a") as f:
                    f.write(json.dumps([kwargs["t"], kwargs["client"]]) + "\\n")
            return serve(self, method, kwargs)
        front.ServerFront.serve = logged
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.multiprocess
def test_torchrun_equals_in_process_with_overlap_and_any_arrival_order(tmp_path, reference, monkeypatch):
    """1 server + 2 workers against the in-process engine (overlap off): latency hiding on (zo.overlap), and the
    leader's activations delayed so that rounds reach the server out of client-id order. Neither may change a bit."""
    script, arrivals = tmp_path / "order.py", tmp_path / "arrivals.jsonl"
    script.write_text(ORDER_SCRIPT)
    monkeypatch.setenv("ARRIVALS", str(arrivals))
    rc, out, _ = torchrun(3, [str(script), *TINY, "zo.overlap=true", f"job.out_dir={tmp_path / 'run'}"])
    assert rc == 0, out[-4000:]
    summary = assert_same_run(tmp_path / "run", reference, n_workers=2)
    assert summary["roles"]["hosted"] == {"worker_1": [0, 2, 4], "worker_2": [1, 3, 5]}
    by_round: dict[int, list[int]] = {}
    for line in arrivals.read_text().splitlines():
        t, m = json.loads(line)
        by_round.setdefault(t, []).append(m)
    assert len(by_round) == summary["rounds"]
    assert any(order != sorted(order) for order in by_round.values())  # the order really was shuffled
    stats = summary["transport"]["workers"]["worker_1"]
    assert stats["rounds"] == summary["rounds"] and stats["allreduce_calls"] == summary["rounds"]


@pytest.mark.multiprocess
def test_fsdp_server_group_of_two_equals_a_one_rank_server(tmp_path, reference):
    """θs sharded over ranks 0-1 with FSDP2 (gloo), one client worker hosting all 6 clients. Every server rank
    computes the same round and the average of 2 identical gradient shards is exact, so the results equal the
    1-rank server's bit for bit (for S not a power of two they would differ by float rounding of g/S·S)."""
    rc, out, _ = torchrun(3, ["-m", "hosfl_dist.run", *TINY, "server.ranks=2", f"job.out_dir={tmp_path / 'run'}"])
    assert rc == 0, out[-4000:]
    summary = assert_same_run(tmp_path / "run", reference, n_workers=1)
    assert summary["roles"]["server_ranks"] == [0, 1] and summary["roles"]["hosted"] == {"worker_2": list(range(6))}


FAIL_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from hosfl_dist.algorithms import hosfl
    from hosfl_dist.run import main

    if os.environ["RANK"] == "2":
        run_round = hosfl.HOSFLWorker.run_round
        def broken(self, t):
            if t == 2:
                raise RuntimeError("injected client failure")
            return run_round(self, t)
        hosfl.HOSFLWorker.run_round = broken
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.multiprocess
def test_a_failing_client_worker_stops_the_job_and_its_error_is_shown_once(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAIL_SCRIPT)
    rc, out, seconds = torchrun(3, [str(script), *TINY, f"job.out_dir={tmp_path / 'run'}"], timeout=120)
    assert rc != 0
    assert out.count("RuntimeError: injected client failure") == 1, out[-4000:]
    assert out.count("[worker 2] error:") == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == "worker 2: RuntimeError: injected client failure"
    assert seconds < 120


@pytest.mark.multiprocess
def test_a_world_that_does_not_fit_the_roles_is_refused_before_starting(tmp_path):
    rc, out, _ = torchrun(2, ["-m", "hosfl_dist.run", *TINY, "server.ranks=2"], timeout=120)
    assert rc != 0
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: world size 2 does not fit the roles: server.ranks=2 server rank(s) plus at least one client worker "
        "need 3 processes"
    ]
