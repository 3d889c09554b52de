"""The torchrun runtime: role map and round gate (pure), then real torchrun launches on CPU (gloo + TensorPipe).

Each launch runs ``torch.distributed.run`` with c10d rendezvous on ``localhost:0`` (a free port, the rendezvous the
Slurm script uses), in its own session so that a timeout kills the whole process tree. A launch costs seconds of
imports per process, so each one checks several properties against one in-process reference run.

Exactness: a torchrun process runs with OMP_NUM_THREADS=1, and float32 conv/matmul kernels block their sums by
thread count, so the reference runs the in-process runtime with one intra-op thread too; then the arithmetic is the
same and results must be bit-identical (metrics, θc and θs digests), not merely close.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hosfl_dist.algorithms.hosfl import HOSFLServer
from hosfl_dist.config import load_config
from hosfl_dist.errors import ConfigError, ProtocolError
from hosfl_dist.models import build_split_model
from hosfl_dist.runtime.process.groups import check_server_gpus, shared_gpus
from hosfl_dist.runtime.process.host import bind_interface
from hosfl_dist.runtime.process.launch import RoleMap, launch_env, role_map
from hosfl_dist.runtime.server_group import local_endpoint
from tiny import TINY_OVERRIDES, assert_same_as, read_run, run_one_thread, server_of, torchrun

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 240
TINY = [*TINY_OVERRIDES, "server.rpc_timeout_s=60"]


# ------------------------------------------------------------------------------------------------------------------
# Pure tier: roles, environment, the endpoint's round gate


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


def test_ranks_that_drive_one_gpu_are_found_by_host_and_uuid_and_a_server_group_on_one_is_refused():
    """NCCL needs a GPU per rank of a group: client workers sharing one reduce through gloo, server ranks are refused.
    Two ranks share a GPU when host and uuid agree, whatever index CUDA_VISIBLE_DEVICES gave each; CPU ranks never."""
    placement = {0: "a|GPU-1|cuda:0", 1: "a|GPU-2|cuda:1", 2: "a|GPU-1|cuda:0", 3: "b|GPU-1|cuda:0",
                 4: "a|GPU-2|cuda:0", 5: "", 6: ""}  # fmt: skip
    assert shared_gpus(placement, [0, 1, 3]) == []  # another host's GPU-1 is another GPU
    assert shared_gpus(placement, [1, 4]) == [(1, 4, "cuda:0 on a")]  # same GPU, seen as cuda:1 and cuda:0
    assert shared_gpus(placement, [0, 2, 4, 1]) == [(0, 2, "cuda:0 on a"), (1, 4, "cuda:0 on a")]
    assert shared_gpus(placement, [5, 6]) == []

    def roles(servers: int) -> RoleMap:
        cfg = load_config(None, [f"server.ranks={servers}", "clients.total=4", "clients.per_round=2"])
        return role_map(cfg, servers + 2)

    check_server_gpus(placement, roles(1))  # one server rank: nothing to share
    check_server_gpus(placement, roles(2))  # server ranks 0 and 1 on two GPUs
    with pytest.raises(ConfigError, match=r"server.ranks: 3 server ranks on CUDA need a GPU each .*ranks 0 and 2 "
                       r"share cuda:0 on a: "):  # fmt: skip
        check_server_gpus(placement, roles(3))


def test_launch_env_reads_torchrun_variables_and_rejects_partial_ones():
    assert launch_env({}) is None
    env = launch_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (env.rank, env.world_size, env.local_rank) == (2, 4, 0)
    with pytest.raises(ConfigError, match="MASTER_ADDR, MASTER_PORT not set"):
        launch_env({"RANK": "0", "WORLD_SIZE": "2"})


def test_gloo_and_tensorpipe_bind_to_loopback_on_one_node_and_to_the_configured_interface_across_nodes():
    base = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    one_node, two_nodes = launch_env({**base, "LOCAL_WORLD_SIZE": "4"}), launch_env({**base, "LOCAL_WORLD_SIZE": "2"})
    environ: dict[str, str] = {}
    assert bind_interface(load_config(None, []), one_node, environ) == "lo"
    assert environ == {"GLOO_SOCKET_IFNAME": "lo", "TP_SOCKET_IFNAME": "lo"}
    environ = {"GLOO_SOCKET_IFNAME": "ib0"}  # across nodes, auto keeps what the environment says; TensorPipe follows
    assert bind_interface(load_config(None, []), two_nodes, environ) == "ib0"
    assert environ == {"GLOO_SOCKET_IFNAME": "ib0", "TP_SOCKET_IFNAME": "ib0"}
    environ = {"GLOO_SOCKET_IFNAME": "ib0", "TP_SOCKET_IFNAME": "eth1"}  # unless told otherwise
    assert bind_interface(load_config(None, []), two_nodes, environ) == "ib0" and environ["TP_SOCKET_IFNAME"] == "eth1"
    environ = {}
    assert bind_interface(load_config(None, []), two_nodes, environ) is None and environ == {}  # torch's choice
    environ = {}
    assert bind_interface(load_config(None, ["job.interface=lo"]), two_nodes, environ) == "lo"
    assert environ["TP_SOCKET_IFNAME"] == "lo"
    with pytest.raises(ConfigError, match=r"job.interface=nosuch0: this node has no such interface \(it has .*lo"):
        bind_interface(load_config(None, ["job.interface=nosuch0"]), two_nodes, {})


def test_endpoint_holds_a_round_t_sync_until_round_t_minus_1_is_closed():
    """A worker asks for round t's history as soon as round t−1's scalars are aggregated, possibly before the
    leader's finish_round arrived: the endpoint must not answer early (``after_previous_round``)."""
    cfg = load_config(None, TINY)
    split = build_split_model(cfg, {"num_classes": 4, "input_shape": (1, 8, 8)}, True)
    server = server_of(cfg, split, HOSFLServer)
    server.rounds_done = 1  # round 0's activations went through the server
    endpoint = local_endpoint(server)
    early = endpoint.serve("sync", {"t": 1, "client": 2, "since": 0})  # client 2 was not in S_0 = [1, 3, 4]
    assert not early.done()  # round 0 is not closed yet
    endpoint.serve("finish_round", {"t": 0, "scalars": torch.ones(3)}).wait()  # closes_round
    got = early.wait()
    assert got["hist_seeds"].shape == (1, 3) and torch.equal(got["hist_scalars"], torch.ones(1, 3))
    assert endpoint.serve("eval_batch", {"act": {"z": torch.zeros(2, 4, 4, 4)}, "labels": torch.zeros(2).long()}).done()
    with pytest.raises(AttributeError, match="not a server method declared with @wire"):
        endpoint.serve("_catch_up", {"t": 0, "client": 0, "since": 0}).wait()  # declared calls only
    with pytest.raises(ProtocolError, match="reports its replica at round 3, the server has it at 0"):
        endpoint.serve("sync", {"t": 1, "client": 5, "since": 3}).wait()  # replicas and server must agree


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


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The in-process runtime on the tiny config, with one intra-op thread like every torchrun process."""
    return run_one_thread([*TINY, f"job.out_dir={tmp_path_factory.mktemp('inproc')}"])


def assert_same_run(dist_dir: Path, reference, n_workers: int) -> dict:
    """Bit-identical metrics, digests and traffic (every category, control and eval included)."""
    rows, summary = read_run(dist_dir)
    ref_rows, ref_summary = copy.deepcopy(reference)  # shared by the tests of this module
    assert summary["status"] == "completed" and summary["engine"] == "torchrun"
    digests = summary["client_digests"]
    assert len(digests) == n_workers and set(digests.values()) == set(ref_summary["client_digests"].values())
    assert summary["server_digest"] == ref_summary["server_digest"]
    assert rows == ref_rows  # round, processed samples, eval accuracy/loss, train loss and traffic: exactly equal
    assert summary["comm"] == ref_summary["comm"]
    return summary


ORDER_SCRIPT = textwrap.dedent(
    """
    # Runs hosfl_dist.run with the server logging arrivals and the leader's submits of a round held until the server
    # has logged one from the other worker (which then arrives first, however loaded the machine).
    import json, os, sys, time
    from hosfl_dist.config import load_config
    from hosfl_dist.runtime.build import round_plan
    from hosfl_dist.run import main
    from hosfl_dist.runtime import rpc
    from hosfl_dist.runtime.process.launch import role_map
    from hosfl_dist.transport import endpoint

    rank, log = int(os.environ["RANK"]), os.environ["ARRIVALS"]
    if rank == 1:
        cfg = load_config(None, sys.argv[1:])
        others = set(role_map(cfg, 3).hosted[2])
        def arrived(t):
            if not os.path.exists(log):
                return False
            with open(log) as f:
                return any(json.loads(line) in ([t, m] for m in others) for line in f if line.endswith("\\n"))
        call_async = rpc.RPCTransport.call_async
        def late(self, method, **kwargs):
            if method == "submit" and others & set(round_plan(cfg).sampled(kwargs["t"])):
                deadline = time.monotonic() + 60  # only a hang
                while not arrived(kwargs["t"]) and time.monotonic() < deadline:
                    time.sleep(0.01)
            return call_async(self, method, **kwargs)
        rpc.RPCTransport.call_async = late
    if rank == 0:
        serve = endpoint.ServerEndpoint.serve
        def logged(self, method, kwargs, *rest, **more):
            if method == "submit":
                with open(log, "a") as f:
                    f.write(json.dumps([kwargs["t"], kwargs["client"]]) + "\\n")
            return serve(self, method, kwargs, *rest, **more)
        endpoint.ServerEndpoint.serve = logged
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.multiprocess
def test_torchrun_equals_in_process_with_overlap_and_any_arrival_order(tmp_path, reference, monkeypatch):
    """1 server + 2 workers against the in-process runtime (overlap off): latency hiding on (zo.overlap), and the
    leader's activations held back until the other worker's have begun to arrive, so that rounds reach the server
    out of client-id order. Neither may change a bit."""
    script, arrivals = tmp_path / "order.py", tmp_path / "arrivals.jsonl"
    script.write_text(ORDER_SCRIPT)
    monkeypatch.setenv("ARRIVALS", str(arrivals))
    rc, out, _ = torchrun(3, [str(script), *TINY, "zo.overlap=true", f"job.out_dir={tmp_path / 'run'}"])
    assert rc == 0, out[-4000:]
    summary = assert_same_run(tmp_path / "run", reference, n_workers=2)
    assert summary["roles"]["hosted"] == {"worker_1": [0, 2, 4], "worker_2": [1, 3, 5]}
    import socket  # each rank's host, and the interface bound (or who chose it where none was: torch)

    roles = summary["roles"]
    assert roles["hosts"] == {f"rank_{r}": socket.gethostname() for r in range(3)}
    assert roles["interface"] or roles["interface_chosen_by"] == "torch (job.interface unset)"
    by_round: dict[int, list[int]] = {}
    for line in arrivals.read_text().splitlines():
        t, m = json.loads(line)
        by_round.setdefault(t, []).append(m)
    assert len(by_round) == summary["rounds"]
    assert any(order != sorted(order) for order in by_round.values())  # the order really was shuffled
    stats = summary["transport"]["workers"]["worker_1"]
    assert stats["rounds"] == summary["rounds"] and stats["allreduce_calls"] == summary["rounds"]
    timed = {m for m, s in stats["blocked_s"].items() if s > 0}
    assert timed == {m for m, n in stats["blocked"].items() if n}  # each wait that blocked is timed
    assert sum(stats["blocked_s"].values()) <= stats["rpc_wait_s"] + 1e-5


@pytest.mark.multiprocess
def test_fsdp_server_group_of_two_equals_a_one_rank_server(tmp_path, reference):
    """θs sharded over ranks 0-1 with FSDP2 (gloo), one client worker hosting all 6 clients. The round is data
    parallel: each rank runs whole clients' rows, where the 1-rank server runs the K equally shaped uploads as one
    merged pass, so the results equal it to the float rounding of a differently batched conv/matmul (measured ~1e-7
    relative; the bit-for-bit case, one pass per client, is tests/test_scale.py)."""
    rc, out, _ = torchrun(3, ["-m", "hosfl_dist.run", *TINY, "server.ranks=2", f"job.out_dir={tmp_path / 'run'}"])
    assert rc == 0, out[-4000:]
    rows, summary = read_run(tmp_path / "run")
    ref_rows, ref_summary = reference
    assert summary["status"] == "completed" and summary["comm"] == ref_summary["comm"]
    assert len(set(summary["client_digests"].values())) == 1
    for a, b in zip(rows, ref_rows, strict=True):
        assert a["comm"] == b["comm"] and a["processed_samples"] == b["processed_samples"]
        for k in ("eval_loss", "train_loss", "eval_accuracy"):
            assert a[k] == b[k] if b[k] is None else a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    assert summary["roles"]["server_ranks"] == [0, 1] and summary["roles"]["hosted"] == {"worker_2": list(range(6))}
    assert summary["transport"]["server"]["threads"] == 1  # every execution on the server's own thread


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("alg", "extra"),
    [
        ("hosfl", ["clients.dropout=0.3"]),  # server.min_clients = K: two rounds in three are skipped
        pytest.param("sfl", ["clients.dropout=0.3", "clients.dropout_stage=mixed", "clients.over_select=0.5",
                             "server.min_clients=1"], marks=pytest.mark.slow),  # both stages, late clients; 10 s
    ],
)  # fmt: skip
def test_torchrun_equals_in_process_with_clients_dropping(tmp_path, alg, extra):
    """Participation is drawn alike in every process (docs/participation.md): 1 server + 2 workers equal the
    in-process run bit for bit, with the same participation.jsonl and summary.json participation."""
    cfg = [*TINY, f"algorithm.name={alg}", *extra]
    ref = run_one_thread([*cfg, f"job.out_dir={tmp_path / 'inproc'}"])
    rc, out, _ = torchrun(3, ["-m", "hosfl_dist.run", *cfg, f"job.out_dir={tmp_path / 'run'}"])
    assert rc == 0, out[-4000:]
    summary = assert_same_as(tmp_path / "run", ref)  # a baseline's two workers fetch θc at the end: eval traffic
    assert len(summary["client_digests"]) == 2
    part = summary["participation"]
    assert part == ref[1]["participation"] and part["dropped"] > 0
    assert alg != "hosfl" or part["rounds_skipped"] > 0
    log = "participation.jsonl"
    assert (tmp_path / "run" / log).read_text() == (tmp_path / "inproc" / log).read_text()


FAIL_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from hosfl_dist.algorithms import hosfl
    from hosfl_dist.run import main

    if os.environ["RANK"] == "2":
        run_round = hosfl.HOSFLWorker.run_round
        def broken(self, t):
            if t == 2:
                if os.environ.get("CLAIM_FIRST"):  # something outside the job writes the failure key of before
                    import torch.distributed as dist
                    store = dist.distributed_c10d._get_default_store()  # the job's store, which has no password
                    store.add("hosfl/failed/0", 1)
                raise RuntimeError("injected client failure")
            return run_round(self, t)
        hosfl.HOSFLWorker.run_round = broken
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "claimed", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["plain", "failure-key-claimed-from-outside"]
)  # 9 s each
def test_a_failing_client_worker_stops_the_job_and_its_error_is_shown_once(tmp_path, monkeypatch, claimed):
    """…and summary.json records it, also when something outside the job wrote the failure key first (the key is
    named after the job's token, and every failing process tells the front)."""
    if claimed:
        monkeypatch.setenv("CLAIM_FIRST", "1")
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
