"""The trust boundary (docs/checkpoints.md, "Trust boundary"): the job's token and where the job listens.

- every RPC entry point on rank 0 refuses a caller without the job's token, in one line that names nothing secret,
  before it touches the server; a refusal reaches the caller as an error, not as a value;
- :func:`job_token`: the launcher's secret (HOSFL_JOB_TOKEN) never enters the store, rank 0 makes one where there is
  none, a node that alone has or lacks it stops in one line, each attempt has a token of its own;
- rank 0's store listens on loopback on one node and on MASTER_ADDR across nodes where it is an address;
- under torchrun, with the job's store on rank 0 (as launch/torchrun.sh runs it): every rank listens on loopback
  only, and a process outside the job that reads the server's RPC address from the store (it has no
  authentication) and points torch RPC at it reaches nothing: the address is the server's RPC gate
  (runtime/process/gate.py), which lets no byte through to TensorPipe without the job's token; a process that holds
  the launcher's secret passes the gate, and calling every entry point with a wrong token is refused while the job
  completes, with the secret printed and written nowhere; that process runs a function of its choice in the server
  (torch unpickles before any entry point sees a token: what neither the gate nor the token stops).
"""

from __future__ import annotations

import json
import pickle
import secrets
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.futures import Future

from hosfl_dist.errors import ConfigError, ProtocolError
from hosfl_dist.runtime.process.groups import Distributed, job_token, launcher_secret, store_address
from hosfl_dist.runtime.process.launch import LaunchEnv
from hosfl_dist.transport import done
from hosfl_dist.runtime import rpc as entry
from tiny import TINY_OVERRIDES, torchrun

TOKEN = "a1" * 32
REFUSED = "the caller does not hold this job's token"


class _Front:
    """Stands in for rank 0's RRef and front: records what reached it."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.endpoint = self

    def local_value(self) -> _Front:
        return self

    def fail(self, message: str) -> None:
        self.failures.append(message)

    def handle(self, msg: object) -> str:
        return f"handled {msg}"

    def enqueue(self, method: str, kwargs: dict, caller: str | None = None) -> Future:
        return done(f"served {method}")


@pytest.fixture
def front(monkeypatch):
    """Rank 0 with the job's token expected and a front published."""
    fake = _Front()
    monkeypatch.setitem(entry._EXPECTED, "token", TOKEN.encode())
    monkeypatch.setattr(entry, "_PUBLISHED", done(fake))
    return fake


@pytest.mark.parametrize("token", ["b2" * 32, TOKEN[:-1], "", None, TOKEN.encode(), 42], ids=repr)
def test_every_entry_point_refuses_a_wrong_or_missing_token_before_it_touches_the_server(front, token, caplog):
    calls = {
        "fetch_front": lambda: entry._published_front(token),
        "serve": lambda: entry.serve(token, front, "submit", {"t": 0}),
        "serve_batch": lambda: entry.serve_batch(token, front, [("submit", {"t": 0}), ("sync", {"t": 0})]),
        "handle": lambda: entry.handle(token, front, "a report"),
        "notify_failure": lambda: entry._note_failure(token, "forged failure"),
    }
    for name, call in calls.items():
        with pytest.raises(ProtocolError, match=rf"^refused {name}: {REFUSED} \(a process of another job") as exc:
            call().wait()
        assert "\n" not in str(exc.value) and TOKEN not in str(exc.value)
    assert front.failures == []  # the forged failure never reached the front
    assert [r.getMessage() for r in caplog.records] == [f"refused a call of {n}: {REFUSED}" for n in calls]


def test_the_jobs_token_reaches_the_server(front):
    assert entry._published_front(TOKEN).wait() is front
    assert entry.serve(TOKEN, front, "submit", {"t": 0}).wait() == "served submit"
    batch = [("finish_round", {"t": 0}), ("sync", {"t": 1}), ("sync", {"t": 1})]
    assert entry.serve_batch(TOKEN, front, batch).wait() == ["served finish_round", "served sync", "served sync"]
    assert entry.handle(TOKEN, front, "a report").wait() == "handled a report"
    assert entry._note_failure(TOKEN, "worker 2: it broke").wait() is None and front.failures == ["worker 2: it broke"]


def test_calls_sent_in_one_message_are_served_each_on_its_own_and_each_gets_its_answer_or_error(front, monkeypatch):
    """RPCTransport.call_many: one RPC (serve_batch); the server queues each call as if it came alone, in order, and
    each call's future gets its own answer, or its own error; a refused message fails every call of it."""
    served = []

    def enqueue(method, kwargs, caller=None):
        served.append(kwargs["client"])
        return entry.failed(ProtocolError(f"client {kwargs['client']}: bad")) if kwargs["client"] == 1 else \
            done({"lam": kwargs["client"]})  # fmt: skip

    front.enqueue = enqueue
    monkeypatch.setattr(entry.rpc, "rpc_async", lambda to, fn, args, timeout: fn(*args))  # the server, in process
    tr = entry.RPCTransport(front, 5.0, entry.TransportStats(), TOKEN)
    outs = tr.call_many("submit", [{"t": 0, "client": m} for m in range(3)])
    assert served == [0, 1, 2] and outs[0].wait() == {"lam": 0} and outs[2].wait() == {"lam": 2}
    with pytest.raises(ProtocolError, match="client 1: bad"):
        outs[1].wait()
    assert tr.stats.rpc_calls == 1 and tr.stats.calls == {"submit": 1}
    forged = entry.RPCTransport(front, 5.0, entry.TransportStats(), "b2" * 32)
    for out in forged.call_many("submit", [{"t": 0, "client": m} for m in range(2)]):
        with pytest.raises(ProtocolError, match=f"refused serve_batch: {REFUSED}"):
            out.wait()
    assert served == [0, 1, 2]


def test_calls_of_several_methods_in_one_message_are_served_in_order_and_counted_per_method(front, monkeypatch):
    """RPCTransport.call_batch (HO-SFL's leader: its report, then the next round's syncs): one RPC; each call served
    in the order given, each future gets its own answer; a method counted once per message."""
    served = []

    def enqueue(method, kwargs, caller=None):
        served.append((method, kwargs.get("client")))
        return done(f"{method} {kwargs.get('client')}")

    front.enqueue = enqueue
    monkeypatch.setattr(entry.rpc, "rpc_async", lambda to, fn, args, timeout: fn(*args))
    tr = entry.RPCTransport(front, 5.0, entry.TransportStats(), TOKEN)
    calls = [("finish_round", {"t": 0}), ("sync", {"t": 1, "client": 3}), ("sync", {"t": 1, "client": 5})]
    outs = tr.call_batch(calls)
    assert served == [("finish_round", None), ("sync", 3), ("sync", 5)]
    assert [o.wait() for o in outs] == ["finish_round None", "sync 3", "sync 5"]
    assert tr.stats.rpc_calls == 1 and tr.stats.calls == {"finish_round": 1, "sync": 1}


def test_a_message_whose_call_fails_is_answered_at_once_its_pending_calls_with_its_error(front, monkeypatch):
    """A refused round end and the next round's syncs in one message: the syncs wait for that round to close, which
    waits for the worker the refusal is for. The message is answered at the failure, the pending calls with its
    error (whichever is waited on first names the cause), and an answer that comes later changes nothing."""
    held = entry.Future()

    def enqueue(method, kwargs, caller=None):
        return entry.failed(ProtocolError("round 2: refused")) if method == "close" else held

    front.enqueue = enqueue
    monkeypatch.setattr(entry.rpc, "rpc_async", lambda to, fn, args, timeout: fn(*args))
    tr = entry.RPCTransport(front, 5.0, entry.TransportStats(), TOKEN)
    outs = tr.call_batch([("sync", {"t": 3, "client": 1}), ("close", {"t": 2}), ("sync", {"t": 3, "client": 4})])
    assert all(out.done() for out in outs)
    for out in outs:
        with pytest.raises(ProtocolError, match=r"^round 2: refused$"):
            out.wait()
    held.set_result("served late")  # the server's answer after the message's: nobody is told twice
    assert all(out.done() for out in outs)


def test_what_crosses_rpc_arrives_as_it_was_sent_small_tensors_inside_the_message():
    """to_wire / from_wire: a tensor of at most INLINE_BYTES travels as its bytes in the message's pickle (one
    TensorPipe payload less each), a larger one as a tensor; every dtype, shape and value comes back equal, a view
    ships only its own elements."""
    small = [
        torch.arange(5, dtype=torch.long),
        torch.randn(3, 5),
        torch.randn(4, 2).to(torch.bfloat16),
        torch.tensor(2.5, dtype=torch.float64),
        torch.tensor([True, False]),
        torch.empty(0, 7),
        torch.arange(40.0).reshape(8, 5)[:, 1],  # a view: its 8 elements, not the storage's 40
    ]
    big = torch.randn(entry.INLINE_BYTES // 4 + 1)
    sent = entry.to_wire({"seeds": small, "lam": big, "skip": True, "pair": (small[0], 3)})
    assert all(isinstance(x, entry.Inline) for x in sent["seeds"]) and isinstance(sent["lam"], torch.Tensor)
    assert len(sent["seeds"][-1].data) == 8 * 4
    back = entry.from_wire(pickle.loads(pickle.dumps(sent)))
    for a, b in zip(back["seeds"], small, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert torch.equal(back["lam"], big) and back["skip"] is True and back["pair"][1] == 3
    assert torch.equal(back["pair"][0], small[0])
    assert entry.from_wire(ValueError("kept")).args == ("kept",)  # a failed call's error passes through


def test_a_wait_counts_as_blocked_with_its_time_only_when_the_answer_was_not_there_yet():
    """TransportStats.blocked / blocked_s: the round trips on the worker's critical path, not every wait(). The late
    answer is set only once wait() has looked for it (and found none), so it blocks on any machine; its time is
    positive and within the caller's own clock, never compared with a sleep's length."""
    stats, lock = entry.TransportStats(), threading.Lock()
    ready = entry._TimedFuture("sync", stats, lock)
    ready.set_result("early")
    assert ready.wait() == "early" and stats.blocked == {} and stats.blocked_s == {}

    looked = threading.Event()

    class Late(entry._TimedFuture):
        def done(self) -> bool:  # wait() asks whether the answer is there before it waits
            answered = super().done()
            looked.set()
            return answered

    late = Late("submit", stats, lock)
    answer = threading.Thread(target=lambda: (looked.wait(60), late.set_result("late")))  # 60 s: only a hang
    answer.start()
    start = time.perf_counter()
    assert late.wait() == "late"
    answer.join()
    assert stats.blocked == {"submit": 1} and 0 < stats.blocked_s["submit"] <= time.perf_counter() - start
    assert stats.rpc_wait_s >= stats.blocked_s["submit"] and set(stats.as_dict()["blocked_s"]) == {"submit"}


def test_before_the_token_is_set_every_call_is_refused(monkeypatch):
    monkeypatch.setattr(entry, "_EXPECTED", {})
    for token in ("", TOKEN):
        with pytest.raises(ProtocolError, match=REFUSED):
            entry._published_front(token).wait()


def test_a_refusal_that_crossed_rpc_as_a_value_is_raised_by_the_caller():
    """torch sends a failed Python future's error as its value: the caller's side raises it."""
    with pytest.raises(ProtocolError, match="refused serve"):
        entry.raised(ProtocolError("refused serve: ..."))
    assert entry.raised({"lam": 1}) == {"lam": 1}


def _env(rank: int, restart: int = 0, local_world: int = 3, master: str = "head") -> LaunchEnv:
    return LaunchEnv(rank, 3, rank, master, "29500", "run-a", restart, local_world)


def test_rank_0_makes_the_token_where_the_launcher_gave_none_and_every_rank_derives_the_same():
    store = dist.HashStore()
    token = job_token(_env(0), store, None, timeout_s=5)
    assert len(token) == 64 and job_token(_env(1), store, None, timeout_s=5) == token
    assert len(store.get("hosfl/token")) == 64  # the secret went through the store: its readers know it
    later = dist.HashStore()  # the next attempt meets under a prefix of its own: another secret, another token
    assert job_token(_env(0, restart=1), later, None, timeout_s=5) != token


def test_the_launchers_secret_never_enters_the_store_and_each_attempt_has_its_own_token():
    secret = "s" * 40
    store = dist.HashStore()
    token = job_token(_env(0), store, secret, timeout_s=5)
    assert store.get("hosfl/token") == b"" and job_token(_env(2), store, secret, timeout_s=5) == token
    assert secret not in token and job_token(_env(0, restart=1), dist.HashStore(), secret, timeout_s=5) != token


def test_a_node_that_alone_has_or_lacks_the_launchers_secret_stops_in_one_line():
    with_secret = dist.HashStore()
    job_token(_env(0), with_secret, "s" * 40, timeout_s=5)
    with pytest.raises(ConfigError, match=r"^HOSFL_JOB_TOKEN is set on rank 0's node but not on this one: hand every"):
        job_token(_env(1), with_secret, None, timeout_s=5)
    without = dist.HashStore()
    job_token(_env(0), without, None, timeout_s=5)
    with pytest.raises(ConfigError, match=r"^HOSFL_JOB_TOKEN is set on this node but not on rank 0's"):
        job_token(_env(1), without, "s" * 40, timeout_s=5)


def test_a_short_secret_is_refused_naming_its_length_only():
    assert launcher_secret({}) is None and launcher_secret({"HOSFL_JOB_TOKEN": ""}) is None
    assert launcher_secret({"HOSFL_JOB_TOKEN": TOKEN}) == TOKEN
    with pytest.raises(ConfigError, match=r"^HOSFL_JOB_TOKEN has 6 characters; a job token needs at least 32") as exc:
        launcher_secret({"HOSFL_JOB_TOKEN": "hunter"})
    assert "hunter" not in str(exc.value)


def test_the_token_is_left_out_of_the_processs_description():
    d = Distributed(_env(0), None, None, None, None, token=TOKEN)  # type: ignore[arg-type]
    assert TOKEN not in repr(d)


def test_rank_0s_store_listens_on_loopback_on_one_node_and_on_an_address_across_nodes():
    assert store_address(_env(0, local_world=3)) == ("127.0.0.1", "127.0.0.1")
    assert store_address(_env(0, local_world=2, master="10.0.0.1")) == ("10.0.0.1", "10.0.0.1")
    assert store_address(_env(0, local_world=2, master="fe80::1")) == ("fe80::1", "fe80::1")
    # a host name may resolve to loopback on the head itself (Debian's 127.0.1.1): every interface, as torchrun's
    assert store_address(_env(0, local_world=2, master="head")) == ("head", None)


# ------------------------------------------------------------------------------------------------------------------
# Multi-process: a process outside the job against a running server

LISTENING = textwrap.dedent(
    """
    import os, socket

    def listening():
        '''The (address, port) of every TCP socket this process listens on, from /proc.'''
        mine = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                mine.add(link[8:-1])
        found = []
        for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
            for line in open(f"/proc/net/{table}").read().splitlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in mine:  # 0A: LISTEN
                    continue
                raw, port = cols[1].split(":")
                words = bytes.fromhex(raw)
                packed = b"".join(words[i : i + 4][::-1] for i in range(0, len(words), 4))
                found.append((socket.inet_ntop(family, packed), int(port, 16)))
        return found
    """
)

JOB_SCRIPT = LISTENING + textwrap.dedent(
    """
    # hosfl_dist.run, each rank writing where it listens; rank 0 runs the outsider once the front is published, and
    # the leader holds round 2 until the outsider is done, so that its calls reach a server in the middle of a run.
    import json, subprocess, sys, time
    from pathlib import Path
    from hosfl_dist.run import main
    from hosfl_dist.runtime import torchrun
    from hosfl_dist.runtime import rpc

    rank, folder = int(os.environ["RANK"]), Path(os.environ["TRUST_DIR"])
    outcome = folder / "outsider.json"

    def record():
        mine = {"store port": int(os.environ["MASTER_PORT"]), "pid": os.getpid(), "sockets": listening()}
        (folder / f"listening-{rank}.json").write_text(json.dumps(mine))

    if rank == 0:
        publish = torchrun.publish
        def publish_then_let_the_outsider_in(front):
            ref = publish(front)
            record()
            key = f"hosfl/{os.environ['TORCHELASTIC_RUN_ID']}/attempt-0/rpc_prefix_0/addrs/server"
            env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.getcwd(), "TP_SOCKET_IFNAME": "lo"}
            for who, secret in (("stranger", ""), ("holder", os.environ["HOSFL_JOB_TOKEN"])):
                out = folder / f"{who}.json"
                done = subprocess.run([sys.executable, str(folder / "outsider.py"), os.environ["MASTER_PORT"], key,
                                       str(out), os.environ["TORCHELASTIC_RUN_ID"]], env={**env, "SECRET": secret},
                                      capture_output=True, text=True, timeout=120)
                if not out.exists():  # the stranger's own TensorPipe aborts on the gate's first bytes
                    out.write_text(json.dumps({"outsider failed": done.stderr[-3000:], "exit": done.returncode}))
            outcome.write_text("")
            return ref
        torchrun.publish = publish_then_let_the_outsider_in
    else:
        fetch = torchrun.fetch_front
        def recorded(*args):
            record()
            return fetch(*args)
        torchrun.fetch_front = recorded
    if rank == 1:
        call_async = rpc.RPCTransport.call_async
        def held(self, method, **kwargs):
            if method == "submit" and kwargs["t"] == 2:
                deadline = time.monotonic() + 120
                while not outcome.exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
            return call_async(self, method, **kwargs)
        rpc.RPCTransport.call_async = held
    sys.exit(main(sys.argv[1:]))
    """
)

OUTSIDER = textwrap.dedent(
    """
    # A process outside the job: it reads the server's RPC address from the job's store, joins no group of the job and
    # points torch RPC at it (torch internals: the agent's key is rpc_prefix_<n>/addrs/<name>, and a dynamic agent
    # learns a peer through _update_group_membership). A stranger (SECRET empty) uses the address as it is; a holder
    # of the launcher's secret derives the attempt's token and goes through an RPC gate of its own, then calls every
    # entry point with a wrong token.
    import datetime, hashlib, hmac, json, os, sys
    from pathlib import Path
    import torch.distributed as dist
    import torch.distributed.rpc as rpc
    from hosfl_dist.runtime import rpc as entry
    from hosfl_dist.runtime.process.gate import open_gate

    port, key, out, run_id = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    secret = os.environ["SECRET"]
    got = {}
    try:
        job = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
        address = job.get(key)  # no authentication: whoever reaches the store reads it
        got["published"] = address.decode()
        mine = dist.HashStore()  # a group of its own, which knows the server's address
        if not secret:
            address = address.replace(b"hosfl-gate://", b"uv://")  # TensorPipe straight at the published port
        mine.set("rpc_prefix_0/addrs/server", address)
        if secret:
            token = hmac.new(secret.encode(), f"hosfl/{run_id}/attempt-0".encode(), hashlib.sha256).hexdigest()
            mine = open_gate(token, 30).view(mine)
        dist.register_rendezvous_handler("outsider", lambda url, **kwargs: iter([(mine, 99, None)]))
        opts = rpc.TensorPipeRpcBackendOptions(init_method="outsider://", rpc_timeout=30, _transports=["uv"],
                                               _channels=["basic"])
        rpc.init_rpc("outsider", rank=99, world_size=None, rpc_backend_options=opts)
        rpc.api._get_current_rpc_agent()._update_group_membership(rpc.WorkerInfo("server", 0), [], {}, True)
        calls = {
            "fetch_front": (entry._published_front, ("0" * 64,)),
            "fetch_front without a token": (entry._published_front, (None,)),
            "serve": (entry.serve, ("0" * 64, None, "submit", {"t": 0, "client": 0})),
            "serve_batch": (entry.serve_batch, ("0" * 64, None, [("submit", {"t": 0, "client": 0})])),
            "handle": (entry.handle, ("0" * 64, None, None)),
            "notify_failure": (entry._note_failure, ("0" * 64, "worker 1: forged failure")),
        }
        for name, (fn, args) in calls.items():
            try:
                got[name] = f"answered {entry.raised(rpc.rpc_sync('server', fn, args=args))!r}"
            except Exception as exc:
                got[name] = f"{type(exc).__name__}: {exc}"
        # what the token does not stop: any function the server can import runs there
        try:
            got["os.getpid"] = rpc.rpc_sync("server", os.getpid)
        except Exception as exc:
            got["os.getpid"] = f"{type(exc).__name__}: {exc}"
        rpc.shutdown(graceful=False)
    except Exception as exc:
        got["outsider failed"] = f"{type(exc).__name__}: {exc}"
    out.write_text(json.dumps(got))
    """
)


@pytest.mark.slow  # 12 s; the gate itself in the default tier: tests/test_rpc_gate.py
@pytest.mark.multiprocess
def test_a_process_outside_the_job_is_refused_by_the_running_server_and_the_job_completes(tmp_path, monkeypatch):
    secret = secrets.token_hex(32)
    (tmp_path / "job.py").write_text(JOB_SCRIPT)
    (tmp_path / "outsider.py").write_text(OUTSIDER)
    monkeypatch.setenv("TRUST_DIR", str(tmp_path))
    monkeypatch.setenv("HOSFL_JOB_TOKEN", secret)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # the job's store on rank 0, as launch/torchrun.sh
    run = tmp_path / "run"
    rc, out, _ = torchrun(
        3, [str(tmp_path / "job.py"), *TINY_OVERRIDES, "server.rpc_timeout_s=60", f"job.out_dir={run}"]
    )
    assert rc == 0, out[-4000:]

    ranks = {r: json.loads((tmp_path / f"listening-{r}.json").read_text()) for r in range(3)}
    stranger = json.loads((tmp_path / "stranger.json").read_text())  # no call of it answered, none ran on the server
    assert stranger and all(not str(v).startswith("answered") and v != ranks[0]["pid"] for v in stranger.values())
    assert "[server] RPC gate: refused a connection" in out, out[-4000:]  # the stranger's bytes stopped at the gate

    got = json.loads((tmp_path / "holder.json").read_text())
    assert got.pop("published").startswith("hosfl-gate://"), got
    assert got.pop("os.getpid") == ranks[0]["pid"], got  # torch ran the holder's pickled call on the server
    assert set(got) == {"fetch_front", "fetch_front without a token", "serve", "serve_batch", "handle",
                        "notify_failure"}, got
    for name, answer in got.items():
        entry_point = name.split()[0]
        assert answer.startswith(f"ProtocolError: refused {entry_point}: {REFUSED}"), (name, answer)
    assert out.count("[server] refused a call of ") == 6, out[-4000:]

    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and "error" not in summary  # the forged failure was not recorded
    assert secret not in out
    for path in run.rglob("*"):
        assert not path.is_file() or secret.encode() not in path.read_bytes(), path

    # every rank listens on loopback alone: gloo, TensorPipe, its gate and dialers, and on rank 0 the job's store
    assert ["127.0.0.1", ranks[0]["store port"]] in ranks[0]["sockets"], ranks
    assert all(len(ranks[r]["sockets"]) >= 2 for r in ranks), ranks
    assert {address for r in ranks for address, _ in ranks[r]["sockets"]} == {"127.0.0.1"}, ranks
