"""The RPC gate (runtime/process/gate.py; docs/checkpoints.md, "Trust boundary"): bytes that are not the protocol never
reach TensorPipe, which aborts on them (its uv transport allocates whatever length a connection sends first).

- the shield: a listener admits connections from the (address, port) pairs it holds alone, the address checked too;
- the gate, in one process with a plain listener standing in for TensorPipe's: a holder of the token passes, bytes
  cross both ways; HTTP, random bytes, half a handshake, a wrong token, another process at a dialer, and a direct
  connection reach nothing behind it; a pipe's brochure answer is readdressed to the dialer;
- live runs (multiprocess, slow): every listening port of every process of a torchrun job and of an elastic run (and
  torchrun's agent) gets an HTTP GET, 64 KiB of random bytes and half a handshake in the middle of training; the run
  completes with the reference run's digests.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from hosfl_dist.runtime.process import gate as G
from hosfl_dist.runtime.process.groups import RPC_CHANNELS, RPC_TRANSPORTS
from tiny import TINY_OVERRIDES, assert_same_as, read_run, run_one_thread, torchrun

TOKEN = "c3" * 32
HTTP = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


def _accepted(listener: socket.socket) -> list[socket.socket]:
    """Accept on ``listener`` in the background; the list of connections it accepted so far."""
    got: list[socket.socket] = []

    def loop() -> None:
        while True:
            try:
                got.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=loop, daemon=True).start()
    return got


def _connects(src: tuple[str, int], dst: tuple[str, int]) -> bool:
    """Whether a connection from ``src`` to ``dst`` completes. Loopback answers a SYN at once, so half a second
    only ever runs out on a SYN that was dropped."""
    s = socket.socket()
    s.settimeout(0.5)
    s.bind(src)
    try:
        s.connect(dst)
        return True
    except OSError:
        return False
    finally:
        s.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_shield_admits_the_pairs_it_holds_alone_address_and_port():
    listener = socket.create_server(("127.0.0.1", 0))
    dst = listener.getsockname()
    accepted = _accepted(listener)
    shield = G.Shield(listener.fileno())
    port, unused = _free_port(), _free_port()
    assert not _connects(("127.0.0.1", 0), dst)
    with shield.admitted("127.0.0.1", port), shield.admitted("127.0.0.1", unused):
        assert not _connects(("127.0.0.2", port), dst)  # the same port from another address
        assert not _connects(("127.0.0.1", 0), dst)
        assert _connects(("127.0.0.1", port), dst)
    assert not _connects(("127.0.0.1", unused), dst)  # revoked
    time.sleep(0.2)
    assert len(accepted) == 1
    shield.close()
    listener.close()


def _run(prog: list[tuple[int, int, int, int]], family: int, ip: str, port: int) -> bool:
    """Classic BPF as the kernel runs the gate's programs on a TCP segment (ld/ldh absolute, jeq, ret): kept?"""
    net = socket.inet_pton(family, ip)
    header = bytes(12) + net + bytes(4) if family == socket.AF_INET else bytes(8) + net + bytes(16)
    tcp = port.to_bytes(2, "big") + bytes(18)
    pc, a = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        if code == 0x06:
            return k != 0
        if code in (0x20, 0x28):  # ld / ldh [k]: from the TCP header, or the network header below SKF_NET_OFF
            off = k - (1 << 32) - G._SKF_NET_OFF if k >= 1 << 31 else k
            data = header if k >= 1 << 31 else tcp
            a = int.from_bytes(data[off : off + (4 if code == 0x20 else 2)], "big")
            pc += 1
        else:
            assert code == 0x15 and max(jt, jf) < 256
            pc += 1 + (jt if a == k else jf)


@pytest.mark.parametrize(("family", "ip", "other"), [(socket.AF_INET, "10.0.0.1", "10.0.0.2"),
                                                     (socket.AF_INET6, "fe80::1", "fe80::2")])  # fmt: skip
def test_the_filter_program_keeps_the_pairs_it_lists_alone(family, ip, other):
    assert not _run(G.filter_program(family, []), family, ip, 40000)
    for n in (1, 3, G.MAX_ADMITTED):
        pairs = [(ip if i % 2 else other, 40000 + i) for i in range(n)]
        prog = G.filter_program(family, pairs)
        for addr, port in pairs:
            assert _run(prog, family, addr, port)
            assert not _run(prog, family, other if addr == ip else ip, port)  # the port, from the other address
            assert not _run(prog, family, addr, port + 100)
    with pytest.raises(G.GateError, match="at most 16"):
        G.filter_program(family, [(ip, p) for p in range(17)])


def test_rpc_uses_only_what_the_gate_covers():
    assert RPC_TRANSPORTS == G.TRANSPORTS and set(RPC_CHANNELS) <= G.CHANNELS


class _StandIn:
    """A listener in TensorPipe's place (echoes what it reads), behind a gate of this process."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.received: list[bytes] = []
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()
        self.gate = G.RpcGate(TOKEN, 30)
        self.view = self.gate.view(dist.HashStore())
        self.view.set("rpc_prefix_0/addrs/server", f"uv://127.0.0.1:{self.address[1]}".encode())
        self.published = self.view._base.get("rpc_prefix_0/addrs/server").decode()
        self.dialer = G._split(self.view.get("rpc_prefix_0/addrs/server").decode()[5:])

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1

            def echo(c: socket.socket) -> None:
                while data := c.recv(1 << 16):
                    self.received.append(data)
                    c.sendall(data)

            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self.gate.close()
        self.listener.close()


@pytest.fixture
def stand_in():
    s = _StandIn()
    yield s
    s.close()


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(8, "little") + payload


def test_a_holder_of_the_token_passes_and_bytes_cross_both_ways(stand_in):
    assert stand_in.published.startswith("hosfl-gate://127.0.0.1:")
    with socket.create_connection(stand_in.dialer, timeout=10) as c:
        c.sendall(_frame(b"\xb8\x01\xb9\x01\x07"))  # a pipe's later connection (RequestedConnection)
        c.sendall(b"x" * 300_000)
        got = b""
        while len(got) < 300_013:
            got += c.recv(1 << 16)
    assert got == _frame(b"\xb8\x01\xb9\x01\x07") + b"x" * 300_000
    assert stand_in.accepted == 1


def test_bytes_that_are_not_the_protocol_reach_nothing_behind_the_gate(stand_in, monkeypatch):
    monkeypatch.setattr(G, "HANDSHAKE_S", 2.0)  # the bound on half a handshake, short for the test
    gate = G._split(stand_in.published.split("://")[1])
    sent = []
    for payload in (HTTP, os.urandom(65536), b"\x00" * 8):
        sent.append(socket.create_connection(gate, timeout=3 * G.HANDSHAKE_S))
        sent[-1].sendall(payload)
    for s in sent:  # the gate's hello, then it closes (or resets) the connection: at once, or after its bound
        with contextlib.suppress(ConnectionResetError):
            while s.recv(4096):
                pass
        s.close()
    # half a handshake: the gate's hello read, part of the answer sent, then silence past the handshake's bound
    half = socket.create_connection(gate, timeout=10)
    assert half.recv(len(G.MAGIC)) == G.MAGIC
    half.sendall(os.urandom(20))
    with pytest.raises(ConnectionError):  # a caller with another token: the gate closes on it
        G.dial(G._mac(b"another", b"hosfl rpc gate"), gate)
    # the shielded listener itself, and a dialer from another process
    assert not _connects(("127.0.0.1", 0), stand_in.address)
    other = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import socket
        c = socket.create_connection({stand_in.dialer!r}, timeout=10)
        c.sendall({HTTP!r})
        try:
            print(repr(c.recv(100)))
        except OSError as exc:
            print(type(exc).__name__)
    """)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert other.stdout.strip() in ("b''", "ConnectionResetError"), other
    time.sleep(0.2)
    assert stand_in.accepted == 0 and stand_in.received == []
    assert stand_in.gate.refusals.count >= 5
    half.close()
    test_a_holder_of_the_token_passes_and_bytes_cross_both_ways(stand_in)  # and the gate still serves its own


def test_a_forged_gate_gets_no_connection_out_of_a_dialer():
    """A store entry pointing at something that is not the peer's gate (the store has no authentication): the dialer
    refuses an answer without the token's proof and connects nowhere."""
    forged = socket.create_server(("127.0.0.1", 0))
    target = socket.create_server(("127.0.0.1", 0))
    reached = _accepted(target)

    def answer() -> None:
        conn, _ = forged.accept()
        conn.sendall(G.MAGIC + os.urandom(G.NONCE_BYTES))
        G._recv_exactly(conn, G.NONCE_BYTES + 2 + G.MAC_BYTES)
        conn.sendall(os.urandom(G.MAC_BYTES) + G._join(*target.getsockname()).encode().ljust(G.ADDRESS_BYTES))
        conn.recv(1)

    threading.Thread(target=answer, daemon=True).start()
    with pytest.raises(G.GateError, match=r"^the RPC gate at 127.0.0.1:\d+ did not prove this job's token$"):
        G.dial(G._mac(TOKEN.encode(), b"hosfl rpc gate"), forged.getsockname())
    time.sleep(0.2)
    assert reached == []


def test_a_pipes_brochure_answer_is_readdressed_to_the_dialer():
    # as TensorPipe writes it (captured): Structure of 7, "uv", the listener's address, then the rest
    answer = _frame(b"\xb9\x07\xbd\x02uv\xbd\x0f127.0.0.1:41035\xbb\x01\x01\x00\xbd\x04uv:*")
    out = G._readdress(answer, "127.0.0.1:41035", "127.0.0.1:5123")
    assert out == _frame(b"\xb9\x07\xbd\x02uv\xbd\x0e127.0.0.1:5123\xbb\x01\x01\x00\xbd\x04uv:*")
    with pytest.raises(G.GateError, match="brochure answer is not the one the RPC gate knows"):
        G._readdress(answer, "127.0.0.1:41036", "127.0.0.1:5123")


def test_a_peer_that_publishes_no_gate_is_refused_in_one_line(stand_in):
    stand_in.view._base.set("rpc_prefix_0/addrs/old", b"uv://127.0.0.1:4000")
    with pytest.raises(G.GateError, match=r"^a peer published 'uv://127.0.0.1:4000' where a hosfl-gate:// address"):
        stand_in.view.get("rpc_prefix_0/addrs/old")
    stand_in.view.set("hosfl/other", b"v")  # every other key passes through
    assert stand_in.view.get("hosfl/other") == b"v" and stand_in.view.add("n", 2) == 2


# ------------------------------------------------------------------------------------------------------------------
# Live runs: hostile bytes into every listening port, in the middle of training


def listening(pid: int) -> list[tuple[str, int]]:
    """Every TCP (address, port) process ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:
                found.append(G._endpoint(family, cols[1]))
    return sorted(set(found))


def assault(pids: list[int]) -> dict[str, list[str]]:
    """An HTTP GET, 64 KiB of random bytes and half a handshake (the protocol's first bytes, then silence past the
    gate's bound) into every port ``pids`` listen on; what each port did, by "pid address:port"."""
    outcome: dict[str, list[str]] = {}
    held = []
    for pid in pids:
        for host, port in listening(pid):
            where = ("127.0.0.1" if host in ("0.0.0.0", "::") else host, port)
            said = outcome.setdefault(f"{pid} {G._join(*where)}", [])
            for name, payload in (("http", HTTP), ("random", os.urandom(65536)), ("half", None)):
                try:
                    s = socket.create_connection(where, timeout=2)
                except OSError:
                    said.append(f"{name}: dropped")  # a shielded TensorPipe listener: its SYN never answered
                    continue
                try:
                    if payload is None:
                        s.settimeout(0.3)
                        try:
                            hello = s.recv(64)
                        except OSError:
                            hello = b""
                        # a gate's hello answered with part of a dialer's answer; anything else: a length, a byte
                        s.sendall(os.urandom(20) if hello.startswith(G.MAGIC) else (64).to_bytes(8, "little") + b"\0")
                        held.append(s)
                        said.append("half: held open")
                        continue
                    s.sendall(payload)
                    s.settimeout(1)
                    with contextlib.suppress(OSError):  # an answer, a close, a reset, or silence
                        s.recv(4096)
                    said.append(f"{name}: sent")
                except OSError as exc:
                    said.append(f"{name}: {type(exc).__name__}")
                finally:
                    if payload is not None:
                        s.close()
    time.sleep(G.HANDSHAKE_S + 2)
    for s in held:
        s.close()
    return outcome


JOB_SCRIPT = textwrap.dedent(
    """
    # hosfl_dist.run; each rank says its pid, and every client worker holds its round-2 submit until the assault is over
    import os, sys, time
    from pathlib import Path
    from hosfl_dist.run import main
    from hosfl_dist.runtime import rpc

    folder, rank = Path(os.environ["HOSTILE_DIR"]), int(os.environ["RANK"])
    (folder / f"pid-{rank}").write_text(str(os.getpid()))
    batch = rpc.RPCTransport.call_batch

    def held(self, calls):
        if any(m == "submit" and kw["t"] >= 2 for m, kw in calls) and not (folder / "go").exists():
            (folder / "held").write_text("")
            deadline = time.monotonic() + 180
            while not (folder / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return batch(self, calls)

    rpc.RPCTransport.call_batch = held
    sys.exit(main(sys.argv[1:]))
    """
)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("server_ranks", [1, 2], ids=["one-rank-server", "fsdp-server-group"])
def test_garbage_into_every_port_of_a_torchrun_job_leaves_it_to_complete_with_the_reference_digests(
    tmp_path, monkeypatch, server_ranks
):
    """3 processes with a one-rank server (reference: the in-process run, bit for bit), or 4 with a server group of
    two (its gloo group too; reference: the same job without the bytes)."""
    folder = tmp_path / "hostile"
    folder.mkdir()
    (folder / "job.py").write_text(JOB_SCRIPT)
    monkeypatch.setenv("HOSTILE_DIR", str(folder))
    monkeypatch.setenv("HOSFL_JOB_TOKEN", "d4" * 32)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # the job's store on rank 0, as launch/torchrun.sh
    overrides = [*TINY_OVERRIDES, "server.rpc_timeout_s=120", f"server.ranks={server_ranks}"]
    nproc = 2 + server_ranks
    result: dict = {}

    def attack() -> None:
        deadline = time.monotonic() + 200
        while not (folder / "held").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            ranks = [int((folder / f"pid-{r}").read_text()) for r in range(nproc)]
            result["ranks"] = ranks
            result["outcome"] = assault([_parent(ranks[0]), *ranks])  # torchrun's agent too
        finally:
            (folder / "go").write_text("")

    thread = threading.Thread(target=attack)
    thread.start()
    rc, out, _ = torchrun(nproc, [str(folder / "job.py"), *overrides, f"job.out_dir={tmp_path / 'run'}"])
    thread.join()
    assert rc == 0, out[-4000:]
    outcome = result["outcome"]
    for pid in result["ranks"]:  # each rank's gloo, gate and dialers got every payload; its TensorPipe dropped them
        ports = {k: v for k, v in outcome.items() if k.startswith(f"{pid} ")}
        assert sum("http: sent" in v for v in ports.values()) >= 2, outcome
        assert any("http: dropped" in v for v in ports.values()), outcome
    assert "RPC gate: refused" in out
    if server_ranks == 1:
        reference = run_one_thread([*overrides, f"job.out_dir={tmp_path / 'reference'}"])
    else:
        (folder / "go").write_text("")  # no hold, no bytes
        rc, out, _ = torchrun(nproc, [str(folder / "job.py"), *overrides, f"job.out_dir={tmp_path / 'reference'}"])
        assert rc == 0, out[-4000:]
        reference = read_run(tmp_path / "reference")
    assert_same_as(tmp_path / "run", reference)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_garbage_into_every_port_of_an_elastic_run_leaves_it_to_complete_with_its_replays_digests(tmp_path):
    from test_elastic import ELASTIC, Job, check_replays

    # the workers are stopped while the bytes go in (the server waits for their round: server.round_timeout_s=0), so
    # that the run is in the middle of training whatever the machine's speed; each process's kernel still answers
    overrides = [*ELASTIC, "server.worker_timeout_s=120", "train.budget_samples=2400", "train.eval_every_samples=1200"]
    job = Job(tmp_path, overrides)
    try:
        workers = job.training_with(2)
        for w in workers:
            w.send_signal(signal.SIGSTOP)
        pids = [p.pid for p in job.procs]
        outcome = assault(pids)
        assert job.summary()["status"] == "running"
        for w in workers:
            w.send_signal(signal.SIGCONT)
    finally:
        code = job.finish()
    assert code == 0, job.said()
    for pid in pids:
        ports = {k: v for k, v in outcome.items() if k.startswith(f"{pid} ")}
        assert sum("http: sent" in v for v in ports.values()) >= 2, outcome
        assert any("http: dropped" in v for v in ports.values()), outcome
    check_replays(tmp_path, job, overrides)
