"""The server side of every transport: one place that turns client calls into executions of the server's methods.

The algorithm's server object holds state and math only. What a process boundary, a thread or a delayed link makes
necessary is done here, the same way for the in-process runtime, the torchrun runtime and the emulated link:

- **only declared calls**: a method without :func:`~hosfl_dist.transport.wire.wire` is not reachable;
- **round order**: a call declared ``after_previous_round`` about round t is held until round t−1 is closed by a
  call declared ``closes_round`` (HO-SFL's ``sync`` waits for ``finish_round``; a baseline's ``download`` waits for
  the round's last ``upload``); a round the server's plan skips (``server.open_round``: fewer uploads than
  ``server.min_clients``) sends nothing and is closed with the round before it;
- **round gathering**: calls declared ``gather`` are collected per round until ``server.expected_in_round(t)``
  clients called; the method then runs once with all of them in client-id order, whatever the arrival order, and
  each caller gets its own part of the result (or the error, if the round failed);
- **one execution at a time**, in one order: calls are executed under one lock, through the runtime's executor
  when one is given (``execute``; :class:`hosfl_dist.runtime.server_group.ServerGroup`: with a server group, it
  announces every execution to the other ranks, which run the same sequence);
- **one thread**: calls handed over with :meth:`ServerEndpoint.enqueue` (what the RPC runtime does) are served on the
  endpoint's own long-lived :class:`ServerThread`, in the order they were handed over; the RPC thread that delivered
  a call returns at once with the call's future. :meth:`ServerEndpoint.serve` serves on the calling thread (the
  in-process runtime: the training loop's own thread, or the emulated link's delivery thread).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from torch.futures import Future

from hosfl_dist.transport import done, failed, forward
from hosfl_dist.transport.wire import WireSpec, declared_call, wire_spec

T = TypeVar("T")
Execute = Callable[[str, dict[str, Any]], Any]
"""Runs one declared call on the server side: ``execute(method, kwargs)`` returns its result."""
logger = logging.getLogger(__name__)


class ServerThread:
    """One long-lived thread that runs jobs one at a time, in the order they were put.

    Why one thread: glibc gives a thread that allocates while the others hold their arenas a malloc arena of its own
    (up to 8 per core) and keeps what is freed in the arena it came from. Rounds executed on whichever RPC thread
    delivered the call spread the server's activations, gradients and optimizer temporaries over as many arenas, and
    the server's RSS grew round after round (faster on a larger node, with more RPC threads); executed on one thread,
    they reuse one and it stays flat (before and after: results/scale/cpu_hygiene.md).
    The thread ends when its owner is collected.
    """

    def __init__(self, name: str = "hosfl-server") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        # the thread holds the queue only, never its owner: a dropped endpoint (tests make many) frees its server
        self._thread = threading.Thread(target=_run_jobs, args=(self._jobs, name), name=name, daemon=True)
        self._thread.start()
        self.ident = self._thread.ident
        weakref.finalize(self, self._jobs.put, None)

    def put(self, job: Callable[[], None]) -> None:
        """Run ``job`` after the jobs put before it (it reports its own result; an error escaping it is logged)."""
        self._jobs.put(job)


def _run_jobs(jobs: queue.SimpleQueue, name: str) -> None:
    while (job := jobs.get()) is not None:
        try:
            job()
        except Exception:  # a job must not take the server thread down with it
            logger.exception("%s: a job failed", name)
        del job  # nothing of the last job stays referenced while the thread waits


class ServerEndpoint:
    """Serves the declared calls of ``server`` (and of ``evaluator``, the evaluation server, when given).

    ``execute`` runs each call; without one, the method is called directly."""

    def __init__(self, server: Any, execute: Execute | None = None, evaluator: Any = None) -> None:
        self.server = server
        self.evaluator = evaluator
        self.targets = tuple(t for t in (server, evaluator) if t is not None)
        self.served = tuple(type(t) for t in self.targets)
        self.execute = execute
        self._lock = threading.RLock()
        self.closed = self._open(0)
        """Rounds below this are closed."""
        self._held: list[tuple[int, str, dict[str, Any], Future]] = []
        self._gathering: dict[tuple[str, int], dict[int, tuple[dict[str, Any], Future]]] = {}
        self.calls: dict[str, int] = {}
        self.compute_s: dict[str, float] = {}
        self._threads: set[int] = set()
        """Ids of the threads that executed server methods (one, when every call came through :meth:`enqueue`)."""
        self._thread: ServerThread | None = None
        self._thread_lock = threading.Lock()  # not _lock: an RPC thread must not wait for an execution to enqueue
        self.gate: Any = None
        """Live rounds: the round gate (:mod:`hosfl_dist.runtime.gate`), which decides who of a round's arrivals
        count before their calls go on here, and serves its own ``close``; None: every round is planned."""

    def spec(self, method: str) -> WireSpec:
        return wire_spec(self.served, method)

    def serve(self, method: str, kwargs: dict[str, Any], caller: str | None = None, gated: bool = True) -> Future:
        """Run (or hold, or gather) one client call; the future completes with its answer. ``caller``: the worker
        that sent it, where the runtime knows (an elastic run's member); ``gated=False``: a call the round gate
        makes itself."""
        gate = self.gate
        if gate is not None and method == "close":
            return gate.close(kwargs, caller)
        try:
            spec = self.spec(method)
        except AttributeError as exc:
            return failed(exc)
        if gate is not None and gated and spec.arrives:
            return gate.arrive(method, kwargs, caller, lambda kw: self._serve_spec(method, spec, kw))
        return self._serve_spec(method, spec, kwargs)

    def _serve_spec(self, method: str, spec: WireSpec, kwargs: dict[str, Any]) -> Future:
        with self._lock:
            t = kwargs.get("t")
            if spec.after_previous_round and t is not None and t > self.closed:
                fut: Future = Future()
                self._held.append((t, method, kwargs, fut))
                return fut
            return self._dispatch(method, spec, kwargs)

    def enqueue(self, method: str, kwargs: dict[str, Any], caller: str | None = None) -> Future:
        """:meth:`serve` on the endpoint's server thread, after the calls enqueued before; returns at once with the
        call's future (what an RPC thread does with the call it delivered)."""
        out: Future = Future()

        def job() -> None:
            try:
                answer = self.serve(method, kwargs, caller)
            except Exception as exc:  # noqa: BLE001 - e.g. a gathered call without its round: the caller's error
                out.set_exception(exc)
                return
            answer.add_done_callback(lambda f: forward(f, out))

        self.run_job(job)
        return out

    def run_job(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the endpoint's server thread, after what was enqueued before (a round gate's timeout)."""
        with self._thread_lock:
            if self._thread is None:
                self._thread = ServerThread()
            thread = self._thread
        thread.put(job)

    def gathered(self, method: str, t: int) -> set[int]:
        """The clients whose gathered ``method`` call of round t is in (read without the lock: a snapshot)."""
        return set(self._gathering.get((method, t), {}))

    def regather(self, method: str, t: int) -> None:
        """Round t's ``method`` gathers fewer calls than before (a live round took clients out of it): run it now if
        the ones left are all in."""
        with self._lock:
            pending = self._gathering.get((method, t))
            if pending is None or len(pending) < self.server.expected_in_round(t):
                return
            del self._gathering[(method, t)]
            self._run_gathered(method, self.spec(method), t, pending)

    def locked(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` between executions (e.g. read the server's train loss for a metrics row)."""
        with self._lock:
            return fn()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "calls": dict(self.calls),
                "compute_s": {k: round(v, 6) for k, v in self.compute_s.items()},
                "threads": len(self._threads),
            }

    # ------------------------------------------------------------------------------------------------------------
    def _dispatch(self, method: str, spec: WireSpec, kwargs: dict[str, Any]) -> Future:
        if spec.gather:
            return self._gather(method, spec, kwargs)
        try:
            out = self._execute(method, kwargs)
        except Exception as exc:  # noqa: BLE001 - goes back to the caller as the call's error
            return failed(exc)
        if spec.closes_round:
            self._close(int(kwargs["t"]) + 1)
        return done(out)

    def _gather(self, method: str, spec: WireSpec, kwargs: dict[str, Any]) -> Future:
        t, client = int(kwargs["t"]), int(kwargs["client"])
        fields = {k: v for k, v in kwargs.items() if k not in ("t", "client")}
        pending = self._gathering.setdefault((method, t), {})
        if client in pending:
            return failed(RuntimeError(f"client {client} called {method} twice in round {t}"))
        fut: Future = Future()
        pending[client] = (fields, fut)
        if len(pending) < self.server.expected_in_round(t):
            return fut
        del self._gathering[(method, t)]
        self._run_gathered(method, spec, t, pending)
        return fut

    def _run_gathered(self, method: str, spec: WireSpec, t: int, pending: dict[int, tuple[dict, Future]]) -> None:
        batch = {m: pending[m][0] for m in sorted(pending)}
        try:
            results = self._execute(method, {"t": t, "batch": batch})
        except Exception as exc:  # noqa: BLE001 - every client of the failed round gets the error
            for _, f in pending.values():
                f.set_exception(exc)
            return
        if spec.closes_round:
            self._close(t + 1)
        for m, (_, f) in pending.items():
            f.set_result(None if results is None else results[m])

    def _execute(self, method: str, kwargs: dict[str, Any]) -> Any:
        self._threads.add(threading.get_ident())
        start = time.perf_counter()
        try:
            if self.execute is not None:
                return self.execute(method, kwargs)
            return declared_call(self.targets, method)(**kwargs)
        finally:
            self.compute_s[method] = self.compute_s.get(method, 0.0) + time.perf_counter() - start
            self.calls[method] = self.calls.get(method, 0) + 1

    def resume_at(self, round_idx: int) -> None:
        """Rounds below ``round_idx`` are closed (a run resumed from a checkpoint of that round)."""
        with self._lock:
            self.closed = self._open(round_idx)

    def _open(self, closed: int) -> int:
        """The first round from ``closed`` on that is not closed with the one before it (skipped by the plan)."""
        open_round = getattr(self.server, "open_round", None)
        return closed if open_round is None else open_round(closed)

    def close_round(self, t: int) -> None:
        """Round t is over without a call that closes it (an elastic server's skipped round, whose plan was decided
        after the round before it closed): it is closed with the one before it, and what it held is released."""
        with self._lock:
            self._close(t)

    def _close(self, closed: int) -> None:
        newly = closed > self.closed
        self.closed = max(self.closed, self._open(closed))
        ready = sorted((h for h in self._held if h[0] <= self.closed), key=lambda h: h[0])
        self._held = [h for h in self._held if h[0] > self.closed]
        for _, method, kwargs, fut in ready:
            answer = self._dispatch(method, self.spec(method), kwargs)
            answer.add_done_callback(lambda f, fut=fut: forward(f, fut))
        if self.gate is not None and newly:  # a method that closes its own live rounds: the gate ends the round
            self.gate.round_closed(closed - 1)
