"""The RPC gate: a process's TensorPipe listener reachable by holders of the job's token alone.

TensorPipe trusts the first bytes of a connection: its uv transport reads an 8-byte length and allocates that much
before anything is checked (``StreamReadOperation::readFromLoop``, tensorpipe/common/stream_read_write_ops.h). The
27 bytes of an HTTP GET ask for 0x5448202f20544547 bytes; ``std::bad_alloc`` is thrown on the loop thread
(``TP_UV_loop``), nothing catches it, and the process aborts (exit 134). That code is compiled into torch and cannot be
made to survive such bytes from here, so the gate keeps every byte that does not come from a holder of the token away
from it, in three parts:

* **the shield** (:class:`Shield`): a classic BPF socket filter on TensorPipe's listening socket drops every segment
  but those from the (address, port) pairs the gate admits. Anyone else's SYN is dropped: the connection never
  completes, no byte of it reaches TensorPipe;
* **the gate** (:class:`RpcGate`): a listener of this process on the address TensorPipe bound, published in the
  store in place of TensorPipe's own address. A caller and the gate prove to each other that they hold the token
  (HMAC-SHA256 of a key made from it over both nonces); the caller names the port it will connect from, the gate admits
  that (address, port) until the connection is established and answers where TensorPipe listens;
* **the dialers**: TensorPipe speaks to no gate, so a process's agent meets its peers through a view of the store
  (:class:`GateStore`) that answers each peer's address with a dialer of this process: a loopback listener that
  accepts this process's own sockets alone (looked up in /proc), passes the peer's gate for each connection and then
  copies bytes both ways. The copies are the whole cost (one per message, on the caller's side; measured in
  docs/running.md).

What it does not change: a peer that passed the gate is trusted as before (torch unpickles its messages, which can run
code); the job's store has no authentication (a token handed out through it, without HOSFL_JOB_TOKEN, is readable by
whoever reaches the store, and so is every address); the gate needs Linux (socket filters, /proc).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import hmac
import ipaddress
import logging
import os
import queue
import re
import secrets
import selectors
import socket
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import torch.distributed as dist

from hosfl_dist.errors import ProtocolError

logger = logging.getLogger(__name__)

MAGIC = b"hosfl-rpc-gate/1"
"""What a gate says first (with its nonce): a dialer that reads anything else has not reached a gate."""
NONCE_BYTES = 32
MAC_BYTES = 32
ADDRESS_BYTES = 64
"""Where TensorPipe listens, as the gate answers it: ``host:port`` in ASCII, padded with spaces."""
HANDSHAKE_S = 10.0
"""A caller that has not finished its handshake within this is dropped (half a handshake holds nothing longer)."""
MAX_HANDSHAKES = 16
"""Handshakes a gate runs at once; a connection beyond them is closed at once (the dialer tries again). Bounds the
threads and the admitted pairs (:data:`MAX_ADMITTED`) a flood of connections can make."""
MAX_ADMITTED = 16
"""Pairs the shield admits at once: the BPF program's jumps are 8 bits, which an IPv6 list of 16 stays within."""
CHUNK = 1 << 18
"""Bytes a pump moves per read."""
TRANSPORTS = ["uv"]
"""The TensorPipe transports the gate covers: uv alone. Any other (shm, ibv) has an address of its own, exchanged
inside TensorPipe's handshake, that a peer would reach without passing the gate."""
CHANNELS = frozenset({"basic", "cma"})
"""The channels that open no listener of their own ("basic" rides the transport's connections, "cma" reads the
peer's memory by its pid); "mpt_uv" listens on 16 ports of its own, which the gate does not cover."""
SCHEME = "hosfl-gate"
_ADDRESS_KEY = re.compile(r"(?:^|/)addrs/[^/]+$")  # TensorPipe's agent publishes its address at <prefix>/addrs/<name>
_SKF_NET_OFF = -0x100000  # classic BPF: offsets from the network header (the filter's data starts at the TCP header)


class GateError(ProtocolError):
    """The gate cannot protect this process's TensorPipe, or a peer's gate did not prove the job's token."""


# -- the shield ------------------------------------------------------------------------------------------------------
def filter_program(family: int, pairs: list[tuple[str, int]]) -> list[tuple[int, int, int, int]]:
    """A classic BPF program (code, jt, jf, k) that keeps a TCP segment only when its source address and port are one
    of ``pairs``; with no pairs it drops everything. A socket filter on TCP sees the segment from its TCP header on,
    the source address at :data:`_SKF_NET_OFF` + 12 (IPv4) or + 8 (IPv6)."""
    ld_h, ld_w, jeq, ret = 0x28, 0x20, 0x15, 0x06  # BPF_LD|BPF_H|BPF_ABS, BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K
    keep, drop = (ret, 0, 0, 0xFFFFFFFF), (ret, 0, 0, 0)
    if not pairs:
        return [drop]
    if len(pairs) > MAX_ADMITTED:
        raise GateError(f"the shield admits at most {MAX_ADMITTED} connections at once")
    words, start = (1, 12) if family == socket.AF_INET else (4, 8)
    block = 2 * words  # per pair: load and compare each 32-bit word of the address
    n = len(pairs)
    prog = [(ld_h, 0, 0, 0)]  # the TCP source port
    for i, (_, port) in enumerate(pairs):  # pair i's address check starts at 2 + n + i * block
        prog.append((jeq, n - i + i * block, 0, port))
    prog.append(drop)
    accept = 2 + n + n * block
    for ip, _ in pairs:
        packed = ipaddress.ip_address(ip).packed
        for w in range(words):
            here = len(prog)
            prog.append((ld_w, 0, 0, (_SKF_NET_OFF + start + 4 * w) & 0xFFFFFFFF))
            word = int.from_bytes(packed[4 * w : 4 * w + 4], "big")
            last = w == words - 1  # the last word matched: keep; any word not: drop
            prog.append((jeq, accept - here - 2 if last else 0, accept - here - 1, word))
    prog += [keep, drop]
    return prog


class Shield:
    """A socket filter on a listening socket (TensorPipe's, by descriptor) that admits the pairs it holds alone.

    The filter is copied into each connection the listener accepts, so replacing it (admitting or revoking a pair)
    changes only which connections can still be made."""

    def __init__(self, fd: int) -> None:
        self._sock = socket.socket(fileno=os.dup(fd))  # the same socket; TensorPipe's descriptor stays its own
        self._pairs: Counter[tuple[str, int]] = Counter()
        self._lock = threading.Lock()
        self._buffer: object = None
        self._apply()

    @property
    def family(self) -> int:
        return self._sock.family

    @contextlib.contextmanager
    def admitted(self, ip: str, port: int) -> Iterator[None]:
        """Admit connections from ``ip``:``port`` while the block runs."""
        with self._lock:
            self._pairs[(ip, port)] += 1
            try:
                self._apply()
            except BaseException:
                self._pairs[(ip, port)] -= 1
                raise
        try:
            yield
        finally:
            with self._lock:
                self._pairs[(ip, port)] -= 1
                self._pairs += Counter()  # drop pairs no one holds
                self._apply()

    def _apply(self) -> None:
        if self._sock.fileno() < 0:  # closed with its gate: nothing left to let in
            return
        prog = filter_program(self.family, sorted(self._pairs))
        code = b"".join(struct.pack("HBBI", *ins) for ins in prog)
        buffer = ctypes.create_string_buffer(code, len(code))
        fprog = struct.pack("HL", len(prog), ctypes.addressof(buffer))  # struct sock_fprog
        self._sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_ATTACH_FILTER", 26), fprog)
        self._buffer = buffer  # the kernel copied the program; kept until the next one anyway

    def close(self) -> None:
        self._sock.close()


# -- what /proc says about this process's sockets ------------------------------------------------------------------
def _tcp_table(family: int) -> Iterator[tuple[tuple[str, int], tuple[str, int], str, str]]:
    """(local, remote, state, inode) of every TCP socket of ``family`` in this network namespace."""
    path = "/proc/net/tcp" if family == socket.AF_INET else "/proc/net/tcp6"
    with open(path) as fh:
        lines = fh.read().splitlines()[1:]
    for line in lines:
        cols = line.split()
        if len(cols) > 9:
            yield _endpoint(family, cols[1]), _endpoint(family, cols[2]), cols[3], cols[9]


def _endpoint(family: int, text: str) -> tuple[str, int]:
    raw, port = text.split(":")
    words = bytes.fromhex(raw)  # 32-bit words in this host's byte order
    if sys.byteorder == "little":
        words = b"".join(words[i : i + 4][::-1] for i in range(0, len(words), 4))
    return socket.inet_ntop(family, words), int(port, 16)


def _own_inodes() -> set[str]:
    """The inodes of the sockets this process holds open."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                found.add(link[8:-1])
    return found


def _listening_fd(family: int, address: tuple[str, int]) -> int:
    """This process's descriptor of the socket listening on ``address`` (TensorPipe's, found by its port)."""
    inodes = {inode for local, _, state, inode in _tcp_table(family) if local == address and state == "0A"}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}")[8:-1] in inodes:
                return int(fd)
    raise GateError(f"cannot find TensorPipe's listener at {_join(*address)} among this process's sockets")


def _is_own(conn: socket.socket) -> bool:
    """Whether the other end of ``conn``, a loopback connection, is a socket of this process."""
    here, there = conn.getsockname()[:2], conn.getpeername()[:2]
    for local, remote, _, inode in _tcp_table(conn.family):
        if local == there and remote == here:
            return inode in _own_inodes()
    return False


def _connections_to(family: int, address: tuple[str, int]) -> list[tuple[str, int]]:
    """The remote ends of the live connections made to ``address`` (established, half-open or closed by the other end;
    not a TIME_WAIT left by an earlier socket of the same port)."""
    live = {"01", "03", "08"}  # ESTABLISHED, SYN_RECV, CLOSE_WAIT
    return [remote for local, remote, state, _ in _tcp_table(family) if local == address and state in live]


def _accepted(family: int, address: tuple[str, int], remote: tuple[str, int]) -> bool:
    """Whether the listener at ``address`` made the connection from ``remote`` (established, or closed since; not
    still in SYN_RECV), so that the filter it was made under is the connection's own."""
    return any(local == address and rem == remote and state != "03" for local, rem, state, _ in _tcp_table(family))


# -- the handshake -------------------------------------------------------------------------------------------------
def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError(f"the connection closed after {len(out)} of {n} bytes")
        out += got
    return bytes(out)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port), the host an IP address."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    ipaddress.ip_address(host)
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not an address: {text!r}")
    return host, int(port)


def _parse_url(text: str, scheme: str) -> tuple[str, int]:
    head, sep, rest = text.partition("://")
    try:
        if head != scheme or not sep:
            raise ValueError
        return _split(rest)
    except ValueError:
        raise GateError(f"a peer published {text[:80]!r} where a {scheme}:// address belongs: every process of the "
                        "job must run the same hosfl_dist (one that passes the RPC gate)") from None  # fmt: skip


def dial(key: bytes, gate: tuple[str, int]) -> tuple[socket.socket, str]:
    """Pass the gate at ``gate``: a socket connected to the TensorPipe listener behind it from a port the gate admitted,
    and that listener's address as TensorPipe writes it. Raises :class:`GateError` where the other end does not prove
    the token, OSError where it cannot be reached."""
    with socket.create_connection(gate, timeout=HANDSHAKE_S) as ctl:
        hello = _recv_exactly(ctl, len(MAGIC) + NONCE_BYTES)
        if not hmac.compare_digest(hello[: len(MAGIC)], MAGIC):
            raise GateError(f"{_join(*gate)} is not an RPC gate")
        theirs = hello[len(MAGIC) :]
        data = socket.socket(ctl.family, socket.SOCK_STREAM)
        try:
            data.bind((ctl.getsockname()[0], 0, *ctl.getsockname()[2:]))  # the address the gate sees us from
            port = data.getsockname()[1].to_bytes(2, "big")
            nonce = secrets.token_bytes(NONCE_BYTES)
            ctl.sendall(nonce + port + _mac(key, b"dial", theirs, nonce, port))
            reply = _recv_exactly(ctl, MAC_BYTES + ADDRESS_BYTES)
            where = reply[MAC_BYTES:]
            if not hmac.compare_digest(reply[:MAC_BYTES], _mac(key, b"gate", nonce, theirs, port, where)):
                raise GateError(f"the RPC gate at {_join(*gate)} did not prove this job's token")
            target = where.decode("ascii").strip()
            data.settimeout(HANDSHAKE_S)
            data.connect(_split(target))
            data.settimeout(None)
            data.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return data, target
        except BaseException:
            data.close()
            raise


# -- TensorPipe's handshake, as far as the dialers must read it -----------------------------------------------------
# Each connection of a pipe starts with a frame from the connecting side: a Packet (libnop: Variant 0xb8, index 0 for
# SpontaneousConnection, the pipe's first connection; 1 for RequestedConnection, each later one). On the first
# connection the listening side answers with a BrochureAnswer (Structure 0xb9, its member count, then String 0xbd
# "uv" and String 0xbd <the listener's address>), and the connecting side opens the pipe's other connections to that
# address: a dialer puts its own there, so that they pass the gate too (tensorpipe/core/nop_types.h, pipe_impl.cc).
_FIRST_CONNECTION = b"\xb8\x00"
_MAX_FRAME = 1 << 20


def _frame(sock: socket.socket) -> bytes:
    """One length-prefixed frame of TensorPipe's (8 bytes little-endian, then the payload), prefix included."""
    head = _recv_exactly(sock, 8)
    n = int.from_bytes(head, "little")
    if n > _MAX_FRAME:
        raise GateError(f"a TensorPipe handshake frame of {n} bytes")
    return head + _recv_exactly(sock, n)


def _readdress(frame: bytes, listener: str, dialer: str) -> bytes:
    """The BrochureAnswer ``frame`` with the listener's address replaced by the dialer's."""
    body = frame[8:]
    old, new = listener.encode("ascii"), dialer.encode("ascii")
    at = 2 + 4  # Structure, member count; String "uv" (0xbd, 2, "uv")
    if not (body[:1] == b"\xb9" and body[2:at] == b"\xbd\x02uv" and body[at : at + 2 + len(old)] ==
            b"\xbd" + bytes([len(old)]) + old) or len(new) > 127:  # fmt: skip
        raise GateError("TensorPipe's brochure answer is not the one the RPC gate knows: this torch's TensorPipe "
                        "would open its other connections around the gate")  # fmt: skip
    body = body[:at] + b"\xbd" + bytes([len(new)]) + new + body[at + 2 + len(old) :]
    return len(body).to_bytes(8, "little") + body


def _splice(a: socket.socket, b: socket.socket, first: Callable[[socket.socket], bytes] | None = None) -> None:
    """Copy bytes both ways between ``a`` and ``b`` on two threads; both are closed when both directions end.
    ``first``: what to send ``a`` in place of what it reads first from ``b``."""
    left = [2]
    lock = threading.Lock()

    def pump(src: socket.socket, dst: socket.socket) -> None:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        try:
            if first is not None and src is b:
                dst.sendall(first(src))
            while n := src.recv_into(buf):
                dst.sendall(view[:n])
            dst.shutdown(socket.SHUT_WR)
        except (OSError, GateError) as exc:  # a reset or a closed end: end both directions
            if isinstance(exc, GateError):
                logger.error(f"RPC gate: {exc}")
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        finally:
            with lock:
                left[0] -= 1
                last = not left[0]
            if last:
                a.close()
                b.close()

    for src, dst in ((a, b), (b, a)):
        threading.Thread(target=pump, args=(src, dst), name="hosfl-gate-pump", daemon=True).start()


class _Refusals:
    """Counts refused connections and logs the first few, then one line per power of ten (junk floods no log)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def note(self, what: str) -> None:
        with self._lock:
            self.count += 1
            n = self.count
        if n <= 3 or str(n).strip("0") == "1":
            logger.warning(f"RPC gate: refused {what} ({n} refused so far)")


# -- the gate ------------------------------------------------------------------------------------------------------
class RpcGate:
    """This process's gate, its shield over TensorPipe's listener and its dialers to the peers' gates (one thread for
    every listener; a thread per handshake, two per carried connection)."""

    def __init__(self, token: str, timeout_s: float) -> None:
        if not sys.platform.startswith("linux"):
            raise GateError("the RPC gate needs Linux (socket filters and /proc) to keep TensorPipe's port closed")
        self.key = _mac(token.encode(), b"hosfl rpc gate")
        self.connect_s = max(HANDSHAKE_S, min(timeout_s, 60.0))
        self.refusals = _Refusals()
        self.target: tuple[str, int] | None = None
        self.address: tuple[str, int] | None = None
        self._shield: Shield | None = None
        self._dialers: dict[tuple[str, int], socket.socket] = {}
        self._views: list[GateStore] = []
        self._listeners: dict[int, tuple[socket.socket, str]] = {}
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._lock = threading.Lock()
        self._added: queue.SimpleQueue[socket.socket] = queue.SimpleQueue()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="hosfl-gate", daemon=True)
        self._thread.start()

    def view(self, store: dist.Store) -> GateStore:
        """``store`` as this process's RPC agent is to see it (:class:`GateStore`). The agent's options must name the
        transports and channels the gate covers alone (:data:`TRANSPORTS`, :data:`CHANNELS`). The gate keeps it (and
        so ``store``) alive: the agent's reference, from C++, does not keep a store written in Python alive."""
        view = GateStore(store, self)
        self._views.append(view)
        return view

    # what the store view asks
    def publish(self, url: str) -> str:
        """Shield the TensorPipe listener at ``url`` (uv://host:port) and open the gate beside it; the gate's URL."""
        host, port = _parse_url(url, "uv")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with self._lock:
            if self.target is None:
                self._shield = Shield(_listening_fd(family, (host, port)))  # from here on it drops everything
                early = _connections_to(family, (host, port))
                if early:  # made between TensorPipe's listen and the shield: nothing is sure of it any more
                    raise GateError(f"{len(early)} connection(s) reached TensorPipe's listener at {_join(host, port)} "
                                    f"before the RPC gate shielded it (from {_join(*early[0])})")  # fmt: skip
                listener = socket.create_server((host, 0), family=family, backlog=128)
                self.target, self.address = (host, port), listener.getsockname()[:2]
                self._add(listener, "gate")
            elif self.target != (host, port):
                raise GateError("a second RPC agent in one process: the RPC gate serves one")
        return f"{SCHEME}://{_join(*self.address)}"

    def dialer(self, published: str) -> str:
        """A TensorPipe URL of this process that leads to the gate ``published`` (a peer's, or this process's)."""
        gate = _parse_url(published, SCHEME)
        with self._lock:
            listener = self._dialers.get(gate)
            if listener is None:
                listener = socket.create_server(("127.0.0.1", 0), backlog=128)
                self._dialers[gate] = listener
                self._add(listener, f"{SCHEME}://{_join(*gate)}")
        return f"uv://{_join(*listener.getsockname()[:2])}"

    def close(self) -> None:
        """Close every listener of the gate (connections carried so far end with their TensorPipe pipes)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        for sock, _ in self._listeners.values():
            sock.close()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        if self._shield is not None:
            self._shield.close()

    # the listeners' thread
    def _add(self, listener: socket.socket, what: str) -> None:
        self._listeners[listener.fileno()] = (listener, what)
        self._added.put(listener)
        self._wake_w.send(b"+")

    def _loop(self) -> None:
        while True:
            for key, _ in self._selector.select():
                if key.fileobj is self._wake_r:
                    if b"x" in self._wake_r.recv(64):
                        return
                    while not self._added.empty():
                        self._selector.register(self._added.get(), selectors.EVENT_READ)
                    continue
                listener, what = self._listeners[key.fd]
                try:
                    conn, peer = listener.accept()
                except OSError:
                    continue
                target = self._admit if what == "gate" else self._carry
                if what == "gate" and not self._handshakes.acquire(blocking=False):
                    conn.close()
                    self.refusals.note(f"a connection from {_join(*peer[:2])}: {MAX_HANDSHAKES} handshakes at once")
                    continue
                args = (conn, peer[:2], what)
                threading.Thread(target=target, args=args, name="hosfl-gate-conn", daemon=True).start()

    def _admit(self, conn: socket.socket, peer: tuple[str, int], _: str) -> None:
        """The gate's side of a handshake: a caller that proves the token may connect to TensorPipe from the port it
        names, until that connection is established."""
        try:
            with conn:
                conn.settimeout(HANDSHAKE_S)
                nonce = secrets.token_bytes(NONCE_BYTES)
                conn.sendall(MAGIC + nonce)
                theirs, port, mac = (lambda m: (m[:NONCE_BYTES], m[NONCE_BYTES:][:2], m[NONCE_BYTES + 2 :]))(
                    _recv_exactly(conn, NONCE_BYTES + 2 + MAC_BYTES)
                )
                if not hmac.compare_digest(mac, _mac(self.key, b"dial", nonce, theirs, port)):
                    self.refusals.note(f"a connection from {_join(*peer)}: it did not prove this job's token")
                    return
                assert self._shield is not None and self.target is not None
                pair = (peer[0], int.from_bytes(port, "big"))
                with self._shield.admitted(*pair):
                    where = _join(*self.target).encode("ascii").ljust(ADDRESS_BYTES)
                    conn.sendall(_mac(self.key, b"gate", theirs, nonce, port, where) + where)
                    with contextlib.suppress(OSError):
                        conn.recv(1)  # the caller closes once it has connected (or gives up)
                    deadline = time.monotonic() + HANDSHAKE_S
                    while not _accepted(self._shield.family, self.target, pair) and time.monotonic() < deadline:
                        time.sleep(0.002)
        except (OSError, GateError) as exc:
            self.refusals.note(f"a connection from {_join(*peer)}: {exc}")
        finally:
            self._handshakes.release()

    def _carry(self, conn: socket.socket, peer: tuple[str, int], what: str) -> None:
        """A dialer's side: this process's TensorPipe connected; pass the peer's gate, then copy bytes both ways (on
        a pipe's first connection, the peer's brochure answer readdressed to this dialer)."""
        data = None
        try:
            if not _is_own(conn):
                self.refusals.note(f"a connection from {_join(*peer)} to a dialer: it is not this process's")
                return
            data, listener = self._pass(_parse_url(what, SCHEME))
            if data is None:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self.connect_s)
            packet = _frame(conn)
            conn.settimeout(None)
            data.sendall(packet)
            mine = _join(*conn.getsockname()[:2])
            first = packet[8:10] == _FIRST_CONNECTION  # the pipe's first connection: readdress its brochure answer
            _splice(conn, data, (lambda src: _readdress(_frame(src), listener, mine)) if first else None)
            conn = data = None  # the pumps hold them now
        except (OSError, GateError) as exc:
            logger.warning(f"RPC gate: a connection of this process's TensorPipe to {what} failed: {exc}")
        finally:
            for sock in (conn, data):
                if sock is not None:
                    sock.close()

    def _pass(self, gate: tuple[str, int]) -> tuple[socket.socket | None, str]:
        """:func:`dial` ``gate``, again while it cannot be reached (busy, or not listening yet) within the bound."""
        deadline = time.monotonic() + self.connect_s
        pause = 0.05
        while True:
            try:
                return dial(self.key, gate)
            except GateError as exc:
                logger.error(f"RPC gate: {exc}")
                return None, ""
            except OSError as exc:
                if time.monotonic() + pause > deadline:
                    logger.warning(f"RPC gate: cannot pass the gate at {_join(*gate)} within {self.connect_s:g} s: "
                                   f"{exc}")  # fmt: skip
                    return None, ""
                time.sleep(pause)
                pause = min(2 * pause, 1.0)


class GateStore(dist.Store):
    """The store as a process's RPC agent sees it: its own TensorPipe address is published as its gate's, and a peer's
    address is answered with a dialer of this process to that peer's gate; every other key passes through."""

    def __init__(self, base: dist.Store, gate: RpcGate) -> None:
        super().__init__()
        self._base = base
        self._gate = gate

    def set(self, key: str, value: bytes | str) -> None:
        if _ADDRESS_KEY.search(key):
            value = self._gate.publish(_text(value))
        self._base.set(key, value)

    def get(self, key: str) -> bytes:
        value = self._base.get(key)
        if _ADDRESS_KEY.search(key):
            return self._gate.dialer(_text(value)).encode()
        return value

    def add(self, key: str, value: int) -> int:
        return self._base.add(key, value)

    def check(self, keys: list[str]) -> bool:
        return self._base.check(keys)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._base.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._base.delete_key(key)

    def num_keys(self) -> int:
        return self._base.num_keys()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def set_timeout(self, timeout) -> None:  # noqa: ANN001 - a datetime.timedelta, as the store's own
        self._base.set_timeout(timeout)

    def wait(self, keys: list[str], timeout=None) -> None:  # noqa: ANN001 - as the store's own
        if timeout is None:
            self._base.wait(keys)
        else:
            self._base.wait(keys, timeout)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


_OPEN: list[RpcGate] = []


def open_gate(token: str, timeout_s: float) -> RpcGate:
    """This process's gate (RPC is one agent per process), keyed by ``token``; one opened before is closed first."""
    close_gate()
    gate = RpcGate(token, timeout_s)
    _OPEN.append(gate)
    return gate


def close_gate() -> None:
    """Close this process's gate, if one is open (after RPC has shut down)."""
    while _OPEN:
        _OPEN.pop().close()
