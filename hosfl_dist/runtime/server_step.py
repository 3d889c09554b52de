"""How the server side executes a call: on one rank, or on a server group of S ranks (``server.ranks``).

:class:`ServerStep` is the endpoint's executor (``ServerEndpoint(..., execute=step.execute)``) on rank 0 and the
follower on ranks 1..S-1. Every server rank holds the same server object around its FSDP2 shard of θs
(:mod:`hosfl_dist.runtime.fsdp`); rank 0 announces each execution to the others (:class:`Execute`), which replay the
same executions in the same order, so FSDP's all-gathers and reduce-scatters line up across the group. Rank 0 also
announces the group's bookkeeping: a digest of the full θs, every rank's memory, a checkpoint's save, verification or
load, the end (:class:`Digest`, :class:`Memory`, :class:`Save`, :class:`Verify`, :class:`Load`, :class:`Stop`).

A call declared ``data_parallel`` (HO-SFL's ``submit``) is run here, not by the algorithm: on rank 0 the method
checks and admits the round's uploads (:class:`~hosfl_dist.algorithms.step.RoundWork`); the announcement carries the
round only; rank 0 scatters each rank its share of the rows (:func:`~hosfl_dist.algorithms.step.make_shares`), every
rank runs its share's forward/backward (:func:`~hosfl_dist.algorithms.step.run_share`), the λ rows and loss parts are
gathered back to rank 0, which settles the round (who the step is over) and broadcasts the decision; FSDP averaged the
ranks' gradients, so each rank multiplies its shard by S to get their sum (exact for S a power of two: gloo has no
pre-multiplied sum to set a divide factor of 1), and every rank steps. Other calls are announced with their arguments
and every rank computes the whole call; the reduction then averages S identical gradients: for S a power of two, g/S
summed S times is exactly g, so their results equal a 1-rank server bit for bit; for other S they differ by float
rounding (≤ a few ulp per step). With one rank (no group) the same path runs without the collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from hosfl_dist.algorithms.step import ShareResult, make_shares, merge_results, run_share
from hosfl_dist.evaluation.server import EvalServer
from hosfl_dist.measure.tracker import process_memory
from hosfl_dist.runtime.control import Handler, handles
from hosfl_dist.runtime.fsdp import full_digest
from hosfl_dist.transport.endpoint import ServerEndpoint
from hosfl_dist.transport.wire import declared_call, wire_spec


# -- rank 0 -> server ranks ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Execute:
    """Run a declared call (a data_parallel call: its round number only, the rows follow by scatter)."""

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
    """Verify the files of the checkpoint at ``path`` this rank reads, and send the result to rank 0."""

    path: str


@dataclass(frozen=True)
class Load:
    """Load this rank's shard of θs from the checkpoint at ``path``."""

    path: str


@dataclass(frozen=True)
class Stop:
    """The run is over: stop following."""


class ServerStep(Handler):
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
        self.served = tuple(type(t) for t in self.targets)
        self.group = group
        self.store = store
        self.rank = dist.get_rank(group) if group is not None else 0
        self.size = dist.get_world_size(group) if group is not None else 1
        self.micro_batch_tokens = server.cfg.server.micro_batch_tokens
        self._sharded = [m for m in server.model.modules() if isinstance(m, FSDPModule)] if group is not None else []
        """The group's FSDP modules, resharded after every call without a backward (see :meth:`_run`)."""

    @property
    def leads(self) -> bool:
        return self.rank == 0

    # -- rank 0 ------------------------------------------------------------------------------------------------------
    def execute(self, method: str, kwargs: dict[str, Any]) -> Any:
        """Run one call (rank 0, the endpoint's executor), announced to the other ranks first."""
        spec = wire_spec(self.served, method)
        if self.group is not None:
            self._announce(Execute(method, {"t": kwargs["t"]} if spec.data_parallel else kwargs))
        return self._run(method, spec.data_parallel, kwargs)

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
        self._announce(Verify(str(path)))
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
        self._run(msg.method, wire_spec(self.served, msg.method).data_parallel, msg.kwargs)  # rank 0 answers

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
        dist.gather_object(self.store.verify(msg.path), None, group=self.group, group_dst=0)

    @handles(Load)
    def _on_load(self, msg: Load) -> None:
        self.store.load(self.server, msg.path)

    # -- every rank ----------------------------------------------------------------------------------------------------
    def _run(self, method: str, data_parallel: bool, kwargs: dict[str, Any]) -> Any:
        if data_parallel:
            return self._step(method, int(kwargs["t"]), kwargs.get("batch"))
        try:
            return declared_call(self.targets, method)(**kwargs)
        finally:  # a forward with no backward (evaluation) would leave what server.reshard_after_forward=false keeps
            for module in self._sharded:  # gathered until the next training step: all of f_s on every rank
                module.reshard()

    def _step(self, method: str, t: int, batch: dict[int, dict[str, Any]] | None) -> Any:
        """A data_parallel call: the algorithm's work laid out over the ranks, run, settled and stepped."""
        server = self.server
        work = shares = None
        if self.leads:
            work = declared_call(self.targets, method)(t=t, batch=batch)  # checked and admitted uploads
            shares = make_shares(work.uploads, work.counts, self.size, self.micro_batch_tokens, work.per_client)
        server.zero_grad()
        if self.group is None:
            share = shares[0] if shares else None
        else:  # each rank its rows (an empty round: none anywhere)
            share = self._scatter((shares or [None] * self.size) if self.leads else None)
        result = run_share(server.model, server.task, share, server.device) if share is not None else None
        finite = all(bool(torch.isfinite(g).all()) for g in _local_grads(server.model))
        gathered = [(result, finite)] if self.group is None else self._gather((_to_cpu(result), finite))
        kept = 0
        if self.leads:
            merged = merge_results([r for r, _ in gathered if r is not None])
            kept = server.settle(work, merged, all(ok for _, ok in gathered))
        if self.group is not None:
            kept = self._broadcast(kept)
        if kept and self.size > 1:  # FSDP averaged the ranks' shares: their sum (exact for S a power of two)
            for g in _local_grads(server.model):
                g.mul_(self.size)
        server.step(t, kept)
        return server.answers(work) if self.leads else None

    def _scatter(self, items: list[Any] | None) -> Any:
        """Rank 0 gives item k to rank k (``items`` is None on the other ranks); returns this rank's item."""
        out: list[Any] = [None]
        dist.scatter_object_list(out, items if self.leads else None, group=self.group, group_src=0)
        return out[0]

    def _gather(self, item: Any) -> list[Any]:
        """Every rank's ``item``, in rank order, on rank 0 (an empty list elsewhere)."""
        out: list[Any] | None = [None] * self.size if self.leads else None
        dist.gather_object(item, out, group=self.group, group_dst=0)
        return out or []

    def _broadcast(self, item: Any) -> Any:
        box = [item]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]


def _local_grads(model: nn.Module) -> list[Tensor]:
    """This rank's gradients (its FSDP2 shard's local tensors)."""
    out = []
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad
            out.append(g.to_local() if hasattr(g, "to_local") else g)
    return out


def _to_cpu(result: ShareResult | None) -> ShareResult | None:
    if result is None:
        return None
    return ShareResult([(m, r, lam.cpu()) for m, r, lam in result.lams], result.losses, result.nonfinite)


def local_endpoint(server: Any, evaluator: Any = None) -> ServerEndpoint:
    """The server side of one process: ``server`` (and an evaluation server over its module, unless one is given)
    behind an endpoint whose executor is a one-rank :class:`ServerStep` (tests, the memory profiler, benchmarks)."""
    if evaluator is None:
        evaluator = EvalServer(server.model, server.task)
    return ServerEndpoint(server, ServerStep(server, evaluator).execute, evaluator)
