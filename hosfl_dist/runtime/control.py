"""The control plane: typed messages of the run's bookkeeping, dispatched by type.

Training calls are server methods declared with :func:`~hosfl_dist.transport.wire.wire`; everything else the
processes of a run tell each other is one of the messages below, handled by a method declared with :func:`handles`
(no string kinds, no tuples matched by ``if``/``elif``). Client workers send the first group to the run's front
(:class:`~hosfl_dist.runtime.front.RunFront`: in the same process, or on rank 0 over RPC); rank 0 sends the second to
the other server ranks (:class:`~hosfl_dist.runtime.server_group.ServerGroup`).

    client worker -> front       ResumeRequest, EvalReport, CheckpointPart, SaveCheckpoint, Stopped, FinalReport,
                                 FailureReport
    elastic worker -> front      Join, Beat, Leave, MemberFinal (the membership's, :mod:`hosfl_dist.runtime.elastic`)
    rank 0 -> server ranks       Execute, Digest, Memory, Save, Load, Stop
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

M = TypeVar("M")


def handles(*types: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a :class:`Handler` method as the handler of messages of ``types``."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.__handles__ = types
        return fn

    return deco


class Handler:
    """Dispatches a message to the method declared to handle its type (an undeclared type is an error)."""

    _handlers: ClassVar[dict[type, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        table: dict[type, str] = {}
        for base in reversed(cls.__mro__):
            for name, fn in vars(base).items():
                for t in getattr(fn, "__handles__", ()):
                    table[t] = name
        cls._handlers = table

    def handle(self, msg: Any) -> Any:
        name = self._handlers.get(type(msg))
        if name is None:
            raise TypeError(f"{type(self).__name__} handles no {type(msg).__name__} message")
        return getattr(self, name)(msg)


# -- client worker -> the run's front ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResumeRequest:
    """A worker starting: its part of the checkpoint being resumed, and what the server adds to it (None: start).
    ``environment``: the worker's (:func:`~hosfl_dist.runfolder.environment.environment_identity`), which the front
    records and compares with the checkpoint's like its own."""

    rank: int
    hosted: tuple[int, ...]
    leader: bool
    environment: dict[str, Any] | None = None


@dataclass(frozen=True)
class EvalReport:
    """The leader, after an evaluation: the row of round t (the traffic summed over the workers). Answered with
    the row's shown statistics, for the progress bar, and ``stop`` where the front's callbacks or
    ``train.early_stopping`` ask the run to end (:meth:`~hosfl_dist.runtime.front.RunFront.stop_answer`)."""

    t: int
    processed: int
    comm: dict[str, int]


@dataclass(frozen=True)
class CheckpointPart:
    """A worker's part of the checkpoint of the round just finished."""

    rank: int
    part: dict[str, Any]


@dataclass(frozen=True)
class SaveCheckpoint:
    """The leader, once every part is in: write the checkpoint after round t. Answered with its folder (``path``)
    and, like :class:`EvalReport`, ``stop``."""

    t: int
    processed: int


@dataclass(frozen=True)
class Stopped:
    """The leader: the workers checkpointed after round t and stop (a signal; the run is resumed later)."""

    t: int
    signal: str


@dataclass(frozen=True)
class FinalReport:
    """The leader, at the end: what the summary needs from the client workers."""

    rounds: int
    processed: int
    comm: dict[str, int]
    client_digests: dict[str, str]
    transport: dict[str, Any]
    """Per worker: round timing and time blocked in the transport."""
    memory: list[dict[str, Any]] = field(default_factory=list)
    link: dict[str, Any] | None = None
    """The emulated links' settings and what they carried, summed over workers (``comm.inject_delay``)."""
    stopped: dict[str, str] | None = None
    """The run ended before its budget because it was asked to (``by``, ``reason``: a callback, ``run.should_stop``,
    ``train.early_stopping``); None: it reached its budget."""


@dataclass(frozen=True)
class FailureReport:
    """A process failed (its one-line error): the front records it and the run ends."""

    message: str


# -- an elastic run's worker -> its server (the membership) -------------------------------------------------------
@dataclass(frozen=True)
class Join:
    """A worker joining an elastic run: where it runs, and the identity of the run it would compute (its config's,
    its inputs', its code's: :func:`~hosfl_dist.runfolder.identity.run_identity`), which must be the run's."""

    info: dict[str, Any]
    identity: dict[str, Any]


@dataclass(frozen=True)
class Beat:
    """A member is alive (``member``: set by the server's entry point from the caller's token, never by the caller)."""

    member: str = ""


@dataclass(frozen=True)
class Leave:
    """A member leaves (SIGTERM, Ctrl-C): its clients move at once."""

    member: str = ""
    why: str = "left"


@dataclass(frozen=True)
class MemberFinal:
    """A member at the run's end: the digest of its replicas at the last round (None: it serves no client), its round
    timing, memory and emulated link, and its traffic counters."""

    digest: str | None
    timing: dict[str, Any]
    memory: dict[str, Any]
    link: dict[str, Any] | None = None
    counts: dict[str, int] = field(default_factory=dict)
    member: str = ""
