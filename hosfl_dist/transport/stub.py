"""The server as a client worker calls it: a stub made from the ``@wire`` declarations of the server's class.

``self.server.submit.send_many(uploads)`` reads as what it does and leads a reader (and an editor's "go to") to the
declared method: each declared method of the served class is one :class:`Remote`, resolved once when the stub is
built (its name, its declaration, the method it reaches), carrying the method's docstring and signature. A call's
arguments are checked against that signature on the worker, before anything is sent: a misspelled or missing
argument is a ``TypeError`` naming the call there, not an error from the far side of the wire. A name the server does
not declare is an ``AttributeError`` naming the class.

How a call leaves (a round trip, an answer taken later, a post nobody waits for, a prefetch) is the
:class:`~hosfl_dist.transport.client.ClientTransport`'s; the stub only names the call.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hosfl_dist.transport import Pending
from hosfl_dist.transport.client import ClientTransport
from hosfl_dist.transport.wire import Served, WireSpec, wire_specs


class Remote:
    """One declared server method, as a worker calls it (see the module docstring).

    - ``remote(**kwargs)``: a round trip, its answer returned;
    - ``remote.send(**kwargs)`` / ``remote.send_many(calls)``: the pending answer(s), taken later in the same step;
    - ``remote.post(**kwargs)``: an answer nobody takes;
    - ``remote.prefetch_many(calls)``: sent ahead of need, taken by the next identical ``send``/``send_many``.
    """

    def __init__(self, transport: ClientTransport, name: str, spec: WireSpec, method: Callable[..., Any]) -> None:
        self.transport = transport
        self.name = name
        self.spec = spec
        self.method = method
        """The server method this call reaches (on the declaring class)."""
        functools.update_wrapper(self, method)  # its docstring and signature, for a reader and ``help``
        self._check = _client_signature(name, spec, method)

    def __call__(self, **kwargs: Any) -> Any:
        self._check(kwargs)
        return self.transport.call(self.name, **kwargs)

    def send(self, **kwargs: Any) -> Pending:
        self._check(kwargs)
        return self.transport.call_async(self.name, **kwargs)

    def send_many(self, calls: Sequence[dict[str, Any]]) -> list[Pending]:
        for kwargs in calls:
            self._check(kwargs)
        return self.transport.call_many(self.name, calls)

    def post(self, **kwargs: Any) -> None:
        self._check(kwargs)
        self.transport.post(self.name, **kwargs)

    def prefetch_many(self, calls: Sequence[dict[str, Any]]) -> None:
        for kwargs in calls:
            self._check(kwargs)
        self.transport.prefetch_many(self.name, calls)

    def __repr__(self) -> str:
        return f"<remote {self.method.__qualname__}>"


class ServerStub:
    """Every declared call of ``served`` (a server class, or a tuple of them) as a :class:`Remote` over
    ``transport``; :meth:`together` sends the posts and prefetches made in its block as one message."""

    def __init__(self, served: Served, transport: ClientTransport) -> None:
        self.transport = transport
        classes = served if isinstance(served, tuple) else (served,)
        self.calls: dict[str, Remote] = {}
        for name, spec in wire_specs(served).items():
            method = next(getattr(c, name) for c in classes if getattr(getattr(c, name, None), "__wire__", None))
            self.calls[name] = Remote(transport, name, spec, method)
        self._served = "/".join(c.__name__ for c in classes)

    def __getattr__(self, name: str) -> Remote:
        calls = self.__dict__.get("calls", {})
        if name in calls:
            return calls[name]
        raise AttributeError(f"{self.__dict__.get('_served', 'the server')}.{name} is not a server method declared "
                             "with @wire")  # fmt: skip

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        with self.transport.together():
            yield


def _client_signature(name: str, spec: WireSpec, method: Callable[..., Any]) -> Callable[[dict[str, Any]], None]:
    """What a worker must pass: the method's own parameters; for a gathered call ``t`` and ``client`` with the fields
    (the method itself runs once per round with ``(t, batch)``)."""
    if spec.gather:

        def check_gathered(kwargs: dict[str, Any]) -> None:
            missing = [k for k in ("t", "client", *spec.args) if k not in kwargs]
            if missing:
                raise TypeError(f"{name}: a gathered call needs {', '.join(missing)}")

        return check_gathered
    signature = inspect.signature(method)

    def check(kwargs: dict[str, Any]) -> None:
        try:
            signature.bind(None, **kwargs)  # None: self
        except TypeError as exc:
            raise TypeError(f"{name}: {exc}") from None

    return check
