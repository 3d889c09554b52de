"""The client end of the transport: what an algorithm's worker holds and calls.

An algorithm says what it sends and when it needs the answer; waiting for answers nobody needs yet is kept here,
not in the algorithm:

- ``call`` / ``call_async``: a round trip, or a call whose answer the algorithm takes later in the same step
  (HO-SFL sends z_m, runs its P perturbed forwards, then takes λ_m);
- ``post``: a call whose answer nobody takes (HO-SFL's ``finish_round``). At most one post is in flight: the next
  post, and :meth:`ClientTransport.flush`, wait for it first, so its error surfaces a round later at the latest;
- ``prefetch``: a call sent ahead of need; the later ``call_async`` with the same method and arguments takes its
  answer instead of sending again (HO-SFL sends round t+1's syncs while round t's update runs);
- ``call_many`` / ``prefetch_many``: the same for several calls of one method at once (a worker's sampled clients).
  A transport that can (:class:`~hosfl_dist.transport.rpc.RPCTransport`) sends them as one message, each call still
  served, counted and answered on its own; the others send them one by one.

:meth:`ClientTransport.flush` is the runtime's: before a checkpoint, an evaluation or the end of the run, every posted
call has reached the server and been answered.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from hosfl_dist.transport import Pending, Transport


class ClientTransport:
    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self._posted: list[Pending] = []
        self._ahead: dict[tuple[Hashable, ...], Pending] = {}

    def call(self, method: str, **kwargs: Any) -> Any:
        return self.call_async(method, **kwargs).wait()

    def call_async(self, method: str, **kwargs: Any) -> Pending:
        return self.call_many(method, [kwargs])[0]

    def call_many(self, method: str, calls: Sequence[dict[str, Any]]) -> list[Pending]:
        """Send each of ``calls`` (keyword arguments) and return their pending answers, in order: a call prefetched
        with the same arguments is taken, not sent again; the others are sent together (:func:`send_many`)."""
        out: list[Pending | None] = []
        missing = []
        for i, kwargs in enumerate(calls):
            key = _key(method, kwargs)
            out.append(self._ahead.pop(key, None) if key is not None else None)
            if out[-1] is None:
                missing.append(i)
        for i, pending in zip(missing, send_many(self.inner, method, [calls[i] for i in missing])):
            out[i] = pending
        return out  # type: ignore[return-value]

    def prefetch_many(self, method: str, calls: Sequence[dict[str, Any]]) -> None:
        """:meth:`prefetch` of each of ``calls``, sent together."""
        keys = [_key(method, kwargs) for kwargs in calls]
        for key, kwargs in zip(keys, calls):
            if key is None:
                raise TypeError(f"prefetch {method}: arguments must be plain values, got {sorted(kwargs)}")
            if key in self._ahead:
                raise RuntimeError(f"{method}{kwargs} was prefetched already")
        if len(set(keys)) != len(keys):
            raise RuntimeError(f"prefetch {method}: the same call twice in one batch")
        for key, pending in zip(keys, send_many(self.inner, method, calls)):
            self._ahead[key] = pending  # type: ignore[index]

    def post(self, method: str, **kwargs: Any) -> None:
        """Send a call whose answer nobody takes (after the previous post was answered)."""
        self.flush()
        self._posted.append(self.inner.call_async(method, **kwargs))

    def prefetch(self, method: str, **kwargs: Any) -> None:
        """Send a call now; the next identical :meth:`call_async` takes its answer. Its arguments must be plain
        values (ints, floats, strings): they are the key it is found by."""
        self.prefetch_many(method, [kwargs])

    def flush(self) -> None:
        """Wait until every posted call was answered (its error, if any, raised here)."""
        posted, self._posted = self._posted, []
        for pending in posted:
            pending.wait()


def send_many(transport: Any, method: str, calls: Sequence[dict[str, Any]]) -> list[Pending]:
    """``transport.call_many`` where it has one (one message for all), else ``call_async`` one by one."""
    if not calls:
        return []
    many = getattr(transport, "call_many", None)
    if many is not None:
        return many(method, calls)
    return [transport.call_async(method, **kwargs) for kwargs in calls]


def _key(method: str, kwargs: dict[str, Any]) -> tuple[Hashable, ...] | None:
    """What a prefetched call is found by; None for a call with other than plain arguments (never prefetched)."""
    items = tuple(sorted(kwargs.items()))
    if not all(isinstance(v, (int, float, str, bool, type(None))) for _, v in items):
        return None
    return (method, *items)
