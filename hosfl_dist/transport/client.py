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
  A transport that can (:class:`~hosfl_dist.runtime.rpc.RPCTransport`) sends them as one message, each call still
  served, counted and answered on its own; the others send them one by one;
- ``together()``: the calls, posts and prefetches made in the block leave as one message at its end, in the order
  they were made (HO-SFL's leader sends its report of round t and round t+1's syncs together: the server closes the
  round and answers the syncs without waiting for a second message; a live worker's round end and round t+1's syncs
  leave in one message and come back in its one reply). A call's answer is taken after the block.

:meth:`ClientTransport.flush` is the runtime's: before a checkpoint, an evaluation or the end of the run, every posted
call has reached the server and been answered.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

from hosfl_dist.transport import Pending, Transport


class ClientTransport:
    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self._posted: list[Pending] = []
        self._ahead: dict[tuple[Hashable, ...], Pending] = {}
        self._batch: list[tuple[str, dict[str, Any], Callable[[Pending], None]]] | None = None
        """Inside :meth:`together`: the calls to send at its end, each with where its pending answer goes."""

    def call(self, method: str, **kwargs: Any) -> Any:
        return self.call_async(method, **kwargs).wait()

    def call_async(self, method: str, **kwargs: Any) -> Pending:
        return self.call_many(method, [kwargs])[0]

    def call_many(self, method: str, calls: Sequence[dict[str, Any]]) -> list[Pending]:
        """Send each of ``calls`` (keyword arguments) and return their pending answers, in order: a call prefetched
        with the same arguments is taken, not sent again; the others are sent together (:func:`send_many`), or, inside
        :meth:`together`, with the block's message (their answers taken after it)."""
        out: list[Pending | None] = []
        missing = []
        for i, kwargs in enumerate(calls):
            key = _key(method, kwargs)
            out.append(self._ahead.pop(key, None) if key is not None else None)
            if out[-1] is None:
                missing.append(i)
        if self._batch is not None:
            for i in missing:
                out[i] = later = _Later(method)
                self._batch.append((method, calls[i], later.sent))
            return out  # type: ignore[return-value]
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
        if self._batch is not None:
            for key, kwargs in zip(keys, calls):
                self._batch.append((method, kwargs, lambda pending, key=key: self._ahead.__setitem__(key, pending)))
            return
        for key, pending in zip(keys, send_many(self.inner, method, calls)):
            self._ahead[key] = pending  # type: ignore[index]

    def post(self, method: str, **kwargs: Any) -> None:
        """Send a call whose answer nobody takes (after the previous post was answered)."""
        self.flush()
        if self._batch is not None:
            self._batch.append((method, kwargs, self._posted.append))
            return
        self._posted.append(self.inner.call_async(method, **kwargs))

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Calls, posts and prefetches made in the block are sent at its end, as one message where the transport can
        batch (:func:`send_batch`), in the order they were made. A block left by an error sends nothing (a call made
        in it raises at its ``wait``)."""
        if self._batch is not None:
            raise RuntimeError("together() blocks do not nest")
        self._batch = []
        try:
            yield
            batch = self._batch
        finally:
            self._batch = None
        for (_, _, sink), pending in zip(batch, send_batch(self.inner, [(m, kwargs) for m, kwargs, _ in batch])):
            sink(pending)

    def prefetch(self, method: str, **kwargs: Any) -> None:
        """Send a call now; the next identical :meth:`call_async` takes its answer. Its arguments must be plain
        values (ints, floats, strings): they are the key it is found by."""
        self.prefetch_many(method, [kwargs])

    def flush(self) -> None:
        """Wait until every posted call was answered (its error, if any, raised here)."""
        posted, self._posted = self._posted, []
        for pending in posted:
            pending.wait()


class _Later:
    """The answer of a call made inside :meth:`ClientTransport.together`: sent with the block's message at its end."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.pending: Pending | None = None

    def sent(self, pending: Pending) -> None:
        self.pending = pending

    def done(self) -> bool:
        return self.pending is not None and self.pending.done()

    def wait(self) -> Any:
        if self.pending is None:  # waited for inside its block (it would never leave), or its block failed
            raise RuntimeError(f"{self.method}: a call made in a together() block that has not sent it")
        return self.pending.wait()


def send_many(transport: Any, method: str, calls: Sequence[dict[str, Any]]) -> list[Pending]:
    """``transport.call_many`` where it has one (one message for all), else ``call_async`` one by one."""
    if not calls:
        return []
    many = getattr(transport, "call_many", None)
    if many is not None:
        return many(method, calls)
    return [transport.call_async(method, **kwargs) for kwargs in calls]


def send_batch(transport: Any, calls: Sequence[tuple[str, dict[str, Any]]]) -> list[Pending]:
    """``transport.call_batch`` where it has one (one message for calls of several methods), else each run of calls
    of one method through :func:`send_many`."""
    if not calls:
        return []
    batch = getattr(transport, "call_batch", None)
    if batch is not None:
        return batch(calls)
    out: list[Pending] = []
    for method, run in itertools.groupby(calls, key=lambda call: call[0]):
        out += send_many(transport, method, [kwargs for _, kwargs in run])
    return out


def _key(method: str, kwargs: dict[str, Any]) -> tuple[Hashable, ...] | None:
    """What a prefetched call is found by; None for a call with other than plain arguments (never prefetched)."""
    items = tuple(sorted(kwargs.items()))
    if not all(isinstance(v, (int, float, str, bool, type(None))) for _, v in items):
        return None
    return (method, *items)
