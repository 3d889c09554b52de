"""How a client worker reaches the server and its peer workers, whatever runs where.

Algorithm code calls ``transport.call("method", **kwargs)`` (a blocking round trip), ``transport.call_async``
(returns a pending answer at once), ``transport.post`` or ``transport.prefetch`` (the worker's
:class:`~hosfl_dist.transport.client.ClientTransport`) on the server, and ``collective.aggregate(...)`` among client
workers. It never knows whether the other side is in the same process (:mod:`~hosfl_dist.transport.inprocess`),
behind ``torch.distributed.rpc`` and a process group (the torchrun runtime's :mod:`~hosfl_dist.runtime.rpc`), or
behind an emulated link (:mod:`~hosfl_dist.transport.link`). This package is the wire alone: nothing in it starts a
process group or an RPC agent. On the server side one :class:`~hosfl_dist.transport.endpoint.ServerEndpoint`
serves every transport; traffic and ordering rules come from the :mod:`~hosfl_dist.transport.wire` declarations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch.futures import Future

from hosfl_dist.transport.wire import Exchange


class Pending(Protocol):
    """An answer on its way: ``wait()`` returns it (or raises the server's error)."""

    def done(self) -> bool: ...

    def wait(self) -> Any: ...


class Transport(Protocol):
    def call(self, method: str, **kwargs: Any) -> Any:
        """A blocking round trip: the call's answer."""

    def call_async(self, method: str, **kwargs: Any) -> Pending:
        """Send the call and return at once."""


class Collective(Protocol):
    """Among the client workers of a run: aggregation (counted by its :class:`Exchange`) and loop coordination."""

    @property
    def is_leader(self) -> bool: ...

    def aggregate(
        self,
        exchange: Exchange,
        rows: torch.Tensor,
        mine: Mapping[int, int],
        fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """``fn`` of the sum over workers of ``rows`` (K, ...), where this worker filled the rows ``mine`` maps its
        contributing clients to (client id -> row) and left the others zero; each contribution and the aggregate it
        receives are counted by ``exchange``."""

    def coordinate(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over worker processes of a small control vector (loop control among the processes that host the
        clients, e.g. every client's step count: not traffic of the modelled system, reported under ``transport``)."""


def done(value: Any) -> Future:
    """A future that has ``value`` already."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


def failed(exc: BaseException) -> Future:
    fut: Future = Future()
    fut.set_exception(exc)
    return fut


def forward(src: Future, dst: Future, convert: Callable[[Any], Any] = lambda v: v) -> None:
    """Complete ``dst`` with ``convert`` of ``src``'s value, or with its error (not ``then``: that would wrap the
    error of a failed round in a callback error)."""
    try:
        dst.set_result(convert(src.value()))
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on dst
        dst.set_exception(exc)


def chained(src: Future, convert: Callable[[Any], Any]) -> Future:
    """A future of ``convert(src.value())`` that carries ``src``'s error unchanged."""
    out: Future = Future()
    src.add_done_callback(lambda f: forward(f, out, convert))
    return out
