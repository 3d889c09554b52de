"""How the server side executes a call: on one rank, or on a server group of S ranks (``server.ranks``).

:class:`ServerGroup` is the endpoint's executor (``ServerEndpoint(..., execute=group.execute)``) on rank 0 and the
follower on ranks 1..S-1. Every server rank holds the same server object around its FSDP2 shard of θs
(:mod:`hosfl_dist.runtime.fsdp`); rank 0 announces each call with its arguments to the others (:class:`Execute`),
which run the same call in the same order, so the server code is the same on every rank and FSDP's all-gathers and
reduce-scatters line up across the group. The server's forward/backward and step run through its
:class:`~hosfl_dist.runtime.server_compute.GroupCompute`, which gives each rank its share of a round's rows; a call
computed whole on every rank (the evaluation, the baselines' steps) averages S identical gradients: for S a power of
two, g/S summed S times is exactly g, so its results equal a 1-rank server bit for bit; for other S they differ by
float rounding (≤ a few ulp per step). Only rank 0's answer goes back to the client; a follower's error is rank 0's
too (every rank checks the same input the same way), reported by rank 0.

Rank 0 also announces the group's bookkeeping: a digest of the full θs, every rank's memory, a checkpoint's save,
verification or load, the end (:class:`Digest`, :class:`Memory`, :class:`Save`, :class:`Verify`, :class:`Load`,
:class:`Stop`). With one rank (no group) calls run directly.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from hosfl_dist.errors import HosflError
from hosfl_dist.evaluation.server import EvalServer
from hosfl_dist.runfolder.checkpoints import read_manifest
from hosfl_dist.runtime.control import Handler, handles
from hosfl_dist.runtime.fsdp import full_digest
from hosfl_dist.runtime.memory import process_memory
from hosfl_dist.transport.endpoint import ServerEndpoint
from hosfl_dist.transport.wire import declared_call

logger = logging.getLogger(__name__)


# -- rank 0 -> server ranks ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Execute:
    """Run a declared call with these arguments."""

    method: str
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Digest:
    """Take part in the digest of the full θs (a collective)."""


@dataclass(frozen=True)
class Memory:
    """Send this rank's memory entry to rank 0."""


@dataclass(frozen=True)
class Save:
    """Write this rank's shard of θs into the checkpoint after ``loop``."""

    loop: Any
    meta: dict[str, Any]


@dataclass(frozen=True)
class Verify:
    """Verify the files of the checkpoint at ``path`` this rank reads against the manifest rank 0 verified (its
    ``digest``: rank 0 alone checks the signature), and send the result to rank 0."""

    path: str
    digest: str | None = None


@dataclass(frozen=True)
class Load:
    """Load this rank's shard of θs from the checkpoint at ``path``."""

    path: str


@dataclass(frozen=True)
class Stop:
    """The run is over: stop following."""


class ServerGroup(Handler):
    """Executes the server side's declared calls on this server rank (see the module docstring).

    ``server`` is the algorithm's server, ``evaluator`` the evaluation server beside it; ``group`` the server ranks'
    process group (None: one rank); ``store`` the checkpoint store the bookkeeping announcements save and load with.
    """

    def __init__(
        self, server: Any, evaluator: Any = None, group: dist.ProcessGroup | None = None, store: Any = None
    ) -> None:
        self.server = server
        self.evaluator = evaluator
        self.targets = tuple(t for t in (server, evaluator) if t is not None)
        self.group = group
        self.store = store
        self.rank = dist.get_rank(group) if group is not None else 0
        self.size = dist.get_world_size(group) if group is not None else 1
        self._sharded = [m for m in server.model.modules() if isinstance(m, FSDPModule)] if group is not None else []
        """The group's FSDP modules, resharded after every call (see :meth:`_run`)."""

    # -- rank 0 ------------------------------------------------------------------------------------------------------
    def execute(self, method: str, kwargs: dict[str, Any]) -> Any:
        """Run one call (rank 0, the endpoint's executor), announced to the other ranks first."""
        if self.group is not None:
            inspect.signature(declared_call(self.targets, method)).bind(**kwargs)  # a call that cannot run is
            self._announce(Execute(method, kwargs))  # refused here, before the other ranks are asked to run it
        return self._run(method, kwargs)

    def digest(self) -> str:
        """SHA-256 of the full θs (a collective over the group)."""
        if self.group is None:
            return self.server.server_digest()
        self._announce(Digest())
        return full_digest(self.server.model)

    def memory(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every server rank's memory entry, rank 0's (``mine``) first."""
        if self.group is None:
            return [mine]
        self._announce(Memory())
        out: list[Any] = [None] * self.size
        dist.gather_object(mine, out, group=self.group, group_dst=0)
        return out

    def save(self, loop: Any, meta: dict[str, Any]) -> None:
        """Announce a checkpoint's save (the other ranks write their shards; rank 0 saves with its own store)."""
        if self.group is not None:
            self._announce(Save(loop, meta))

    def verify(self, path: str) -> list[str | None]:
        """Every server rank's verdict on the checkpoint at ``path`` (None: the files it reads are intact)."""
        mine = self.store.verify(path)
        if self.group is None:
            return [mine]
        self._announce(Verify(str(path), (read_manifest(Path(path)) or {}).get("digest") if mine is None else None))
        out: list[Any] = [None] * self.size
        dist.gather_object(mine, out, group=self.group, group_dst=0)
        return out

    def load(self, path: str) -> None:
        if self.group is not None:
            self._announce(Load(str(path)))

    def stop(self) -> None:
        if self.group is not None:
            self._announce(Stop())

    def _announce(self, msg: Any) -> None:
        dist.broadcast_object_list([msg], group=self.group, group_src=0)

    # -- ranks 1..S-1 --------------------------------------------------------------------------------------------------
    def follow(self) -> None:
        """Replay rank 0's announcements on this rank's shard until it says stop."""
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, group=self.group, group_src=0)
            if isinstance(box[0], Stop):
                return
            self.handle(box[0])

    @handles(Execute)
    def _on_execute(self, msg: Execute) -> None:
        try:
            self._run(msg.method, msg.kwargs)  # rank 0 answers
        except HosflError as exc:  # the same checks of the same input failed on rank 0 alike, which reports it;
            # anything else is this rank's own failure and ends it (and with it the job)
            logger.debug("server rank %d: %s refused as on rank 0: %s", self.rank, msg.method, exc)

    @handles(Digest)
    def _on_digest(self, msg: Digest) -> None:
        full_digest(self.server.model)

    @handles(Memory)
    def _on_memory(self, msg: Memory) -> None:
        entry = process_memory(dist.get_rank(), "server-shard", self.server.model)
        dist.gather_object(entry, None, group=self.group, group_dst=0)

    @handles(Save)
    def _on_save(self, msg: Save) -> None:  # DCP writes this rank's shard of θs; rank 0 writes the rest
        self.store.save(self.server, msg.loop, {}, msg.meta)

    @handles(Verify)
    def _on_verify(self, msg: Verify) -> None:
        problem = self.store.verify(msg.path, msg.digest) if msg.digest is not None else "rank 0 found it damaged"
        dist.gather_object(problem, None, group=self.group, group_dst=0)

    @handles(Load)
    def _on_load(self, msg: Load) -> None:
        self.store.load(self.server, msg.path)

    # -- every rank ----------------------------------------------------------------------------------------------------
    def _run(self, method: str, kwargs: dict[str, Any]) -> Any:
        try:
            return declared_call(self.targets, method)(**kwargs)
        finally:  # a forward with no backward (evaluation) would leave what server.reshard_after_forward=false keeps
            for module in self._sharded:  # gathered until the next training step (after a backward: a no-op)
                module.reshard()


def local_endpoint(server: Any, evaluator: Any = None) -> ServerEndpoint:
    """The server side of one process: ``server`` (and an evaluation server over its module, unless one is given)
    behind an endpoint (tests, the memory profiler, benchmarks)."""
    if evaluator is None:
        evaluator = EvalServer(server.model, server.task)
    return ServerEndpoint(server, None, evaluator)
