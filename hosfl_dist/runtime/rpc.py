"""The torchrun runtime's plumbing: client worker -> server over ``torch.distributed.rpc``, worker <-> worker over a
process group, the RPC entry points on rank 0 with the job's token, and the run's control messages.

The wire (what crosses and in which order: :mod:`hosfl_dist.transport`) is what algorithms see; this module is how
the torchrun runtime carries it between processes.

:class:`RPCTransport` is the RPC twin of :class:`~hosfl_dist.transport.inprocess.InProcessTransport`: on rank 0 the
call reaches the same :class:`~hosfl_dist.transport.endpoint.ServerEndpoint`, so both runtimes obey the same ordering
rules, and the worker's :class:`~hosfl_dist.transport.metered.MeteredTransport` counts the same bytes. Tensors are
staged to CPU before they cross (TensorPipe needs device maps for CUDA tensors; the server moves them to its device
itself), and views are compacted so that the bytes on the wire are the bytes counted.

Every entry point on rank 0 takes the job's token first (:func:`expect_token`; made by
:func:`~hosfl_dist.runtime.process.groups.job_token`) and refuses a caller without it before it touches the server.
It stops a process of another job, or of an earlier attempt of this one, from driving this job's server by mistake.
A caller without the token does not reach RPC at all (the RPC gate, :mod:`hosfl_dist.runtime.process.gate`); one
with it is trusted: torch unpickles a message (which can run code) before any entry point sees the token.

:class:`ProcessGroupCollective` sums among client workers. Both keep :class:`TransportStats` (calls, waits and the
time blocked in the transport), which the benchmark reads against the transport's floor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.futures import Future

from hosfl_dist.errors import ProtocolError
from hosfl_dist.transport import chained, done, failed, forward
from hosfl_dist.transport.endpoint import ServerEndpoint
from hosfl_dist.transport.inprocess import count_exchange
from hosfl_dist.transport.wire import CATEGORIES, CommMeter, Exchange

SERVER_NAME = "server"
"""RPC name of rank 0, the server front."""

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TransportStats:
    """What a client worker sent and how long it was blocked in the transport."""

    rpc_calls: int = 0
    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    """Calls sent, per server method."""
    blocked: dict[str, int] = dataclasses.field(default_factory=dict)
    """Waits on an answer that had not arrived yet, per method: the round trips on the worker's critical path."""
    blocked_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds spent in those waits, per method."""
    rpc_wait_s: float = 0.0
    """Blocked in a synchronous call or in ``wait()`` on an async one (includes the server's compute)."""
    allreduce_calls: int = 0
    allreduce_bytes: int = 0
    """Bytes of the buffers this worker contributed to all_reduce (the K×P scalar matrix per round)."""
    allreduce_s: float = 0.0
    """Blocked in all_reduce (includes waiting for the slowest worker)."""

    def copy(self) -> TransportStats:
        return dataclasses.replace(
            self, calls=dict(self.calls), blocked=dict(self.blocked), blocked_s=dict(self.blocked_s)
        )

    def add_delta(self, after: TransportStats, before: TransportStats) -> None:
        for f in dataclasses.fields(self):
            mine, a, b = getattr(self, f.name), getattr(after, f.name), getattr(before, f.name)
            if isinstance(mine, dict):
                for k in a:
                    mine[k] = mine.get(k, 0) + a[k] - b.get(k, 0)
            else:
                setattr(self, f.name, mine + a - b)

    def as_dict(self) -> dict[str, Any]:
        out = {k: round(v, 6) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}
        out["blocked_s"] = {k: round(v, 6) for k, v in self.blocked_s.items()}
        return out


class _TimedFuture(Future):
    """A future whose ``wait()`` is added to the worker's blocked time (and counted when it really blocks)."""

    def __init__(self, method: str, stats: TransportStats, lock: threading.Lock) -> None:
        super().__init__()
        self._method, self._stats, self._lock = method, stats, lock

    def wait(self) -> Any:
        start, ready = time.perf_counter(), self.done()
        try:
            return super().wait()
        finally:
            waited = time.perf_counter() - start
            with self._lock:
                self._stats.rpc_wait_s += waited
                if not ready:
                    stats, method = self._stats, self._method
                    stats.blocked[method] = stats.blocked.get(method, 0) + 1
                    stats.blocked_s[method] = stats.blocked_s.get(method, 0.0) + waited


def raised(answer: Any) -> Any:
    """An RPC's answer, or its error raised. A future the server failed (``set_exception``) reaches the caller as
    the error object itself: torch sends a Python future's value, and the error is only that value plus a flag the
    server's side of the future keeps."""
    if isinstance(answer, BaseException):
        raise answer
    return answer


INLINE_BYTES = 1 << 12
"""Tensors up to this size cross inside the message's pickle instead of as TensorPipe payloads. Each payload is a
channel operation of its own: on loopback with the product's transports (uv + cma) an answer of 12 tiny tensors (a
4-client ``sync``) took markedly longer a round trip than the same numbers inline (measured in
results/bench/changes.md#round_messages)."""


class Inline:
    """A small CPU tensor carried in the message itself (:data:`INLINE_BYTES`); :func:`from_wire` makes it a tensor
    again, with its dtype, shape and bytes."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], data: bytes) -> None:
        self.dtype, self.shape, self.data = dtype, shape, data

    @classmethod
    def of(cls, t: torch.Tensor) -> Inline:
        """``t`` (CPU) as the bytes of its elements (a view's, not its storage's)."""
        return cls(t.dtype, tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    def tensor(self) -> torch.Tensor:
        if not self.data:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8).view(self.dtype).reshape(self.shape)

    def __reduce__(self) -> tuple:
        return (Inline, (self.dtype, self.shape, self.data))


def to_wire(obj: Any) -> Any:
    """A copy of ``obj`` safe to send: tensors on CPU, detached and compact (a view would ship its whole storage);
    those of at most :data:`INLINE_BYTES` as :class:`Inline` (the receiver's :func:`from_wire` restores them)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.numel() * t.element_size() <= INLINE_BYTES and t.layout == torch.strided and not t.is_complex():
            return Inline.of(t)  # its own elements' bytes, whatever storage it views
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            return t.clone(memory_format=torch.contiguous_format)
        return t
    if isinstance(obj, Mapping):
        return {k: to_wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_wire(v) for v in obj)
    return obj


def from_wire(obj: Any) -> Any:
    """What :func:`to_wire` sent, as it was: :class:`Inline` tensors made tensors again."""
    if isinstance(obj, Inline):
        return obj.tensor()
    if isinstance(obj, dict):
        return {k: from_wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_wire(v) for v in obj)
    return obj


def received(answer: Any) -> Any:
    """An RPC's answer as it was sent (:func:`from_wire`), or its error raised (:func:`raised`)."""
    return from_wire(raised(answer))


class RPCTransport:
    """Calls into the server front on rank 0 through the RRef it published, each with the job's ``token``."""

    def __init__(self, front: rpc.RRef, timeout_s: float, stats: TransportStats, token: str) -> None:
        self.front = front
        self.timeout_s = timeout_s
        self.stats = stats
        self._token = token
        self._lock = threading.Lock()

    def call(self, method: str, **kwargs: Any) -> Any:
        return self.call_async(method, **kwargs).wait()

    def call_async(self, method: str, **kwargs: Any) -> Future:
        args = (self._token, self.front, method, to_wire(kwargs))
        sent = rpc.rpc_async(SERVER_NAME, serve, args=args, timeout=self.timeout_s)
        out = _TimedFuture(method, self.stats, self._lock)
        with self._lock:
            self.stats.rpc_calls += 1
            self.stats.calls[method] = self.stats.calls.get(method, 0) + 1

        sent.add_done_callback(lambda f: forward(f, out, received))
        return out

    def call_many(self, method: str, calls: Sequence[dict[str, Any]]) -> list[Future]:
        """Several calls of ``method`` in one RPC (:meth:`call_batch`)."""
        return self.call_batch([(method, kwargs) for kwargs in calls])

    def call_batch(self, calls: Sequence[tuple[str, dict[str, Any]]]) -> list[Future]:
        """Several (method, keyword arguments) calls in one RPC (:func:`serve_batch`): the server serves each as if it
        came alone, in this order, and answers them together; each call's future gets its own answer or error."""
        if len(calls) == 1:
            return [self.call_async(calls[0][0], **calls[0][1])]
        args = (self._token, self.front, [(method, to_wire(kwargs)) for method, kwargs in calls])
        sent = rpc.rpc_async(SERVER_NAME, serve_batch, args=args, timeout=self.timeout_s)
        outs = [_TimedFuture(method, self.stats, self._lock) for method, _ in calls]
        with self._lock:
            self.stats.rpc_calls += 1
            for method in dict.fromkeys(method for method, _ in calls):  # each method once per message
                self.stats.calls[method] = self.stats.calls.get(method, 0) + 1

        def deliver(f: Future) -> None:
            try:
                answers = raised(f.value())  # the whole message failed: refused, timed out, the server gone
            except BaseException as exc:  # noqa: BLE001 - handed to every call of the message
                for out in outs:
                    out.set_exception(exc)
                return
            for out, answer in zip(outs, answers):
                forward(done(answer), out, received)

        sent.add_done_callback(deliver)
        return outs


class RPCControl:
    """The run's control messages (:mod:`hosfl_dist.runtime.control`) to the front on rank 0, one blocking call
    each, with the job's ``token``; never counted as traffic."""

    def __init__(self, front: rpc.RRef, timeout_s: float, token: str) -> None:
        self.front = front
        self.timeout_s = timeout_s
        self._token = token

    def send(self, msg: Any) -> Any:
        return received(rpc.rpc_sync(SERVER_NAME, handle, args=(self._token, self.front, msg), timeout=self.timeout_s))


class ProcessGroupCollective:
    """Sums among the client workers over their own process group (gloo on CPU, NCCL on GPU)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        is_leader: bool,
        device: torch.device,
        meter: CommMeter,
        stats: TransportStats,
    ) -> None:
        self.group = group
        self._leader = is_leader
        # NCCL reduces CUDA tensors only; gloo reduces CPU tensors.
        self.device = device if device.type == "cuda" else torch.device("cpu")
        self.meter = meter
        self.stats = stats

    @property
    def is_leader(self) -> bool:
        return self._leader

    def aggregate(
        self,
        exchange: Exchange,
        rows: torch.Tensor,
        mine: Mapping[int, int],
        fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        # Each row has one contributor and zeros elsewhere, so the sum is exact and does not depend on how the
        # clients are spread over workers.
        return count_exchange(self.meter, exchange, rows, mine, fn(self._sum(rows)))

    def coordinate(self, t: torch.Tensor) -> torch.Tensor:
        return self._sum(t)

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        buf = t.detach().to(self.device, copy=True)
        start = time.perf_counter()
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
        self.stats.allreduce_s += time.perf_counter() - start
        self.stats.allreduce_calls += 1
        self.stats.allreduce_bytes += buf.numel() * buf.element_size()
        return buf.to(t.device)

    # -- the runtime's coordination (:class:`~hosfl_dist.runtime.peers.GroupPeers`; not used by algorithms) -------
    def sum_counts(self, counts: Mapping[str, int]) -> dict[str, int]:
        """Per-category byte counters summed over workers (int64: exact), for metrics rows and the summary."""
        vec = torch.tensor([int(counts.get(c, 0)) for c in CATEGORIES], dtype=torch.int64, device=self.device)
        dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self.group)
        return dict(zip(CATEGORIES, vec.tolist()))

    def gather(self, obj: Any) -> list[Any]:
        """Every worker's ``obj``, in worker-rank order (small picklable values: digests, stats)."""
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        # an all_reduce rather than dist.barrier: it works the same on gloo and NCCL, without a device guess
        dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)


# ------------------------------------------------------------------------------------------------------------------
# RPC entry points, executed on rank 0. Each takes the job's token first and refuses a caller without it (a failed
# future: torch would print the traceback of a raised refusal on rank 0); they find the server front through the
# RRef the client holds.

_EXPECTED: dict[str, bytes] = {}
"""The job's token, once :func:`expect_token` has run (before RPC starts)."""


def expect_token(token: str) -> None:
    """Accept calls into this process's entry points only from callers that give ``token`` (every rank, before
    ``init_rpc``: nothing is served before it is set)."""
    _EXPECTED["token"] = token.encode()


_MEMBERS: list[Callable[[str], str | None]] = []
"""An elastic run's membership: a member's own token -> its name (None: not a member's)."""


def expect_members(resolve: Callable[[str], str | None]) -> None:
    """An elastic server: the run's token (in join.json) lets a worker join and nothing else; every other call must
    carry a member's own token, which ``resolve`` maps to the member that sends it."""
    _MEMBERS[:] = [resolve]


def authorize(token: object, entry: str, joining: bool = False) -> tuple[str | None, Future | None]:
    """(the caller: a member's name, or None for the job's token; a refusal, or None). Under an elastic membership
    the run's token is only good for joining (``joining``)."""
    given = token if isinstance(token, str) else ""
    if _MEMBERS and given:
        member = _MEMBERS[0](given)
        if member is not None:
            return member, None
        if not joining:
            return None, _refused(entry, "the caller is not a member of this run (join it first, or it was lost)")
    expected = _EXPECTED.get("token")
    if expected and given and hmac.compare_digest(given.encode(), expected):
        return None, None
    return None, _refused(entry, "the caller does not hold this job's token (a process of another job or of an "
                                 "earlier attempt, or HOSFL_JOB_TOKEN differs between nodes)")  # fmt: skip


def refusal(token: object, entry: str) -> Future | None:
    """None when ``token`` is the job's (compared in constant time) or a member's; else a failed future with a
    one-line error that names nothing secret, and a warning on this process. ``entry``: the entry point, for both
    messages."""
    return authorize(token, entry)[1]


def _refused(entry: str, why: str) -> Future:
    logger.warning(f"refused a call of {entry}: {why.split(' (')[0]}")
    return failed(ProtocolError(f"refused {entry}: {why}"))


class Front(Protocol):
    """What rank 0 publishes: the endpoint that serves the algorithm's calls, and the runtime's bookkeeping."""

    endpoint: ServerEndpoint

    def handle(self, msg: Any) -> Any: ...

    def fail(self, message: str) -> None: ...


_PUBLISHED: Future = Future()
"""Completes with the RRef of this process's server front once rank 0 has built it."""


def publish(front: Front) -> rpc.RRef:
    """Make ``front`` reachable: workers block in :func:`fetch_front` until this runs (rank 0 only)."""
    ref = rpc.RRef(front)
    _PUBLISHED.set_result(ref)
    return ref


@rpc.functions.async_execution
def _published_front(token: str) -> Future:
    return authorize(token, "fetch_front", joining=True)[1] or _PUBLISHED


def fetch_front(timeout_s: float, token: str) -> rpc.RRef:
    """The RRef of the server front, waiting (up to ``timeout_s``) until rank 0 has built the server."""
    return raised(rpc.rpc_sync(SERVER_NAME, _published_front, args=(token,), timeout=timeout_s))


@rpc.functions.async_execution
def serve(token: str, front: rpc.RRef, method: str, kwargs: dict[str, Any]) -> Future:
    """A @wire server method, answered with a future (a gathered ``submit`` completes when its round has run).

    The RPC thread only queues the call: it runs on the endpoint's server thread (one thread for every execution, see
    :class:`~hosfl_dist.transport.endpoint.ServerThread`), and the answer leaves from there when it is ready."""
    caller, refused = authorize(token, "serve")
    if refused is not None:
        return refused
    return chained(front.local_value().endpoint.enqueue(method, from_wire(kwargs), caller), to_wire)


_UNANSWERED = object()


@rpc.functions.async_execution
def serve_batch(token: str, front: rpc.RRef, calls: list[tuple[str, dict[str, Any]]]) -> Future:
    """Several calls of @wire methods, each queued on the server thread as :func:`serve` queues one, in order;
    answered together, once all have their answer, as a list of answers (an error in the place of a call that
    failed). A call that fails answers the message at once, the calls still pending with its error: their answers
    may wait on what the failure stops (a refused round end and the next round's syncs, held until that round closes,
    which waits for the worker told of its refusal), and whichever the worker waits on first names the cause."""
    caller, refused = authorize(token, "serve_batch")
    if refused is not None:
        return refused
    endpoint = front.local_value().endpoint
    if not isinstance(calls, list) or not all(isinstance(c, tuple) and len(c) == 2 for c in calls):
        return failed(ProtocolError("serve_batch: calls must be a list of (method, arguments)"))
    pending = [endpoint.enqueue(method, from_wire(kwargs), caller) for method, kwargs in calls]
    if not pending:
        return done([])
    out: Future = Future()
    answers: list[Any] = [_UNANSWERED] * len(pending)
    left, answered = [len(pending)], [False]
    lock = threading.Lock()

    def answer_of(fut: Future) -> Any:
        try:
            return to_wire(fut.value())
        except BaseException as exc:  # noqa: BLE001 - the caller's future of that call raises it
            return exc

    def arrived(i: int, fut: Future) -> None:  # not torch.futures.collect_all: it fails whole on one error
        answer = answer_of(fut)
        failure = answer if isinstance(answer, BaseException) else None
        with lock:
            if answered[0]:  # the message was answered at an earlier call's failure
                return
            answers[i] = answer
            left[0] -= 1
            if left[0] and failure is None:
                return
            answered[0] = True
        if failure is not None:  # the calls still pending (what they wait on may never come) raise its error
            for j, a in enumerate(answers):
                if a is _UNANSWERED:
                    answers[j] = answer_of(pending[j]) if pending[j].done() else failure
        out.set_result(list(answers))

    for i, fut in enumerate(pending):
        fut.add_done_callback(lambda f, i=i: arrived(i, f))
    return out


@rpc.functions.async_execution
def handle(token: str, front: rpc.RRef, msg: Any) -> Future:
    """A control message, handled by the front on the RPC thread that delivered it. A member's message names the
    member its token says (a ``member`` field is the server's to fill, never the sender's)."""
    caller, refused = authorize(token, "handle", joining=type(msg).__name__ == "Join")
    if refused is not None:
        return refused
    if caller is not None and dataclasses.is_dataclass(msg) and "member" in {f.name for f in dataclasses.fields(msg)}:
        msg = dataclasses.replace(msg, member=caller)
    try:
        answer = front.local_value().handle(msg)
    except Exception as exc:  # noqa: BLE001 - the caller's error (e.g. a Join that does not fit the run), one line
        return failed(exc)
    return chained(answer, to_wire) if isinstance(answer, Future) else done(to_wire(answer))


@rpc.functions.async_execution
def _note_failure(token: str, message: str) -> Future:
    refused = refusal(token, "notify_failure")
    if refused is None and _PUBLISHED.done():
        _PUBLISHED.value().local_value().fail(message)
    return refused or done(None)


def notify_failure(message: str, token: str, timeout_s: float = 5.0) -> None:
    """Tell the server front that this process failed (best effort: the server may be the one that is gone)."""
    with contextlib.suppress(Exception):  # the launcher stops the job anyway; this only improves summary.json
        rpc.rpc_sync(SERVER_NAME, _note_failure, args=(token, message), timeout=timeout_s)
