"""What the torchrun runtime costs the machine beyond its work, and the waits that must not kill a job.

- the server executes every call on one long-lived thread (the RPC thread that delivered it only queues it), so
  glibc's per-thread malloc arenas do not multiply the server's memory; the thread ends with its endpoint;
- TensorPipe runs on transports that sleep while idle (no shared-memory or InfiniBand reactor polling a core);
- an evaluation longer than ``server.rpc_timeout_s`` and ``server.collective_timeout_s`` completes: the workers that
  wait for the evaluating leader wait through the store, bounded by ``train.eval_timeout_s``.

Memory and CPU themselves are measured by bench/cpu_hygiene.py; these tests assert the behaviour behind them.
"""

from __future__ import annotations

import datetime
import gc
import json
import platform
import textwrap
import threading
import weakref

import pytest
import torch
import torch.distributed as dist

from hosfl_dist.runtime.process.groups import Distributed
from hosfl_dist.runtime.process.host import (
    MALLOC_ARENAS,
    MMAP_THRESHOLD,
    WORKER_MMAP_THRESHOLD,
    fix_mmap_threshold,
    keep_freed_memory,
    limit_malloc_arenas,
)
from hosfl_dist.runtime.process.launch import LaunchEnv, RoleMap
from hosfl_dist.transport.endpoint import ServerEndpoint, ServerThread
from hosfl_dist.transport.wire import DOWNLINK_MODEL, UPLINK_ACTIVATIONS, wire
from tiny import TINY_OVERRIDES, read_run, torchrun


class Toy:
    """A server with one gathered, round-closing call and one call held until the previous round is closed; each
    execution records the thread it ran on."""

    def __init__(self, release: threading.Event | None = None) -> None:
        self.log: list[tuple[str, int, int]] = []  # (method, t, thread id)
        self.release = release
        self.entered = threading.Event()

    def expected_in_round(self, t: int) -> int:
        return 2

    @wire(args={"x": UPLINK_ACTIVATIONS}, result={"y": DOWNLINK_MODEL}, gather=True, closes_round=True)
    def up(self, t: int, batch: dict) -> dict:
        self.entered.set()
        if self.release is not None:
            self.release.wait(10)
        self.log.append(("up", t, threading.get_ident()))
        return {m: {"y": batch[m]["x"] * 2} for m in batch}

    @wire(result={"y": DOWNLINK_MODEL}, after_previous_round=True)
    def down(self, t: int, client: int) -> dict:
        self.log.append(("down", t, threading.get_ident()))
        return {"y": torch.ones(1)}


def test_enqueued_calls_run_on_one_server_thread_with_the_endpoint_rules_unchanged():
    """Calls handed over from several threads (as RPC threads do) all execute on the endpoint's server thread, with
    gathering, holding and round order as :meth:`serve` has them; an enqueue returns while an execution is running."""
    release = threading.Event()
    toy = Toy(release)
    ep = ServerEndpoint(toy)
    answers: dict[str, object] = {}

    def call(name: str, method: str, kwargs: dict) -> None:
        answers[name] = ep.enqueue(method, kwargs)

    senders = [
        threading.Thread(target=call, args=("held", "down", {"t": 1, "client": 5})),
        threading.Thread(target=call, args=("a", "up", {"t": 0, "client": 7, "x": torch.ones(1)})),
        threading.Thread(target=call, args=("b", "up", {"t": 0, "client": 3, "x": 3 * torch.ones(1)})),
    ]
    for s in senders:  # one after the other: the held call is queued first, as in the endpoint's own test
        s.start()
        s.join()
    assert toy.entered.wait(10)  # round 0 is executing (and holds the endpoint's lock) ...
    later = ep.enqueue("up", {"t": 1, "client": 0, "x": torch.ones(1)})
    assert toy.log == [] and not later.done()  # ... and an enqueue returned without waiting for it
    release.set()
    assert answers["a"].wait()["y"].item() == 2 and answers["b"].wait()["y"].item() == 6
    assert answers["held"].wait()["y"].item() == 1
    ep.enqueue("up", {"t": 1, "client": 1, "x": torch.ones(1)}).wait()
    assert later.wait()["y"].item() == 2
    assert [(m, t) for m, t, _ in toy.log] == [("up", 0), ("down", 1), ("up", 1)]
    threads = {tid for _, _, tid in toy.log}
    assert threads == {ep._thread.ident} and threading.get_ident() not in threads
    assert ep.stats()["threads"] == 1
    with pytest.raises(KeyError):  # a gathered call without its round: the caller gets the error
        ep.enqueue("up", {"client": 0, "x": torch.ones(1)}).wait()
    with pytest.raises(AttributeError, match="not a server method declared with @wire"):
        ep.enqueue("expected_in_round", {"t": 0}).wait()


def test_the_server_thread_ends_with_its_endpoint():
    """Tests and sweeps make many endpoints: a dropped one must take its thread (and its server) with it."""
    ep = ServerEndpoint(Toy())
    ep.enqueue("down", {"t": 0, "client": 0}).wait()
    thread = next(t for t in threading.enumerate() if t.ident == ep._thread.ident)
    server = weakref.ref(ep.server)
    del ep
    gc.collect()
    thread.join(10)
    assert not thread.is_alive() and server() is None


def test_a_job_that_raises_does_not_stop_the_server_thread(caplog):
    jobs = ServerThread("test-server")
    ran = threading.Event()
    jobs.put(lambda: 1 / 0)
    jobs.put(ran.set)
    assert ran.wait(10) and "test-server: a job failed" in caplog.text


def test_malloc_arenas_are_capped_unless_the_environment_sets_them():
    assert limit_malloc_arenas({"MALLOC_ARENA_MAX": "4"}) == 4  # glibc read it at start: left as it is
    expected = MALLOC_ARENAS if platform.libc_ver()[0] == "glibc" else None  # elsewhere there is nothing to cap
    assert limit_malloc_arenas({}) == expected


def test_the_mmap_threshold_is_fixed_unless_the_environment_sets_it():
    assert fix_mmap_threshold({"MALLOC_MMAP_THRESHOLD_": "65536"}) == 65536  # glibc read it at start
    expected = MMAP_THRESHOLD if platform.libc_ver()[0] == "glibc" else None
    assert fix_mmap_threshold({}) == expected


def test_a_client_worker_keeps_freed_memory_unless_the_environment_says_otherwise():
    assert keep_freed_memory({"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}) == 65536
    expected = WORKER_MMAP_THRESHOLD if platform.libc_ver()[0] == "glibc" else None
    try:
        assert keep_freed_memory({}) == expected
    finally:
        fix_mmap_threshold({})  # back to the setting the test above leaves this process with


def test_only_a_sharded_server_group_returns_what_it_frees():
    from hosfl_dist.config import load_config
    from hosfl_dist.runtime.process.groups import set_allocator
    from hosfl_dist.runtime.process.launch import role_map

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's malloc thresholds: this C library has none")
    one = role_map(load_config(None, TINY_OVERRIDES), 3)
    two = role_map(load_config(None, [*TINY_OVERRIDES, "server.ranks=2"]), 4)
    try:
        assert [set_allocator(r, one) for r in range(3)] == [WORKER_MMAP_THRESHOLD] * 3  # the one server rank too
        assert [set_allocator(r, two) for r in range(4)] == [MMAP_THRESHOLD] * 2 + [WORKER_MMAP_THRESHOLD] * 2
    finally:
        fix_mmap_threshold({})  # back to the setting the tests above leave this process with


def test_a_worker_waits_for_a_key_posted_by_a_peer_and_a_missing_key_times_out_with_its_name():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    env = LaunchEnv(0, 2, 0, "127.0.0.1", str(store.port), "test")
    d = Distributed(env, RoleMap(2, (0,), (1,), {1: (0,)}), torch.device("cpu"), None, None)
    d.store = lambda: store  # the default group's store in a real job
    d.post("hosfl/evaluated/3")
    d.wait_for("hosfl/evaluated/3", 1)  # posted: returns at once
    with pytest.raises(TimeoutError, match=r"hosfl/evaluated/4 was not posted within 1 s"):
        d.wait_for("hosfl/evaluated/4", 1)


# ------------------------------------------------------------------------------------------------------------------
# Multi-process tier

THREADS_SCRIPT = textwrap.dedent(
    """
    # hosfl_dist.run, with every process writing the names of its threads once its process groups and RPC are up.
    import glob, json, os, sys
    import torch._dynamo  # the server's first torch optimizer imports it (seconds on a busy machine), after the
    # rendezvous, and the workers wait for the server's build within server.rpc_timeout_s: imported by every rank
    # here, at once, it cannot make the start of this test's short-timeout job depend on the machine's load
    from hosfl_dist.runtime import torchrun
    from hosfl_dist.run import main

    init = torchrun.init_distributed
    def recorded(cfg, env, roles):
        d = init(cfg, env, roles)
        names = sorted({open(p).read().strip() for p in glob.glob("/proc/self/task/*/comm")})
        with open(os.path.join(os.environ["THREADS_DIR"], f"rank{env.rank}.json"), "w") as f:
            json.dump(names, f)
        return d
    torchrun.init_distributed = recorded
    sys.exit(main(sys.argv[1:]))
    """
)
RTT_S, TIMEOUT_S, EVAL_CALLS = 0.5, 5, 11


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_evaluation_longer_than_the_rpc_and_collective_timeouts_completes(tmp_path, monkeypatch):
    """1 server + 2 workers behind an emulated link whose round trip makes each evaluation call take ≥ 0.5 s: with
    11 calls an evaluation takes ≥ 5.5 s, longer than server.rpc_timeout_s and server.collective_timeout_s (5 s),
    while the non-leader worker waits for it. The run completes; the server executed every call on one thread;
    TensorPipe ran libuv (and CMA) only, no transport with a polling reactor."""
    script, threads_dir = tmp_path / "threads.py", tmp_path / "threads"
    script.write_text(THREADS_SCRIPT)
    threads_dir.mkdir()
    monkeypatch.setenv("THREADS_DIR", str(threads_dir))
    overrides = [
        *TINY_OVERRIDES,
        "train.budget_samples=24",  # 1 round, evaluated before and after it
        "train.eval_every_samples=24",
        f"data.eval_max_samples={EVAL_CALLS}",
        "train.eval_batch_size=1",
        "comm.inject_delay=true",
        f"comm.rtt_ms={RTT_S * 1e3:g}",
        f"server.rpc_timeout_s={TIMEOUT_S}",
        f"server.collective_timeout_s={TIMEOUT_S}",
        f"job.out_dir={tmp_path / 'run'}",
    ]
    rc, out, _ = torchrun(3, [str(script), *overrides], timeout=120)
    assert rc == 0, out[-4000:]
    rows, summary = read_run(tmp_path / "run")
    assert summary["status"] == "completed" and [r["processed_samples"] for r in rows] == [0, 24]
    server = summary["transport"]["server"]
    assert server["calls"]["eval_batch"] == 2 * EVAL_CALLS and EVAL_CALLS * RTT_S > TIMEOUT_S
    assert server["threads"] == 1
    for rank in range(3):
        names = json.loads((threads_dir / f"rank{rank}.json").read_text())
        tensorpipe = {n for n in names if n.startswith("TP_")}
        assert "TP_UV_loop" in tensorpipe and tensorpipe <= {"TP_UV_loop", "TP_CMA_loop"}, (rank, tensorpipe)
