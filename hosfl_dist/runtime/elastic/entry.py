"""The elastic server's RPC entry points: what a joined client worker may call, each with the run's token first
(:func:`~hosfl_dist.runtime.rpc.refusal`), each answered by the run's :class:`~.coordinator.Coordinator`."""

from __future__ import annotations

from typing import Any

import torch.distributed.rpc as rpc
from torch.futures import Future

from hosfl_dist.runtime.rpc import from_wire, refusal, to_wire
from hosfl_dist.transport import chained, done, failed

_COORDINATOR: list[Any] = []
"""The run's coordinator, once the server has built it (a call before it is refused)."""


def publish(coordinator: Any) -> None:
    _COORDINATOR[:] = [coordinator]


def _coordinator(token: str, entry: str) -> tuple[Any, Future | None]:
    refused = refusal(token, entry)
    if refused is not None:
        return None, refused
    if not _COORDINATOR:
        return None, failed(RuntimeError("the server is not serving yet"))
    return _COORDINATOR[0], None


def _answer(fn: Any) -> Future:
    try:
        return done(to_wire(fn()))
    except Exception as exc:  # noqa: BLE001 - the caller's error
        return failed(exc)


@rpc.functions.async_execution
def join(token: str, name: str, info: dict[str, Any]) -> Future:
    c, refused = _coordinator(token, "join")
    return refused or _answer(lambda: c.join(name, dict(info) if isinstance(info, dict) else {}))


@rpc.functions.async_execution
def beat(token: str, name: str) -> Future:
    c, refused = _coordinator(token, "beat")
    return refused or _answer(lambda: c.beat(name))


@rpc.functions.async_execution
def next_round(token: str, name: str, t: int, since: int) -> Future:
    c, refused = _coordinator(token, "next_round")
    return refused or chained(c.next_round(name, int(t), int(since)), to_wire)


@rpc.functions.async_execution
def upload(token: str, name: str, t: int, uploads: list[dict[str, Any]]) -> Future:
    c, refused = _coordinator(token, "upload")
    return refused or chained(c.upload(name, int(t), from_wire(uploads)), to_wire)


@rpc.functions.async_execution
def scalars(token: str, name: str, t: int, rows: dict[int, Any]) -> Future:
    c, refused = _coordinator(token, "scalars")
    return refused or chained(c.scalars(name, int(t), from_wire(rows)), to_wire)


@rpc.functions.async_execution
def final(token: str, name: str, digest: str) -> Future:
    c, refused = _coordinator(token, "final")
    return refused or _answer(lambda: c.final(name, str(digest)))


@rpc.functions.async_execution
def leave(token: str, name: str) -> Future:
    c, refused = _coordinator(token, "leave")
    return refused or _answer(lambda: c.leave(name))
