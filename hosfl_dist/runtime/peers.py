"""The client workers of a run, as the trainer sees them: the runtime's coordination among them (not traffic).

Algorithms aggregate through their :class:`~hosfl_dist.transport.Collective`; the trainer additionally agrees on
stopping, sums the traffic counters for a metrics row, gathers the end-of-run report, and lets the others wait for
something only the leader does (an evaluation, a checkpoint's save) through the job's store, with that thing's own
timeout rather than a collective's. In one process there is one worker and all of this is trivial
(:class:`LocalPeers`); under torchrun :class:`GroupPeers` does it over the client workers' process group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch


class Peers(Protocol):
    @property
    def is_leader(self) -> bool: ...

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any worker (every worker gets the same answer)."""

    def sum_counts(self, counts: Mapping[str, int]) -> dict[str, int]:
        """Per-category byte counters summed over the workers."""

    def gather(self, obj: Any) -> list[Any]:
        """Every worker's ``obj``, in worker-rank order."""

    def barrier(self) -> None: ...

    def post(self, key: str) -> None:
        """The leader: ``key`` is done (for the others' :meth:`wait_for`)."""

    def wait_for(self, key: str, timeout_s: float) -> None:
        """Wait until the leader posted ``key``, at most ``timeout_s`` (TimeoutError)."""


class LocalPeers:
    """One worker: it is the leader, and every agreement is its own."""

    is_leader = True

    def any(self, flag: bool) -> bool:
        return flag

    def sum_counts(self, counts: Mapping[str, int]) -> dict[str, int]:
        return dict(counts)

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass

    def post(self, key: str) -> None:
        pass

    def wait_for(self, key: str, timeout_s: float) -> None:
        pass


class GroupPeers:
    """The client workers of a torchrun job: their process group (``collective``) and the job's store (``dist``)."""

    def __init__(self, collective: Any, dist: Any) -> None:
        self.collective = collective
        self.dist = dist

    @property
    def is_leader(self) -> bool:
        return self.collective.is_leader

    def any(self, flag: bool) -> bool:
        return bool(self.collective.coordinate(torch.tensor([1 if flag else 0])).item())

    def sum_counts(self, counts: Mapping[str, int]) -> dict[str, int]:
        return self.collective.sum_counts(counts)

    def gather(self, obj: Any) -> list[Any]:
        return self.collective.gather(obj)

    def barrier(self) -> None:
        self.collective.barrier()

    def post(self, key: str) -> None:
        self.dist.post(f"hosfl/{key}")

    def wait_for(self, key: str, timeout_s: float) -> None:
        self.dist.wait_for(f"hosfl/{key}", timeout_s)
