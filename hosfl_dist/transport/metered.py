"""The counting layer every worker's transport goes through: bytes by category, from the wire declarations.

A call's arguments are counted when it is sent; its answer when the caller takes it (the first ``wait()``). Counting
at the taking, not at the arrival, keeps every metrics row deterministic when answers arrive ahead of use (HO-SFL
requests round t+1's sync while round t still runs): a row counts what the clients received by then, in every
runtime and under any timing.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from hosfl_dist.transport import Transport
from hosfl_dist.transport.client import send_batch, send_many
from hosfl_dist.transport.wire import CommMeter, Served, WireSpec, count_call, count_result, wire_spec


class Reply:
    """The answer to one call; ``wait()`` returns it (and counts it the first time)."""

    def __init__(self, fut: Any, spec: WireSpec, meter: CommMeter) -> None:
        self._fut, self._spec, self._meter = fut, spec, meter
        self._counted = False
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._fut.done()

    def wait(self) -> Any:
        value = self._fut.wait()
        with self._lock:
            if not self._counted:
                count_result(self._meter, self._spec, value)
                self._counted = True
        return value


class MeteredTransport:
    """Counts the traffic of the calls it passes to ``inner`` (in-process, RPC, or an emulated link around them)."""

    def __init__(self, inner: Transport, served: Served, meter: CommMeter) -> None:
        self.inner = inner
        self.served = served
        """The server's class (and the evaluation server's): where each call's traffic is declared."""
        self.meter = meter

    def call(self, method: str, **kwargs: Any) -> Any:
        return self.call_async(method, **kwargs).wait()

    def call_async(self, method: str, **kwargs: Any) -> Reply:
        return self.call_many(method, [kwargs])[0]

    def call_many(self, method: str, calls: Sequence[dict[str, Any]]) -> list[Reply]:
        """Several calls of ``method``, each counted as it would be alone (one message where ``inner`` can)."""
        spec = wire_spec(self.served, method)
        for kwargs in calls:
            count_call(self.meter, spec, kwargs)
        return [Reply(fut, spec, self.meter) for fut in send_many(self.inner, method, calls)]

    def call_batch(self, calls: Sequence[tuple[str, dict[str, Any]]]) -> list[Reply]:
        """Calls of several methods, each counted as it would be alone (one message where ``inner`` can)."""
        specs = [wire_spec(self.served, method) for method, _ in calls]
        for spec, (_, kwargs) in zip(specs, calls):
            count_call(self.meter, spec, kwargs)
        return [Reply(fut, spec, self.meter) for fut, spec in zip(send_batch(self.inner, calls), specs)]
