"""The in-process transport: calls into a server endpoint in the same process."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.futures import Future

from hosfl_dist.transport.endpoint import ServerEndpoint
from hosfl_dist.transport.wire import CommMeter, Exchange


class InProcessTransport:
    """Direct calls into the endpoint (the call runs at once unless the endpoint holds or gathers it)."""

    def __init__(self, endpoint: ServerEndpoint) -> None:
        self.endpoint = endpoint

    def call(self, method: str, **kwargs: Any) -> Any:
        return self.call_async(method, **kwargs).wait()

    def call_async(self, method: str, **kwargs: Any) -> Future:
        return self.endpoint.serve(method, kwargs)


class LocalCollective:
    """A single client worker: the sum over workers is its own contribution."""

    is_leader = True

    def __init__(self, meter: CommMeter) -> None:
        self.meter = meter

    def aggregate(
        self,
        exchange: Exchange,
        rows: torch.Tensor,
        mine: Mapping[int, int],
        fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        return count_exchange(self.meter, exchange, rows, mine, fn(rows))

    def coordinate(self, t: torch.Tensor) -> torch.Tensor:
        return t


def count_exchange(
    meter: CommMeter, exchange: Exchange, rows: torch.Tensor, mine: Mapping[int, int], result: torch.Tensor
) -> torch.Tensor:
    """Count each of this worker's contributions (rows ``mine``) and the aggregate it receives; return the aggregate."""
    for i in mine.values():
        exchange.count(meter, rows[i], result)
    return result
