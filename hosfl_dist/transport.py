"""Transports: how a client worker reaches the server and its peer client workers.

The algorithm code calls ``transport.call("method", **kwargs)`` / ``call_async`` on the server and
``collective.all_reduce_sum(t)`` among client workers; it never knows whether the other side is in the same process
(this module) or behind ``torch.distributed.rpc`` and a process group (the distributed runtime). Every call is
counted by the categories that the server method declares with :func:`hosfl_dist.comm.wire`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.futures import Future

from hosfl_dist.comm import CommMeter, WireSpec, count_call, count_result


class Transport(Protocol):
    meter: CommMeter

    def call(self, method: str, **kwargs: Any) -> Any: ...

    def call_async(self, method: str, **kwargs: Any) -> Future: ...


class Collective(Protocol):
    """Reduction among the client workers of a run (θc never travels through it, only small vectors)."""

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor: ...

    @property
    def is_leader(self) -> bool: ...


def wire_spec(server: object, method: str) -> WireSpec:
    fn = getattr(type(server), method, None)
    spec = getattr(fn, "__wire__", None)
    if spec is None:
        raise AttributeError(f"{type(server).__name__}.{method} is not a server method declared with @wire")
    return spec


class InProcessTransport:
    """Direct calls into a server object living in the same process, counted like RPC payloads."""

    def __init__(self, server: object, meter: CommMeter) -> None:
        self.server = server
        self.meter = meter

    def call(self, method: str, **kwargs: Any) -> Any:
        return self.call_async(method, **kwargs).wait()

    def call_async(self, method: str, **kwargs: Any) -> Future:
        spec = wire_spec(self.server, method)
        count_call(self.meter, spec, kwargs)
        out = getattr(self.server, method)(**kwargs)
        fut = out if isinstance(out, Future) else _done(out)

        def counted(f: Future) -> Any:
            value = f.value()
            count_result(self.meter, spec, value)
            return value

        return fut.then(counted)


class LocalCollective:
    """A single client worker: the sum over workers is its own contribution."""

    is_leader = True

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut
