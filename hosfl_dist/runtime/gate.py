"""The round gate: live rounds decided at the server's endpoint, by who answers in time.

With ``server.round_timeout_s`` under torchrun, and in every elastic run, a round's participation is not drawn
in advance (:mod:`hosfl_dist.algorithms.participation` emulates it otherwise): the gate decides it from the calls
that arrive, the same way for every method and runtime.

  arrive   each sampled client's first call of the round (declared ``arrives``: HO-SFL's and frozen_client's
           ``submit``, a baseline's ``download``) is held until the round is decided: once K have arrived, every
           sampled client of a live worker has, or ``server.round_timeout_s`` has passed since the first. The
           arrivals settle it (:meth:`ParticipationPlan.settle`): the first K count, the others are late (answered
           ``{"late": True}``: not this round), the rest dropped before their upload, or the round is skipped
           (fewer than ``server.min_clients``). The counted calls then go on through the endpoint (its ordering and
           gathering), unchanged.
  close    every worker ends its round with :meth:`RoundService.close`, its clients' contributions to the method's
           client-side aggregate with it (HO-SFL's P scalars). The gate waits until every counted client of a live
           worker has sent its own, or the round timeout has passed since the first; the missing ones are dropped
           after their upload, the aggregate is taken over those that delivered (a non-finite contribution is left
           out under ``train.on_nonfinite=skip``, and ends its worker's membership under ``stop``) and the method's
           own closing call is made with it (HO-SFL's ``finish_round``, declared ``aggregates``). A method without
           a client-side aggregate closes its round itself (its gathered call declared ``closes_round``); a baseline's
           counted client whose worker is lost before its model arrives is taken out of the round (dropped before its
           upload; its server-side copy is forgotten), so that the record still replays.
  end      every worker's close is answered with the round as it happened (the record's line), the aggregate, the
           samples the server stepped with, and what the workers' membership adds (who serves whom next).

Who serves which client, and whether a worker is alive, is the ``members``' (:class:`Members`): the role map under
torchrun, the elastic run's membership. Every call is checked before it counts (its round, its client, who sent it,
the shape and finiteness of its contribution); a call that does not fit is refused to its caller in one line.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.futures import Future

from hosfl_dist.algorithms.hosfl import mean_over_clients
from hosfl_dist.algorithms.participation import AFTER_UPLOAD, BEFORE_UPLOAD, Participation
from hosfl_dist.errors import ProtocolError
from hosfl_dist.transport import done, failed, forward
from hosfl_dist.transport.wire import wire, wire_specs

logger = logging.getLogger(__name__)

KEPT_ROUNDS = 8
"""Closed rounds whose end the gate still answers (a worker that fell behind asks for them)."""
LATE = {"late": True}


class Members(Protocol):
    """Who serves which client in a round, and who is alive (the role map, or an elastic run's membership)."""

    def owners(self, t: int) -> dict[int, str]:
        """Client -> the worker that serves it in round t (a client no live worker serves is not there)."""

    def alive(self, name: str) -> bool: ...

    def end_of_round(self, t: int, batches: dict[int, int]) -> dict[str, dict[str, Any]]:
        """Round t has closed (``batches``: what each counted client drew): per worker, what its close answer adds."""

    def report_counts(self, name: str, counts: dict[str, int]) -> None:
        """A worker's traffic counters (an elastic run sums them; a torchrun job's workers sum their own)."""


class FixedMembers:
    """The client workers of a torchrun job: each hosts its clients for the whole run and is alive while it runs
    (a lost rank ends the job). Calls carry no member name (every rank holds the job's token)."""

    def __init__(self, hosted: Mapping[int, Any]) -> None:
        self._owner = {m: f"worker_{rank}" for rank, ids in hosted.items() for m in ids}

    def owners(self, t: int) -> dict[int, str]:
        return dict(self._owner)

    def alive(self, name: str) -> bool:
        return True

    def end_of_round(self, t: int, batches: dict[int, int]) -> dict[str, dict[str, Any]]:
        return {}

    def report_counts(self, name: str, counts: dict[str, int]) -> None:
        pass


class RoundService:
    """The gate's own declared call, served beside the method's server."""

    @wire()
    def close(self, t: int, rows: dict[int, Tensor], counts: dict[str, int] | None = None) -> dict[str, Any]:
        """End round t for this worker: its clients' contributions (client -> (P,)) to the method's client-side
        aggregate, and (elastic) its traffic counters; answered once the round has closed, with the round as it
        happened. (The contributions are traffic of the method's exchange, counted by the worker as the fixed
        runtimes' collective counts them; the declaration's categories are never used: see
        :class:`~hosfl_dist.runtime.live.LiveRounds`.)"""
        raise AssertionError("served by the round gate")


@dataclass
class GateRound:
    t: int
    sampled: tuple[int, ...]
    owners: dict[int, str]
    arrived: list[int] = field(default_factory=list)
    held: dict[int, tuple[dict[str, Any], Future, Callable[[dict[str, Any]], Future]]] = field(default_factory=dict)
    """Each arrival's call (its arguments, the caller's future, how the endpoint serves it), until the decision."""
    first: float | None = None
    decided: Participation | None = None
    left_out: set[int] = field(default_factory=set)
    """Counted clients the server left out of its step (answered ``skip``): their contribution is not waited for."""
    rows: dict[int, Tensor] = field(default_factory=dict)
    refused: set[int] = field(default_factory=set)
    """Counted clients whose contribution was refused (non-finite): dropped after their upload."""
    first_row: float | None = None
    closers: list[tuple[str | None, Future]] = field(default_factory=list)
    counted_in: dict[int, Future] = field(default_factory=dict)
    """The counted calls' answers from the endpoint (the round's step has run once all are done)."""
    end: dict[str, Any] | None = None
    closing: bool = False
    """The method's closing call has been made (or is being made) with the round's aggregate."""
    ending: bool = False


class RoundGate:
    """Decides live rounds (see the module docstring). ``server``: the method's server (its plan, its declared
    calls); ``endpoint``: the :class:`~hosfl_dist.transport.endpoint.ServerEndpoint` the gate sits in;
    ``auto_open``: open round t+1 as soon as round t closes (torchrun), rather than when the run's driver says
    (:meth:`open`, an elastic run's leader, which evaluates and checkpoints between rounds)."""

    def __init__(
        self,
        server: Any,
        endpoint: Any,
        members: Members,
        *,
        per_round: int,
        timeout_s: float,
        width: int,
        on_nonfinite: str,
        auto_open: bool,
    ) -> None:
        self.server = server
        self.endpoint = endpoint
        self.members = members
        self.plan = server.round_plan.participation
        self.plan.go_live()
        self.K = per_round
        self.timeout = timeout_s
        self.width = width
        self.on_nonfinite = on_nonfinite
        self.auto_open = auto_open
        specs = wire_specs(type(server))
        self.arrives = {name for name, spec in specs.items() if spec.arrives}
        closing = [(name, spec) for name, spec in specs.items() if spec.aggregates]
        self.closing = closing[0] if closing else None
        """The method's call that takes the round's aggregate and closes it (HO-SFL's finish_round), if any."""
        self.gathered_close = next((n for n, s in specs.items() if s.closes_round and s.gather), None)
        self.cond = threading.Condition()
        self.current: GateRound | None = None
        self.next_t = 0
        self.early: dict[int, list[tuple[str, dict[str, Any], str | None, Future, Callable]]] = {}
        """Arrivals for a round not opened yet (an elastic worker that went on while the leader evaluated)."""
        self.early_closers: dict[int, list[tuple[str | None, Future]]] = {}
        """Closes of a round not opened yet, from workers with no client in it."""
        self.ends: dict[int, dict[str, Any]] = {}
        self.finished: dict[str, Any] | None = None
        """The run's end (or a stop), answered to every call from now on."""
        endpoint.gate = self
        if auto_open:
            self.open(0)

    # -- the driver's side ----------------------------------------------------------------------------------------
    def start_at(self, t: int) -> None:
        """The next round to open is t (a resumed run)."""
        with self.cond:
            self.next_t = t
        if self.auto_open:
            self.open(t)

    def open(self, t: int) -> None:
        """Round t opens: its arrivals are taken from now on (those that came early are taken now)."""
        with self.cond:
            if self.current is not None and self.current.t == t:
                return
            if t != self.next_t:
                raise ProtocolError(f"the round gate opens round {self.next_t}, not round {t}")
            sampled = tuple(self.plan.sampled(t))
            owners = self.members.owners(t)
            self.current = GateRound(t, sampled, {m: owners[m] for m in sampled if m in owners})
            self.current.closers.extend(self.early_closers.pop(t, []))
            early = self.early.pop(t, [])
        for method, kwargs, caller, fut, go in early:
            self._arrive(method, kwargs, caller, go).add_done_callback(lambda f, fut=fut: forward(f, fut))
        with self.cond:
            actions = self._decide_if_ready(self.current)
        self._run(actions)

    def wait_closed(self, t: int) -> dict[str, Any]:
        """Block until round t has closed; its end (the driver's own close)."""
        fut: Future = Future()
        with self.cond:
            r = self.current
            if t in self.ends:
                fut.set_result(self.ends[t])
            elif r is None or r.t != t:
                raise ProtocolError(f"round {t} is not open (the gate is at {r.t if r else self.next_t})")
            else:
                r.closers.append((None, fut))
        return fut.wait()

    def finish(self, answer: dict[str, Any]) -> None:
        """The run has ended (``{"end": T}``) or stops (``{"stop": why}``): every waiting and later call is answered
        with it (arrivals as late)."""
        with self.cond:
            self.finished = answer
            waiting = [fut for r in [self.current] if r is not None for _, fut in r.closers]
            waiting += [fut for calls in self.early_closers.values() for _, fut in calls]
            self.early_closers.clear()
            held = [fut for r in [self.current] if r is not None and r.decided is None for _, fut, _ in r.held.values()]
            early = [fut for calls in self.early.values() for *_, fut, _ in calls]
            self.early.clear()
            if self.current is not None:
                self.current.closers = []
        for fut in waiting:
            fut.set_result(dict(answer))
        for fut in held + early:
            fut.set_result(dict(LATE))

    def member_lost(self, name: str) -> None:
        """A worker is gone: what waited for it does not any more."""
        with self.cond:
            r = self.current
            if r is None:
                return
            actions = self._decide_if_ready(r) if r.decided is None else self._lost_after_decision(r, name)
        self._run(actions)

    def expire(self, t: int) -> None:
        """The round timeout of round t has passed (a timer's call, on the endpoint's server thread)."""
        with self.cond:
            r = self.current
            if r is None or r.t != t:
                return
            actions = self._decide_if_ready(r) if r.decided is None else self._close_if_ready(r)
        self._run(actions)

    # -- calls from workers -----------------------------------------------------------------------------------------
    def arrive(self, method: str, kwargs: dict[str, Any], caller: str | None, go: Callable[[dict], Future]) -> Future:
        """A client's first call of a round (``go`` serves it through the endpoint once it counts)."""
        try:
            t, client = _round_and_client(kwargs)
        except ProtocolError as exc:
            return failed(exc)
        with self.cond:
            if self.finished is not None:
                return done(dict(LATE))
            r = self.current
            opened = r.t if r is not None else self.next_t - 1
            if t > opened:
                if t > max(opened, self.next_t - 1) + 1:
                    return failed(ProtocolError(f"round {t}: {method} of client {client} ahead of the run (round "
                                                f"{opened} is open)"))  # fmt: skip
                fut: Future = Future()
                self.early.setdefault(t, []).append((method, kwargs, caller, fut, go))
                return fut
        return self._arrive(method, kwargs, caller, go)

    def _arrive(self, method: str, kwargs: dict[str, Any], caller: str | None, go: Callable) -> Future:
        t, client = _round_and_client(kwargs)
        with self.cond:
            r = self.current
            if r is not None and t == r.t and r.decided is not None and r.end is None and not r.closing:
                self._late(r, client, caller)
            if r is None or t < r.t or (t == r.t and r.decided is not None):
                return done(dict(LATE))  # the round was decided without it: not this round
            if client not in r.sampled:
                return failed(ProtocolError(f"round {t}: {method} from client {client}, which is not sampled (S_t = "
                                            f"{list(r.sampled)})"))  # fmt: skip
            owner = r.owners.get(client)
            if caller is not None and owner != caller:
                return failed(ProtocolError(f"round {t}: {method} of client {client} from {caller}, which does not "
                                            f"serve it (it is {owner or 'nobody'}'s this round)"))  # fmt: skip
            if client in r.held or client in r.arrived:
                return failed(ProtocolError(f"round {t}: client {client} called {method} twice"))
            fut = Future()
            r.held[client] = (kwargs, fut, go)
            r.arrived.append(client)
            if r.first is None:
                r.first = time.monotonic()
                self._timer(r.t, self.timeout)
            actions = self._decide_if_ready(r)
        self._run(actions)
        return fut

    def _late(self, r: GateRound, client: int, caller: str | None) -> None:
        """An upload after the round was decided: recorded as late (it was sent, it is not this round's), where it is
        one of the round's and its worker's."""
        p = r.decided
        # late in the record's sense is an arrival after the K-th; one after a round timeout that left the round
        # fewer than K stays dropped before its upload (counted as the record reads it, it would change the round)
        if client not in r.sampled or client in r.arrived or p is None or p.skipped or len(p.counted) < self.K:
            return
        if caller is not None and r.owners.get(client) != caller:
            return
        r.arrived.append(client)
        dropped = {m: s for m, s in p.dropped.items() if m != client}
        r.decided = self.plan.settle(r.t, list(r.sampled), list(r.arrived), dropped)
        self.plan.decide(r.decided)

    def close(self, kwargs: dict[str, Any], caller: str | None) -> Future:
        """A worker ends its round (:meth:`RoundService.close`)."""
        try:
            t = _int(kwargs.get("t"), "t")
            rows = kwargs.get("rows") or {}
            if not isinstance(rows, Mapping):
                raise ProtocolError(f"round {t}: close with rows of type {type(rows).__name__}, expected a mapping")
            counts = kwargs.get("counts")
        except ProtocolError as exc:
            return failed(exc)
        if caller is not None and isinstance(counts, Mapping):  # an elastic worker's traffic, summed by the server
            self.members.report_counts(caller, {str(k): v for k, v in counts.items() if type(v) is int and v >= 0})
        fut: Future = Future()
        with self.cond:
            if self.finished is not None:
                return done(dict(self.finished))
            if t in self.ends:
                return done(self._answer(self.ends[t], caller))
            r = self.current
            if (r is None or r.end is not None) and t == self.next_t and not rows:  # a worker with no client in a
                self.early_closers.setdefault(t, []).append((caller, fut))  # round not opened yet (it joined late)
                return fut
            if r is None or r.t != t:
                now = r.t if r is not None else self.next_t
                return failed(ProtocolError(f"round {t}: close while the gate is at round {now}"))
            try:
                bad = self._take_rows(r, rows, caller)
            except ProtocolError as exc:
                return failed(exc)
            r.closers.append((caller, fut))
            actions = self._close_if_ready(r)
        for m in bad:  # train.on_nonfinite=skip: counted in the metrics rows' nonfinite_skipped
            self.endpoint.locked(lambda m=m: self.server.nonfinite(t, m, "scalars (left out of the round)"))
        self._run(actions)
        return fut

    def _take_rows(self, r: GateRound, rows: Mapping[Any, Any], caller: str | None) -> list[int]:
        """Check a worker's contributions before any counts: its counted clients, once each, (width,) floats.
        Returns the clients whose contribution is left out as non-finite (counted as skips by the caller)."""
        checked: dict[int, Tensor] = {}
        for key, v in rows.items():
            m = _int(key, "a client id")
            if r.decided is None:
                raise ProtocolError(f"round {r.t}: contributions before the round's uploads were decided")
            if r.decided is None or m not in r.decided.counted:
                raise ProtocolError(f"round {r.t}: a contribution of client {m}, which the round does not count")
            if caller is not None and r.owners.get(m) != caller:
                raise ProtocolError(f"round {r.t}: a contribution of client {m} from {caller}, which does not serve it")
            if m in r.rows or m in r.refused or m in checked:
                raise ProtocolError(f"round {r.t}: client {m}'s contribution twice")
            if not isinstance(v, Tensor) or not v.is_floating_point() or tuple(v.shape) != (self.width,):
                shape = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
                raise ProtocolError(f"round {r.t}: client {m}'s contribution of shape {shape}, expected "
                                    f"({self.width},) floats")  # fmt: skip
            checked[m] = v.detach().float().cpu()
        bad = []
        for m, v in checked.items():
            if not bool(torch.isfinite(v).all()):
                r.refused.add(m)  # dropped after its upload: the replay of the record leaves it out the same way
                if self.on_nonfinite == "stop":
                    raise ProtocolError(f"round {r.t}: non-finite contribution of client {m} (train.on_nonfinite="
                                        "stop: a worker that sends one is not trusted further)")  # fmt: skip
                bad.append(m)
                continue
            r.rows[m] = v
        if checked and r.first_row is None:
            r.first_row = time.monotonic()
            self._timer(r.t, self.timeout)
        return bad

    # -- decisions (under ``cond``; what they set in motion runs after, by _run) -----------------------------------
    def _decide_if_ready(self, r: GateRound) -> list[Callable[[], None]]:
        if r.decided is not None:
            return []
        live = [m for m in r.sampled if m in r.owners and self.members.alive(r.owners[m])]
        pending = [m for m in live if m not in r.held]
        timed_out = bool(self.timeout) and r.first is not None and time.monotonic() >= r.first + self.timeout
        if len(r.arrived) < self.K and pending and not timed_out:
            return []
        dropped = {m: BEFORE_UPLOAD for m in r.sampled if m not in r.arrived}
        p = self.plan.settle(r.t, list(r.sampled), list(r.arrived), dropped)
        self.plan.decide(p)
        r.decided = p
        held, r.held = r.held, {}
        actions: list[Callable[[], None]] = []
        for m, (_, fut, _) in held.items():
            if m not in p.counted:
                actions.append(lambda fut=fut: fut.set_result(dict(LATE)))
        if p.skipped:
            logger.warning(f"round {r.t} skipped: {len(r.arrived)} upload(s) in time, server.min_clients="
                           f"{self.plan.min_clients}")  # fmt: skip
            actions.append(lambda: self._pass_skipped(r))
            return actions
        for m in p.counted:
            kwargs, fut, go = held[m]
            actions.append(lambda m=m, kwargs=kwargs, fut=fut, go=go: self._forward(r, m, go(kwargs), fut))
        return actions

    def _forward(self, r: GateRound, client: int, answer: Future, fut: Future) -> None:
        with self.cond:
            r.counted_in[client] = answer

        def arrived(f: Future) -> None:
            try:
                value = f.value()
            except BaseException:  # noqa: BLE001 - the caller's future raises it; the round fails with it
                value = None
            if isinstance(value, Mapping) and value.get("skip"):
                with self.cond:
                    r.left_out.add(client)
            forward(f, fut)
            with self.cond:
                actions = self._close_if_ready(r)
            self._run(actions)

        answer.add_done_callback(arrived)

    def _pass_skipped(self, r: GateRound) -> None:
        self.endpoint.locked(self.server.pass_skipped)  # e.g. HO-SFL's history row of round t (no client step)
        self.endpoint.close_round(r.t)  # and the endpoint's round t closed with the one before it
        with self.cond:
            actions = self._end(r, r.decided, None)
        self._run(actions)

    def _close_if_ready(self, r: GateRound) -> list[Callable[[], None]]:
        p = r.decided
        if p is None or r.end is not None or r.closing or p.skipped:
            return []
        if self.closing is None:  # the method closes its round itself: the endpoint says when (round_closed)
            return []
        if len(r.counted_in) < len(p.counted) or not all(f.done() for f in r.counted_in.values()):
            return []  # the round's step has not run yet
        missing = [m for m in p.counted if m not in r.rows and m not in r.left_out and m not in r.refused
                   and self.members.alive(r.owners.get(m, ""))]  # fmt: skip
        timed_out = bool(self.timeout) and r.first_row is not None and time.monotonic() >= r.first_row + self.timeout
        if missing and not timed_out:
            return []
        r.closing = True
        after = {m: AFTER_UPLOAD for m in p.counted if m not in r.rows and m not in r.left_out}
        final = self.plan.settle(r.t, list(r.sampled), list(r.arrived), {**p.dropped, **after})
        self.plan.decide(final)
        r.decided = final
        kept = [r.rows[m] for m in final.delivered if m in r.rows]
        if final.delivered:
            left_out = [m for m in final.delivered if m not in r.rows]  # the server's skips: rows of NaN, left out
            rows = torch.stack([*kept, *[torch.full((self.width,), float("nan"))] * len(left_out)])
            aggregate = mean_over_clients(rows)
        else:
            aggregate = torch.full((self.width,), float("nan"))
        name, spec = self.closing
        return [lambda: self._close_with(r, name, spec.aggregates, aggregate)]

    def _close_with(self, r: GateRound, method: str, key: str, aggregate: Tensor) -> None:
        """The method's closing call with the round's aggregate (through the endpoint, like a worker's call)."""
        try:
            self.endpoint.serve(method, {"t": r.t, key: aggregate}, caller=None, gated=False).wait()
        except BaseException as exc:  # noqa: BLE001 - every worker of the round gets the error
            with self.cond:
                closers, r.closers = r.closers, []
            for _, fut in closers:
                fut.set_exception(exc)
            raise
        with self.cond:
            actions = self._end(r, r.decided, aggregate)
        self._run(actions)

    def round_closed(self, t: int) -> None:
        """The endpoint closed round t (a method that closes its rounds itself: its gathered closing call ran)."""
        with self.cond:
            r = self.current
            if r is None or r.t != t or r.end is not None or r.decided is None or self.closing is not None:
                return
            actions = self._end(r, r.decided, None)
        self._run(actions)

    def _lost_after_decision(self, r: GateRound, name: str) -> list[Callable[[], None]]:
        """A worker lost after round t was decided: an aggregate no longer waits for it; a method that closes its
        round itself takes the worker's counted clients whose closing call has not come out of the round."""
        if self.closing is not None:
            return self._close_if_ready(r)
        if self.gathered_close is None or r.end is not None:
            return []
        p = r.decided
        arrived = self.endpoint.gathered(self.gathered_close, r.t)
        gone = [m for m in p.counted if r.owners.get(m) == name and m not in arrived]
        if not gone:
            return []
        # taken out as dropped before their upload (so are the late ones: not this round either way), the record
        # stays one that replays: the server forgets their copies
        keep = [m for m in p.counted if m not in gone]
        dropped = {m: BEFORE_UPLOAD for m in r.sampled if m not in keep}
        final = self.plan.settle(r.t, list(r.sampled), keep, dropped)
        self.plan.decide(final)
        r.decided = final
        logger.warning(f"round {r.t}: client(s) {gone} of {name} taken out of the round (lost before their model "
                       "arrived)")  # fmt: skip

        def forget() -> None:
            self.endpoint.locked(lambda: self.server.forget(r.t, gone))
            if final.skipped:
                self._pass_skipped(r)
            else:
                self.endpoint.regather(self.gathered_close, r.t)

        return [forget]

    def _end(self, r: GateRound, p: Participation, aggregate: Tensor | None) -> list[Callable[[], None]]:
        """Round t is over: answer every worker's close, keep the end for late ones, open the next round."""
        if r.end is not None or r.ending:
            return []
        r.ending = True

        def end() -> None:  # the server's and the members' bookkeeping first, outside the gate's lock
            samples = self.endpoint.locked(lambda: self.server.round_samples(r.t)) if not p.skipped else 0
            batches = self.endpoint.locked(lambda: self.server.batches_used(r.t)) if not p.skipped else {}
            extra = self.members.end_of_round(r.t, batches)
            with self.cond:
                r.end = {"t": r.t, "participation": p.record(), "aggregate": aggregate, "samples": samples,
                         "extra": extra}  # fmt: skip
                self.ends[r.t] = r.end
                for old in [k for k in self.ends if k < r.t - KEPT_ROUNDS]:
                    del self.ends[old]
                closers, r.closers = r.closers, []
                self.next_t = r.t + 1
            for caller, fut in closers:
                fut.set_result(self._answer(r.end, caller))
            if self.auto_open:
                self.open(r.t + 1)

        return [end]

    @staticmethod
    def _answer(end: dict[str, Any], caller: str | None) -> dict[str, Any]:
        """A round's end as one worker's close is answered (what its membership adds for it)."""
        extra = end["extra"].get(caller, {}) if caller is not None else {}
        return {k: v for k, v in end.items() if k != "extra"} | {"extra": extra}

    def _timer(self, t: int, after_s: float) -> None:
        if not after_s:
            return
        timer = threading.Timer(after_s + 1e-3, lambda: self.endpoint.run_job(lambda: self.expire(t)))
        timer.daemon = True
        timer.start()

    def _run(self, actions: list[Callable[[], None]]) -> None:
        for action in actions:
            action()


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{what} must be an integer, got {type(value).__name__}")
    return value


def _round_and_client(kwargs: Mapping[str, Any]) -> tuple[int, int]:
    t, client = _int(kwargs.get("t"), "t"), _int(kwargs.get("client"), "client")
    if t < 0 or client < 0:
        raise ProtocolError(f"round {t}, client {client}: negative")
    return t, client
