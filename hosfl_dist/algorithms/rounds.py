"""How a worker's round begins and ends, as the runtime hands it to the method: planned, or decided live.

Every method's ``run_round(t)`` reads the same way in every runtime:

    view = self.rounds.open(t)          which of my clients run round t (and whether it is skipped already)
    ... the method's client step, its calls to the server ...
    closed = self.rounds.close(t, ...)  round t as it happened: who counted and delivered, the exchange's mean

Two implementations:

- :class:`PlannedRounds` (here): the seeded plan every process computes alike (``RoundPlan``, with dropout and
  over-selection emulated, or a recorded participation replayed); a client-side aggregate is summed among the
  workers by their :class:`~hosfl_dist.transport.Collective` (one process, or a gloo/NCCL group) and the method
  closes the round itself (HO-SFL's leader posts ``finish_round``).
- ``LiveRounds`` (:mod:`hosfl_dist.runtime.live`): rounds decided by who answers in time at the server's round gate
  (``server.round_timeout_s``, over-selection by real arrival, workers that come and go): the worker runs the
  clients it serves, an upload may come back "late" (not this round: the batch is put back), and the aggregate is
  taken by the gate, which closes the round with the method's own closing call.

Nothing here touches a process group or a thread: a runtime hands the worker one of these, built from its parts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from hosfl_dist.algorithms.participation import AFTER_UPLOAD, Participation
from hosfl_dist.transport import Collective
from hosfl_dist.transport.wire import Exchange


@dataclass(frozen=True)
class RoundView:
    """Round t as a worker begins it."""

    t: int
    clients: tuple[int, ...]
    """This worker's clients that take part in round t, sorted: the counted ones of the plan, or, decided live, the
    sampled clients this worker serves (the gate counts the first uploads to arrive)."""
    skipped: bool = False
    """Known to be skipped before anything is sent (fewer planned uploads than ``server.min_clients``)."""
    dropping: frozenset[int] = frozenset()
    """Of ``clients``, those the plan drops after their upload (their round's end never arrives: emulated)."""
    live: bool = False
    """Decided at the server's gate: an upload may be answered ``{"late": True}`` (the client is not counted and its
    batch must be put back), and only :meth:`Rounds.close` tells who counted and delivered."""
    processed: int | None = None
    """Live rounds: the samples processed by every client before round t (the server's count); None: the worker's
    own count is the run's (planned rounds: every worker computes it alike)."""

    def delivers(self, client: int) -> bool:
        """Whether ``client`` sends what ends its round (HO-SFL's scalars, a baseline's θc_m)."""
        return client not in self.dropping


@dataclass(frozen=True)
class Closed:
    """Round t as it happened."""

    participation: Participation
    aggregate: Tensor | None = None
    """The exchange's result (HO-SFL: v̄ over the clients that delivered); None without an exchange or where nobody
    delivered (no client step)."""
    by_server: bool = False
    """The round was closed by the runtime's gate with the method's closing call (the method must not close it)."""
    samples: int | None = None
    """Live rounds: the samples the server stepped with in round t (None: the method counts them itself)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """What the runtime's driver reads of the answer (ownership, adoption, the end); not the method's."""

    @property
    def delivered(self) -> tuple[int, ...]:
        return self.participation.delivered

    @property
    def counted(self) -> tuple[int, ...]:
        return self.participation.counted


class Rounds(Protocol):
    """What a worker's round is opened and closed with (see the module docstring)."""

    @property
    def live(self) -> bool: ...

    @property
    def is_leader(self) -> bool: ...

    def open(self, t: int) -> RoundView: ...

    def ahead(self, t: int) -> tuple[int, ...]:
        """This worker's clients of round t as far as they are known before round t−1 has closed (what it prefetches
        for), a subset of what :meth:`open` will say."""

    def close(
        self,
        t: int,
        exchange: Exchange | None = None,
        rows: Mapping[int, Tensor] | None = None,
        fn: Callable[[Tensor], Tensor] | None = None,
        width: int = 0,
    ) -> Closed:
        """End round t: ``rows`` are this worker's clients' contributions to ``exchange`` (client -> (width,)), of
        which ``fn`` (e.g. the mean over clients) of the rows of those that delivered is the aggregate."""

    def close_async(
        self,
        t: int,
        exchange: Exchange | None = None,
        rows: Mapping[int, Tensor] | None = None,
        fn: Callable[[Tensor], Tensor] | None = None,
        width: int = 0,
    ) -> Any:
        """:meth:`close` sent now, its :class:`Closed` taken later with ``.wait()`` (so that it can leave in one
        message with calls made in the same ``together()`` block)."""


class PlannedRounds:
    """Rounds from the seeded (or recorded) plan, the aggregate summed among the workers by ``collective``."""

    live = False

    def __init__(self, plan: Any, collective: Collective, hosted: Sequence[int]) -> None:
        self.plan = plan
        """The run's :class:`~hosfl_dist.algorithms.base.RoundPlan`."""
        self.collective = collective
        self.hosted = set(hosted)

    @property
    def is_leader(self) -> bool:
        return self.collective.is_leader

    def open(self, t: int) -> RoundView:
        p = self.plan.round(t)
        mine = tuple(m for m in p.counted if m in self.hosted)
        dropping = frozenset(m for m in mine if p.dropped.get(m) == AFTER_UPLOAD)
        return RoundView(t, mine, p.skipped, dropping)

    def ahead(self, t: int) -> tuple[int, ...]:
        return self.open(t).clients

    def close(
        self,
        t: int,
        exchange: Exchange | None = None,
        rows: Mapping[int, Tensor] | None = None,
        fn: Callable[[Tensor], Tensor] | None = None,
        width: int = 0,
    ) -> Closed:
        p = self.plan.round(t)
        if exchange is None or not p.delivered:  # nobody's contribution arrives: every worker knows it, none is sent
            return Closed(p)
        rows = dict(rows or {})
        matrix = torch.zeros(len(p.counted), width, dtype=torch.float32)
        slot = {m: i for i, m in enumerate(p.counted)}
        mine = [m for m in p.counted if m in self.hosted]
        for m in mine:  # a counted client whose contribution does not arrive is a row of NaN (left out of fn)
            matrix[slot[m]] = rows[m] if m in rows else float("nan")
        counted = {m: slot[m] for m in mine if m in p.delivered}
        return Closed(p, self.collective.aggregate(exchange, matrix, counted, fn))

    def close_async(self, *args: Any, **kwargs: Any) -> Ready:
        return Ready(self.close(*args, **kwargs))


class Ready:
    """An answer that is here already."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def wait(self) -> Any:
        return self.value

