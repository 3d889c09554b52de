"""An emulated client-server link: wrappers that delay every message by its link time, in either runtime.

Each message pays the one-way delay of the App. C.1 link model (:func:`hosfl_dist.config.link_delay_s`):
``bytes · 8 / bandwidth + RTT/2``, on the uplink for the call's tensors (client → server) and on the downlink for
the result's tensors (server → client). Messages on one direction of one client's link are serialised in order: a
message starts when the previous one has left the sender (FIFO), so a burst pays its bytes back to back, as on a
real link. Per client means per ``client=`` argument of the call; calls without one (finish_round, evaluation)
use the worker's own link.

Delays are asynchronous, which is the point: ``call_async`` returns at once and the caller keeps computing while
its message is "in flight". A network thread fires each message at its arrival time; a delivery thread hands it to
the wrapped transport in arrival order (in-process: the server's method runs there, beside the client's work, as
on another machine; under torchrun: the RPC is sent then and the server computes in its own process); the result
travels back and completes the caller's future. The client <-> client aggregation (:class:`DelayedCollective`)
pays one round trip on each contributing client's link: its contribution up, the aggregate back. Nothing but the
timing changes: the server sees the same calls in the same order per client, so results are identical with and
without the link (tested).

    link = DelayedTransport(transport, cfg.comm); collective = DelayedCollective(collective, link)
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.futures import Future

from hosfl_dist.config import CommConfig, LinkConfig, link_delay_s
from hosfl_dist.core.seeding import Stream, stream_seed
from hosfl_dist.transport import Collective, Transport
from hosfl_dist.transport.wire import Exchange, payload_bytes

logger = logging.getLogger(__name__)


@dataclass
class LinkQueue:
    """One direction of one link: a message leaves the sender after the previous one did (FIFO serialisation)."""

    mbps: float
    rtt_ms: float
    free_at: float = 0.0
    """When the sender's side of the link is free again (the previous message's last bit has left)."""

    def arrival(self, now: float, nbytes: int) -> float:
        """Arrival time of a message of ``nbytes`` handed to the link at ``now``."""
        start = max(now, self.free_at)
        self.free_at = start + link_delay_s(nbytes, self.mbps, 0.0)
        return start + link_delay_s(nbytes, self.mbps, self.rtt_ms)


class _Scheduler:
    """Runs callbacks at given times, in (time, submission) order, on one thread that exits when idle."""

    def __init__(self, name: str, clock: Callable[[], float], idle_s: float = 0.5) -> None:
        self.name, self.clock, self.idle_s = name, clock, idle_s
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def at(self, due: float, fn: Callable[[], None]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the emulated link was closed")
            heapq.heappush(self._heap, (due, next(self._seq), fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        self._thread = None
                        return
                    if self._heap:
                        wait = self._heap[0][0] - self.clock()
                        if wait <= 0:
                            _, _, fn = heapq.heappop(self._heap)
                            break
                        self._cond.wait(wait)
                    elif not self._cond.wait(self.idle_s) and not self._heap:
                        self._thread = None  # idle: a later at() starts a new thread
                        return
            try:
                fn()
            except Exception:  # a callback must not take the link down with it
                logger.exception("%s: a callback failed", self.name)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


@dataclass
class LinkStats:
    """What the link carried and the delays it injected (seconds summed over messages, queueing included)."""

    messages: int = 0
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    uplink_s: float = 0.0
    downlink_s: float = 0.0
    by_method: dict[str, int] = field(default_factory=dict)
    late_s: float = 0.0
    """Summed lateness of deliveries and answers against their scheduled times (thread wake-up and GIL waits)."""
    trace: list[dict[str, Any]] | None = None
    """Per message (with ``DelayedTransport(trace=True)``): method, sent, arrive, served, done, back, answered."""


class DelayedTransport:
    """Wraps a transport (in-process or RPC) so that every call pays its link time, asynchronously."""

    def __init__(
        self,
        inner: Transport,
        link: LinkConfig,
        clock: Callable[[], float] = time.perf_counter,
        trace: bool = False,
        speed: Callable[[int], float] | None = None,
    ) -> None:
        self.inner = inner
        self.link = link
        self.speed = speed
        """Client m's link speed factor (``comm.speed_spread``: :func:`client_speed`); None: every link alike."""
        self.clock = clock
        self.stats = LinkStats(trace=[] if trace else None)
        self._lock = threading.Lock()
        self._up: dict[Any, LinkQueue] = {}
        self._down: dict[Any, LinkQueue] = {}
        self._network = _Scheduler("link-network", clock)
        self._server = _Scheduler("link-server", clock)

    def _queue(self, queues: dict[Any, LinkQueue], key: Any, mbps: float) -> LinkQueue:
        if key not in queues:
            factor = self.speed(key) if self.speed is not None and isinstance(key, int) else 1.0
            queues[key] = LinkQueue(mbps * factor, self.link.rtt_ms)
        return queues[key]

    def call(self, method: str, **kwargs: Any) -> Any:
        return self.call_async(method, **kwargs).wait()

    def round_trip_end(self, client: Any, up_bytes: int, down_bytes: int, now: float) -> float:
        """When an exchange of ``up_bytes`` sent at ``now`` by ``client`` and answered with ``down_bytes`` as soon as
        it arrived is back (both directions queue behind the client's earlier messages)."""
        with self._lock:
            arrive = self._queue(self._up, client, self.link.uplink_mbps).arrival(now, up_bytes)
            back = self._queue(self._down, client, self.link.downlink_mbps).arrival(arrive, down_bytes)
            self.stats.messages += 2
            self.stats.uplink_bytes += up_bytes
            self.stats.downlink_bytes += down_bytes
            self.stats.uplink_s += arrive - now
            self.stats.downlink_s += back - arrive
        return back

    def call_async(self, method: str, **kwargs: Any) -> Future:
        """Send the call now; the server runs it when it arrives; the future completes when the answer is back."""
        key = kwargs.get("client", "worker")
        nbytes = payload_bytes(kwargs)
        now = self.clock()
        with self._lock:
            arrive = self._queue(self._up, key, self.link.uplink_mbps).arrival(now, nbytes)
            self.stats.messages += 1
            self.stats.uplink_bytes += nbytes
            self.stats.uplink_s += arrive - now
            self.stats.by_method[method] = self.stats.by_method.get(method, 0) + 1
        out: Future = Future()
        rec: dict[str, Any] = {"method": method, "sent": now, "arrive": arrive}
        if self.stats.trace is not None:
            with self._lock:
                self.stats.trace.append(rec)

        def answered(value: Any) -> None:  # on the network thread, at the answer's arrival
            rec["answered"] = self.clock()
            with self._lock:
                self.stats.late_s += rec["answered"] - rec["back"]
            out.set_result(value)

        def answer(f: Future) -> None:
            try:
                value = f.value()
            except Exception as exc:  # noqa: BLE001 - the caller's wait() re-raises it
                out.set_exception(exc)
                return
            size = payload_bytes(value)
            sent = rec["done"] = self.clock()
            with self._lock:
                back = rec["back"] = self._queue(self._down, key, self.link.downlink_mbps).arrival(sent, size)
                self.stats.downlink_bytes += size
                self.stats.downlink_s += back - sent
            self._network.at(back, lambda: answered(value))

        def deliver() -> None:  # on the server thread, in arrival order
            rec["served"] = self.clock()
            with self._lock:
                self.stats.late_s += rec["served"] - arrive
            try:
                fut = self.inner.call_async(method, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the server refused the call: the caller sees why
                out.set_exception(exc)
                return
            fut.add_done_callback(answer)

        self._network.at(arrive, lambda: self._server.at(self.clock(), deliver))
        return out

    def summary(self) -> dict[str, Any]:
        """The emulated link's settings and what it carried (for summary.json's ``link``)."""
        with self._lock:
            st = self.stats
            return {
                **{k: getattr(self.link, k) for k in ("uplink_mbps", "downlink_mbps", "rtt_ms")},
                "messages": st.messages,
                "uplink_bytes": st.uplink_bytes,
                "downlink_bytes": st.downlink_bytes,
                "delay_uplink_s": round(st.uplink_s, 6),
                "delay_downlink_s": round(st.downlink_s, 6),
                "late_s": round(st.late_s, 6),
            }

    def close(self) -> None:
        """Stop the link's threads (they also stop by themselves when idle)."""
        self._network.close()
        self._server.close()


class DelayedCollective:
    """A collective whose aggregation pays one round trip on each contributing client's link (the P scalars up to
    the aggregation, v̄ back): the worker continues once the last of its clients has the aggregate."""

    def __init__(self, inner: Collective, link: DelayedTransport) -> None:
        self.inner = inner
        self.link = link

    @property
    def is_leader(self) -> bool:
        return self.inner.is_leader

    def aggregate(self, exchange: Exchange, rows: Any, mine: Mapping[int, int], fn: Callable[[Any], Any]) -> Any:
        sent = self.link.clock()
        result = self.inner.aggregate(exchange, rows, mine, fn)
        ends = [
            self.link.round_trip_end(m, payload_bytes(rows[i]), payload_bytes(result), sent) for m, i in mine.items()
        ]
        wait = max(ends, default=0.0) - self.link.clock()
        if wait > 0:
            time.sleep(wait)
        return result

    def coordinate(self, t: Any) -> Any:
        return self.inner.coordinate(t)


def describe_link(link: LinkConfig) -> str:
    """One line for the start of a run with ``comm.inject_delay=true``: the link every message now waits for."""
    return (
        f"emulated link (comm.inject_delay=true, App. C.1): per client uplink {link.uplink_mbps:g} Mb/s, downlink "
        f"{link.downlink_mbps:g} Mb/s, RTT {link.rtt_ms:g} ms; each message waits bytes*8/bandwidth + RTT/2, so "
        "round times include it (summary.json: link)"
    )


def describe_traffic(summary: Mapping[str, Any]) -> str:
    """One line for the end of a run: what the emulated link carried and the delay it injected (:meth:`summary`)."""
    return (
        f"emulated link carried {summary['messages']} messages: {summary['uplink_bytes'] / 2**20:.3g} MiB up "
        f"({summary['delay_uplink_s']:.3g} s of delay), {summary['downlink_bytes'] / 2**20:.3g} MiB down "
        f"({summary['delay_downlink_s']:.3g} s)"
    )


def client_speed(comm: CommConfig, seed: int, client: int) -> float:
    """Client ``client``'s link speed factor under ``comm.speed_spread``: exp(σ·z), z a standard normal drawn from
    (job.seed, client) (1 without a spread)."""
    if not comm.speed_spread:
        return 1.0
    u1 = (stream_seed(seed, Stream.LINK_SPEED, client, 0) + 1) / 2.0**63  # (0, 1]: Box-Muller's log never sees 0
    u2 = stream_seed(seed, Stream.LINK_SPEED, client, 1) / 2.0**63
    z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
    return math.exp(comm.speed_spread * z)
