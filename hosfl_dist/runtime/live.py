"""A worker's side of live rounds: rounds decided at the server's round gate (:mod:`hosfl_dist.runtime.gate`).

:class:`LiveRounds` is what a worker's method opens and closes its rounds with when they are decided by who answers in
time (``server.round_timeout_s`` under torchrun; every elastic run): the clients a round runs are the sampled ones
this worker serves (the gate counts the first uploads to arrive), and the round ends with the gate's ``close``,
which carries this worker's contributions to the method's client-side aggregate and is answered with the round as it
happened. :class:`LeaderRounds` is the elastic server's own: its worker serves no client, it opens each round when
the run's driver starts it, and its close waits for the gate's.

The contributions are counted as the fixed runtimes' collective counts them (per client: its row up, the aggregate
down), when they are sent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from hosfl_dist.algorithms.participation import Participation
from hosfl_dist.algorithms.rounds import Closed, Ready, RoundView
from hosfl_dist.transport.wire import CommMeter, Exchange


def participation_of(record: Mapping[str, Any]) -> Participation:
    """A :class:`Participation` from its record (a participation.jsonl line, as the gate answers it)."""
    return Participation(
        int(record["round"]),
        tuple(record["sampled"]),
        tuple(record["arrived"]),
        tuple(record["counted"]),
        tuple(record["late"]),
        {int(k): v for k, v in record["dropped"].items()},
        bool(record["skipped"]),
    )


def closed_of(t: int, answer: Mapping[str, Any]) -> Closed:
    """A close's answer as the method reads it; the run's end or a stop is an empty, skipped round (the driver reads
    ``extra``)."""
    if "participation" not in answer:
        return Closed(Participation(t, (), (), (), (), {}, True), None, True, 0, dict(answer))
    return Closed(participation_of(answer["participation"]), answer.get("aggregate"), True, int(answer["samples"]),
                  dict(answer.get("extra") or {}))  # fmt: skip


class LiveRounds:
    """A worker's live rounds. ``close``: the gate's declared call (a :class:`~hosfl_dist.transport.stub.Remote`
    of :class:`~hosfl_dist.runtime.gate.RoundService`); ``clients_of(t)``: this worker's clients of round t (the
    sampled ones it serves), or None where they are not known yet; ``counts``: the traffic counters an elastic
    worker reports with each close (None: its peers sum them, torchrun)."""

    live = True

    def __init__(
        self,
        close: Any,
        clients_of: Callable[[int], tuple[int, ...] | None],
        meter: CommMeter,
        is_leader: bool = False,
        counts: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self._close = close
        self.clients_of = clients_of
        self.meter = meter
        self._leader = is_leader
        self.counts = counts
        self.last: Closed | None = None
        """The last round's end as the gate answered it (what the runtime's driver reads of it: ``extra``)."""
        self.processed: int | None = None
        """The run's processed samples before the next round, where the worker cannot count them itself (an elastic
        worker that joined a run under way): the server's count, kept current from each close's answer."""

    @property
    def is_leader(self) -> bool:
        return self._leader

    def open(self, t: int) -> RoundView:
        return RoundView(t, self.clients_of(t) or (), live=True, processed=self.processed)

    def ahead(self, t: int) -> tuple[int, ...]:
        return self.clients_of(t) or ()

    def close(self, t: int, exchange: Exchange | None = None, rows: Mapping[int, Tensor] | None = None,
              fn: Callable[[Tensor], Tensor] | None = None, width: int = 0) -> Closed:  # fmt: skip
        return self.close_async(t, exchange, rows, fn, width).wait()

    def close_async(self, t: int, exchange: Exchange | None = None, rows: Mapping[int, Tensor] | None = None,
                    fn: Callable[[Tensor], Tensor] | None = None, width: int = 0) -> _Closing:  # fmt: skip
        rows = {int(m): v.detach().float() for m, v in (rows or {}).items()}
        if exchange is not None:  # per contribution: its row up, the aggregate (width floats) back
            for v in rows.values():
                exchange.count(self.meter, v, torch.empty(width, dtype=torch.float32))
        counts = self.counts() if self.counts is not None else None
        return _Closing(self, t, self._close.send(t=t, rows=rows, counts=counts))

    def _closed(self, t: int, answer: Mapping[str, Any]) -> Closed:
        closed = self.last = closed_of(t, answer)
        if self.processed is not None and closed.samples is not None:
            self.processed += closed.samples
        return closed


class _Closing:
    def __init__(self, rounds: LiveRounds, t: int, pending: Any) -> None:
        self.rounds, self.t, self.pending = rounds, t, pending
        self._value: Closed | None = None

    def done(self) -> bool:
        return self._value is not None

    def wait(self) -> Closed:
        if self._value is None:
            self._value = self.rounds._closed(self.t, self.pending.wait())
        return self._value


class LeaderRounds:
    """The elastic server's worker (no client: it evaluates and drives the run): it opens each round at the gate
    when the run's driver starts it, and its close is the gate's."""

    live = True
    is_leader = True

    def __init__(self, gate: Any, before_open: Callable[[int], None] = lambda t: None) -> None:
        self.gate = gate
        self.before_open = before_open
        """Called as round t is about to open (an elastic run: wait for workers where there are none)."""

    def open(self, t: int) -> RoundView:
        self.before_open(t)
        self.gate.open(t)
        return RoundView(t, (), live=True)

    def ahead(self, t: int) -> tuple[int, ...]:
        return ()

    def close(self, t: int, exchange: Exchange | None = None, rows: Mapping[int, Tensor] | None = None,
              fn: Callable[[Tensor], Tensor] | None = None, width: int = 0) -> Closed:  # fmt: skip
        return closed_of(t, self.gate.wait_closed(t))

    def close_async(self, *args: Any, **kwargs: Any) -> Ready:
        return Ready(self.close(*args, **kwargs))
