"""The server front on rank 0: serves the @wire methods of the algorithm's server object to RPC callers.

Three things the in-process engine gets for free from running one call at a time, made explicit here:

- **Round order.** A call about round t that reads the round history (HO-SFL's ``sync``/``eval_sync``: the
  (seeds, v̄) rows a stale replica replays) is held until round t-1 is closed by ``finish_round``. Without it, a
  worker that left round t-1's all_reduce before the leader reported v̄^{t-1} would replay an incomplete history.
  ``submit`` needs no gate: the server's own round barrier (``ServerBase._gather``) runs round t once its K
  activations are in, in client-id order whatever the arrival order.
- **One execution order.** Calls run one at a time under a lock; with an FSDP server group every call is first
  broadcast to the other server ranks, which replay the same sequence so their collectives line up.
- **Outputs.** The leader worker reports each evaluation (traffic summed over workers) and the end of the run;
  the front writes the metrics row with the server's own train loss and evaluation statistics. Failures reported
  by any worker end the run with status "failed".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from torch.futures import Future

from hosfl_dist.algorithms.base import ServerBase
from hosfl_dist.distributed.rpc_transport import server_wire_spec, to_wire
from hosfl_dist.engine import Recorder, metrics_row

UNGATED = frozenset({"submit", "finish_round", "plan"})
"""Methods that never wait for the previous round to close (they do not read the round history)."""


class ServerFront:
    def __init__(self, server: ServerBase, recorder: Recorder, mirror: Callable[[str, dict[str, Any]], None] | None):
        self.server = server
        self.recorder = recorder
        self.mirror = mirror
        self._exec = threading.Lock()
        self._gate = threading.Lock()
        # Algorithms without finish_round keep no round history to gate on.
        self.gated = callable(getattr(type(server), "finish_round", None))
        self.closed = 0  # rounds < closed have called finish_round
        self._held: list[tuple[int, str, dict[str, Any], Future]] = []
        self.compute_s: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.done = threading.Event()
        self.final: dict[str, Any] = {}
        self.failure = ""

    # -- algorithm calls --------------------------------------------------------------------------------------
    def serve(self, method: str, kwargs: dict[str, Any]) -> Future:
        server_wire_spec(type(self.server), method)  # only the declared client->server calls are reachable
        t = kwargs.get("t")
        if self.gated and method not in UNGATED and t is not None:
            with self._gate:
                if t > self.closed:
                    fut: Future = Future()
                    self._held.append((t, method, kwargs, fut))
                    return fut
        return self._execute(method, kwargs)

    def _execute(self, method: str, kwargs: dict[str, Any]) -> Future:
        with self._exec:
            if self.mirror is not None:
                self.mirror(method, kwargs)
            start = time.perf_counter()
            try:
                out = getattr(self.server, method)(**kwargs)
            except Exception as exc:  # noqa: BLE001 - goes back to the caller as the remote error
                return _failed(exc)
            finally:
                self.compute_s[method] = self.compute_s.get(method, 0.0) + time.perf_counter() - start
                self.calls[method] = self.calls.get(method, 0) + 1
        if method == "finish_round":
            self._close(int(kwargs["t"]) + 1)
        if not isinstance(out, Future):
            return _ready(to_wire(out))
        answer: Future = Future()  # not fut.then(): that would wrap a failed round's error in a callback error
        out.add_done_callback(lambda f: _forward(f, answer, to_wire))
        return answer

    def _close(self, closed: int) -> None:
        with self._gate:
            self.closed = max(self.closed, closed)
            ready = sorted((h for h in self._held if h[0] <= self.closed), key=lambda h: h[0])
            self._held = [h for h in self._held if h[0] > self.closed]
        for _, method, kwargs, fut in ready:
            self._execute(method, kwargs).add_done_callback(lambda f, fut=fut: _forward(f, fut))

    # -- runtime bookkeeping ----------------------------------------------------------------------------------
    def report(self, kind: str, payload: dict[str, Any]) -> None:
        if kind == "eval":  # under the lock: the row pops the server's train loss / eval statistics
            with self._exec:
                self.recorder.log(metrics_row(self.server, payload["t"], payload["processed"], payload["comm"]))
        elif kind == "final":
            self.final = payload
            self.done.set()
        elif kind == "failure":
            self.fail(payload["message"])
        else:
            raise ValueError(f"unknown report {kind!r}")

    def fail(self, message: str) -> None:
        if not self.failure:
            self.failure = message
        self.done.set()

    def server_stats(self) -> dict[str, Any]:
        return {"calls": dict(self.calls), "compute_s": {k: round(v, 6) for k, v in self.compute_s.items()}}


def _ready(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def _failed(exc: BaseException) -> Future:
    fut: Future = Future()
    fut.set_exception(exc)
    return fut


def _forward(src: Future, dst: Future, convert: Callable[[Any], Any] = lambda v: v) -> None:
    try:
        dst.set_result(convert(src.value()))
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
        dst.set_exception(exc)
