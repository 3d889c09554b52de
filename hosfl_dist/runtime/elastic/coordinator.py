"""The server of an elastic run: rounds decided by who answers in time, over client workers that come and go.

One driver thread runs the rounds (:meth:`Coordinator.run`); the workers' RPC calls only hand it what arrived and
wait for its answer. Round t:

  open      S_t is drawn as always (``clients.over_select`` included); each sampled client is served by the live
            worker that owns it (every logical client has an owner; owners are rebalanced when a worker joins or is
            lost). A worker asking for round t gets its clients, the seeds, the (seeds, v̄) rows its replica must
            replay to reach θc^t, and the data-stream position of each client it did not hold last
  gather    uploads are taken until the first K have arrived, every sampled client of a live worker has uploaded, or
            ``server.round_timeout_s`` has passed since the first upload; the arrivals decide the round
            (:meth:`ParticipationPlan.settle`): counted (the first K), late (the others: "not this round"), dropped
            before upload (the rest), or skipped (fewer than ``server.min_clients``)
  step      the counted uploads go through the server's endpoint (``submit``, one step of θs) and each gets its λ
  scalars   taken until every counted client of a live worker has sent its P scalars, or the round timeout has passed
            since the first; the missing ones are dropped after upload, v̄ is the mean over those that delivered, and
            ``finish_round`` closes the round (the history row every replica replays)

A worker silent for ``server.worker_timeout_s`` is lost: its clients in the open round count as dropped and its
logical clients move to the others. Every decision is recorded in participation.jsonl, and
``clients.participation=FILE`` replays it in one process to the same digests: a late client's worker rewinds the
batch it drew, a moved client's data stream moves with it, and every replica is θc^t by replay.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.futures import Future

from hosfl_dist.algorithms.hosfl import mean_over_clients
from hosfl_dist.algorithms.participation import BEFORE_UPLOAD, AFTER_UPLOAD, Participation
from hosfl_dist.errors import Interrupted, ProtocolError
from hosfl_dist.transport.wire import (
    DOWNLINK_GRADIENTS,
    DOWNLINK_SCALARS_SEEDS,
    UPLINK_ACTIVATIONS,
    UPLINK_SCALARS,
    CommMeter,
    payload_bytes,
)

logger = logging.getLogger(__name__)

WORKER_KEY_BASE = -1000
"""A worker's replica in the server's ``client_round`` (so the history is kept until it has replayed it)."""
POLL_S = 0.05


@dataclass
class Member:
    """A client worker of the run, as the server knows it."""

    name: str
    key: int
    seen: float
    clients: set[int] = field(default_factory=set)
    joined_at: int = 0
    digest: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class OpenRound:
    t: int
    sampled: list[int]
    served_by: dict[int, str]
    arrived: list[int] = field(default_factory=list)
    uploads: dict[int, dict[str, Any]] = field(default_factory=dict)
    upload_answers: list[tuple[str, list[int], Future]] = field(default_factory=list)
    first_upload: float | None = None
    decided: Participation | None = None
    rows: dict[int, Tensor] = field(default_factory=dict)
    scalar_answers: list[tuple[str, list[int], Future]] = field(default_factory=list)
    first_scalars: float | None = None
    closed: bool = False


class Coordinator:
    """See the module docstring. ``evaluate(t, processed)`` writes a metrics row (the server process's own evaluation
    worker); ``server`` is the method's (HO-SFL) server behind ``endpoint``."""

    def __init__(
        self,
        cfg: Any,
        endpoint: Any,
        meter: CommMeter,
        evaluate: Callable[[int, int], None],
        stop: Any = None,
    ) -> None:
        self.cfg = cfg
        self.endpoint = endpoint
        self.server = endpoint.server
        self.plan = self.server.round_plan.participation
        self.plan.go_live()
        self.meter = meter
        self.evaluate = evaluate
        self.stop = stop
        c = cfg.clients
        self.K, self.B, self.M = c.per_round, c.batch_size, c.total
        self.round_timeout = cfg.server.round_timeout_s
        self.worker_timeout = cfg.server.worker_timeout_s
        self.cond = threading.Condition()
        self.members: dict[str, Member] = {}
        self.owner: dict[int, str] = {}
        self.data_state: dict[int, tuple[Any, str]] = {}
        """Each client's data-stream position after its last counted batch, and the worker that drew it."""
        self.current: OpenRound | None = None
        self.t = 0
        self.processed = 0
        self.ended = False
        self.end_round = 0
        self.waiting: list[tuple[str, int, int, Future]] = []
        self.lost = 0
        self.joined = 0
        self.next_key = WORKER_KEY_BASE
        self.folder = Path(cfg.job.out_dir)
        self.written = 0.0
        self.round_s = self.waiting_s = 0.0
        self.rounds_timed = 0

    # -- calls from workers (RPC threads) -----------------------------------------------------------------------------
    def join(self, name: str, info: dict[str, Any]) -> dict[str, Any]:
        """A worker joins: it gets θc at the history's start (the server's base replica) and the rows after it.
        ``info``: where it runs (host, pid), for ``--status``."""
        with self.cond:
            if self.ended:
                return {"end": True}
            self.next_key -= 1
            member = Member(name, self.next_key, time.monotonic(), joined_at=self.t)
            member.info = {k: info[k] for k in ("host", "pid") if k in info}
            self.members[name] = member
            self.joined += 1
            state = self.endpoint.locked(lambda: self._base_state(member.key))
            self._rebalance()
            self._write_members()
            logger.info(f"{name} joined at round {self.t}: {len(self.members)} worker(s), clients "
                        f"{self._describe_owners()}")  # fmt: skip
            self.cond.notify_all()
        self.meter.add(DOWNLINK_SCALARS_SEEDS, payload_bytes(state))
        return state

    def _base_state(self, key: int) -> dict[str, Any]:
        """What a resuming worker is given (:meth:`HOSFLServer.resume_payload`: the base replica and the history after
        it); the history is kept from the base's round until this worker has replayed it."""
        state = self.server.resume_payload([], leader=False)
        self.server.client_round[key] = state["base"]["round"]
        return state

    def beat(self, name: str) -> bool:
        with self.cond:
            member = self.members.get(name)
            if member is not None:
                member.seen = time.monotonic()
            return member is not None

    def next_round(self, name: str, t: int, since: int) -> Future:
        """Round t (or the open one, if the worker fell behind) for a worker whose replica is at round ``since``."""
        fut: Future = Future()
        with self.cond:
            if not self._touch(name):
                fut.set_result({"lost": True})
                return fut
            self.waiting.append((name, t, since, fut))
            self._answer_waiting()
        return fut

    def upload(self, name: str, t: int, uploads: list[dict[str, Any]]) -> Future:
        fut: Future = Future()
        with self.cond:
            known = self._touch(name)
            r = self.current
            self.meter.add(UPLINK_ACTIVATIONS, payload_bytes([(u["act"], u["labels"]) for u in uploads]), len(uploads))
            if not known or r is None or r.t != t or r.decided is not None:
                fut.set_result({u["client"]: {"late": True} for u in uploads})
                return fut
            for u in uploads:
                m = u["client"]
                if r.served_by.get(m) != name or m in r.uploads:
                    fut.set_exception(ProtocolError(f"round {t}: an upload of client {m} from {name}, which does "
                                                    "not serve it this round"))  # fmt: skip
                    return fut
            now = time.monotonic()
            for u in uploads:
                r.uploads[u["client"]] = u
                r.arrived.append(u["client"])
            r.first_upload = r.first_upload or now
            r.upload_answers.append((name, [u["client"] for u in uploads], fut))
            self.cond.notify_all()
        return fut

    def scalars(self, name: str, t: int, rows: dict[int, Tensor]) -> Future:
        fut: Future = Future()
        with self.cond:
            known = self._touch(name)
            r = self.current
            self.meter.add(UPLINK_SCALARS, payload_bytes(list(rows.values())), len(rows))
            if not known or r is None or r.t != t or r.decided is None or r.closed:
                fut.set_result({"counted": []})
                return fut
            for m, v in rows.items():
                if m not in r.decided.counted or r.served_by.get(m) != name or m in r.rows:
                    fut.set_exception(ProtocolError(f"round {t}: scalars of client {m} from {name}, which the round "
                                                    "does not count from it"))  # fmt: skip
                    return fut
                if not isinstance(v, Tensor) or tuple(v.shape) != (self.server.P,):
                    fut.set_exception(ProtocolError(f"round {t}: scalars of client {m} of the wrong shape"))
                    return fut
            r.rows.update({m: v.float() for m, v in rows.items()})
            r.first_scalars = r.first_scalars or time.monotonic()
            r.scalar_answers.append((name, list(rows), fut))
            self.cond.notify_all()
        return fut

    def final(self, name: str, digest: str) -> None:
        with self.cond:
            member = self.members.get(name)
            if member is not None:
                member.digest = digest
                self.cond.notify_all()

    def leave(self, name: str) -> None:
        with self.cond:
            if name in self.members and not self.ended:
                self._lose(name, "left")
            self.cond.notify_all()

    # -- membership --------------------------------------------------------------------------------------------------
    def _touch(self, name: str) -> bool:
        member = self.members.get(name)
        if member is not None:
            member.seen = time.monotonic()
        return member is not None

    def _check_members(self) -> None:
        now = time.monotonic()
        for name, member in list(self.members.items()):
            if now - member.seen > self.worker_timeout:
                self._lose(name, f"silent for {now - member.seen:.1f} s (server.worker_timeout_s="
                                 f"{self.worker_timeout:g})")  # fmt: skip

    def _lose(self, name: str, why: str) -> None:
        member = self.members.pop(name)
        self.lost += 1
        self.endpoint.locked(lambda: self.server.client_round.pop(member.key, None))  # its rows need not be kept
        for m in member.clients:
            self.owner.pop(m, None)
        self._rebalance()
        self._write_members()
        logger.warning(f"{name} lost at round {self.t} ({why}): {len(self.members)} worker(s) left, clients "
                       f"{self._describe_owners()}")  # fmt: skip

    def _rebalance(self) -> None:
        """Every logical client owned by a live worker, as evenly as can be, moving as few as possible."""
        names = sorted(self.members, key=lambda n: self.members[n].key, reverse=True)  # oldest first
        if not names:
            return
        for member in self.members.values():
            member.clients = {m for m in member.clients if self.owner.get(m) == member.name}
        free = [m for m in range(self.M) if m not in self.owner]
        cap = math.ceil(self.M / len(names))
        for name in names:  # above its share: give the highest ids back
            held = sorted(self.members[name].clients)
            while len(held) > cap:
                m = held.pop()
                self.members[name].clients.discard(m)
                del self.owner[m]
                free.append(m)
        for m in sorted(free):
            name = min(names, key=lambda n: (len(self.members[n].clients), names.index(n)))
            self.members[name].clients.add(m)
            self.owner[m] = name

    def _write_members(self) -> None:
        """``workers.json`` in the run folder: the live workers and their clients (``--status`` reads it)."""
        now = time.monotonic()
        members = {
            name: {
                **m.info,
                "joined_at_round": m.joined_at,
                "clients": sorted(m.clients),
                "last_heard_s": round(now - m.seen, 1),
            }  # fmt: skip
            for name, m in sorted(self.members.items())
        }
        record = {"round": self.t, "workers": members, **self.totals()}
        self.written = now
        tmp = self.folder / "workers.json.tmp"
        try:
            tmp.write_text(json.dumps(record, indent=1) + "\n")
            tmp.replace(self.folder / "workers.json")
        except OSError as exc:  # a status file: never the run's failure
            logger.warning(f"could not write {self.folder / 'workers.json'}: {exc}")

    def _describe_owners(self) -> str:
        return "; ".join(f"{n}: {len(m.clients)}" for n, m in sorted(self.members.items())) or "none"

    # -- answers -----------------------------------------------------------------------------------------------------
    def _answer_waiting(self) -> None:
        """Answer the workers waiting for a round that is open (or for the end)."""
        keep = []
        for name, t, since, fut in self.waiting:
            member = self.members.get(name)
            if member is None:
                fut.set_result({"lost": True})
                continue
            r = self.current
            if self.ended:
                answer = self._window(member, since, self.end_round)
                fut.set_result({"end": True, "t": self.end_round, **answer})
            elif r is not None and r.t >= t and r.decided is None:
                mine = [m for m in r.sampled if r.served_by.get(m) == name]
                data = {m: self.data_state[m][0] for m in mine
                        if m in self.data_state and self.data_state[m][1] != name}  # fmt: skip
                answer = {"t": r.t, "clients": mine, "seeds": self.server.seeds_of(r.t), "data": data,
                          **self._window(member, since, r.t)}  # fmt: skip
                self.meter.add(DOWNLINK_SCALARS_SEEDS, payload_bytes([answer["seeds"], answer["hist_seeds"],
                                                                     answer["hist_scalars"]]))  # fmt: skip
                fut.set_result(answer)
            else:
                keep.append((name, t, since, fut))
        self.waiting = keep

    def _window(self, member: Member, since: int, t: int) -> dict[str, Tensor]:
        def take() -> tuple[Tensor, Tensor]:
            seeds, scalars = self.server.history.window(since, t)
            self.server.client_round[member.key] = t
            return seeds, scalars

        seeds, scalars = self.endpoint.locked(take)
        return {"hist_seeds": seeds, "hist_scalars": scalars}

    # -- the rounds (driver thread) ----------------------------------------------------------------------------------
    def _wait(self, until: Callable[[], bool], deadline: Callable[[], float | None]) -> None:
        """Wait (holding ``cond`` between looks) until ``until()`` or the deadline; members are checked meanwhile."""
        while True:
            self._check_members()
            if until():
                return
            end = deadline()
            if end is not None and time.monotonic() >= end:
                return
            if self.stop is not None and self.stop.signal is not None:
                raise Interrupted(f"{self.stop.signal}: the elastic run stopped in round {self.t} (elastic runs write "
                                  "no checkpoints yet: it cannot be resumed)")  # fmt: skip
            self.cond.wait(POLL_S)

    def run(self, budget: int, eval_points: list[int]) -> tuple[int, int]:
        """Rounds until ``budget`` processed samples; returns (rounds, processed)."""
        points = [p for p in eval_points if p > 0]
        self.evaluate(0, 0)
        told = False
        least = self.cfg.server.min_workers  # to start; then whoever is there
        while self.processed < budget:
            with self.cond:
                if len(self.members) < least and not told:
                    logger.info(f"round {self.t}: waiting for {least - len(self.members)} more client worker(s) to "
                                f"join (python -m hosfl_dist.run --join {self.cfg.job.out_dir})")  # fmt: skip
                    told = True
                began = time.monotonic()
                self._wait(lambda n=least: len(self.members) >= n, lambda: None)
                told, least = False, 1
                started = time.monotonic()
                samples = self._round()
                self.waiting_s += started - began
                self.round_s += time.monotonic() - started
                self.rounds_timed += 1
            self.processed += samples
            self.t += 1
            if points and self.processed >= points[0]:
                while points and self.processed >= points[0]:
                    points.pop(0)
                self.evaluate(self.t, self.processed)
        return self.t, self.processed

    def _round(self) -> int:
        """Round ``self.t`` (holding ``cond``, which every wait lets go)."""
        t = self.t
        if time.monotonic() - self.written > 1.0:  # --status's view, at most once a second
            self._write_members()
        sampled = self.plan.sampled(t)
        r = self.current = OpenRound(t, sampled, {m: self.owner[m] for m in sampled if m in self.owner})
        self._answer_waiting()

        def pending() -> list[int]:
            return [m for m in sampled if m not in r.uploads and r.served_by.get(m) in self.members]

        def upload_deadline() -> float | None:
            if r.first_upload is None or not self.round_timeout:
                return None
            return r.first_upload + self.round_timeout

        self._wait(lambda: len(r.arrived) >= self.K or not pending(), upload_deadline)
        dropped = {m: BEFORE_UPLOAD for m in sampled if m not in r.uploads}
        p = r.decided = self.plan.settle(t, sampled, list(r.arrived), dropped)
        self.plan.decide(p)
        self._answer_waiting()  # a worker that asked for round t too late waits for t+1
        if p.skipped:
            logger.warning(f"round {t} skipped: {len(r.arrived)} upload(s) in time, server.min_clients="
                           f"{self.plan.min_clients}")  # fmt: skip
            for _, clients, fut in r.upload_answers:
                fut.set_result({m: {"late": True} for m in clients})
            self.endpoint.locked(lambda: self._pass_skipped(t))
            r.closed = True
            return 0
        futures = {m: self.endpoint.serve("submit", {"t": t, "client": m, "act": r.uploads[m]["act"],
                                                     "labels": r.uploads[m]["labels"]}) for m in p.counted}  # fmt: skip
        self.cond.release()
        try:
            answers = {m: f.wait() for m, f in futures.items()}
        finally:
            self.cond.acquire()
        for m in p.counted:
            self.meter.add(DOWNLINK_GRADIENTS, payload_bytes(answers[m]))
            state = r.uploads[m].get("data")
            if state is not None:
                self.data_state[m] = (state, r.served_by[m])
        for _, clients, fut in r.upload_answers:
            fut.set_result({m: answers.get(m, {"late": True}) for m in clients})
        r.uploads.clear()  # the activations are not needed any more

        def missing() -> list[int]:
            return [m for m in p.counted if m not in r.rows and r.served_by[m] in self.members
                    and not answers[m].get("skip")]  # fmt: skip

        def scalar_deadline() -> float | None:
            if r.first_scalars is None or not self.round_timeout:
                return None
            return r.first_scalars + self.round_timeout

        self._wait(lambda: not missing(), scalar_deadline)
        r.closed = True
        after = {m: AFTER_UPLOAD for m in p.counted if m not in r.rows}
        final = self.plan.settle(t, sampled, list(r.arrived), {**dropped, **after})
        self.plan.decide(final)
        rows = torch.full((len(final.counted), self.server.P), float("nan"))
        for i, m in enumerate(final.counted):
            if m in r.rows and m in final.delivered:
                rows[i] = r.rows[m]
        vbar = mean_over_clients(rows) if final.delivered else torch.full((self.server.P,), float("nan"))
        self.endpoint.serve("finish_round", {"t": t, "scalars": vbar}).wait()
        for _, clients, fut in r.scalar_answers:
            fut.set_result({"counted": [m for m in clients if m in final.delivered]})
        return len(final.counted) * self.B

    def _pass_skipped(self, t: int) -> None:
        self.server.pass_skipped()  # the history's NaN row of round t (no client step)
        self.endpoint.close_round(t)  # and the endpoint's round t closed with the one before it

    # -- the end -----------------------------------------------------------------------------------------------------
    def finish(self, rounds: int) -> dict[str, Any]:
        """Tell every worker the run ended (they bring their replicas to ``rounds`` and report their digests); wait up
        to ``server.worker_timeout_s`` for them. Returns {worker: digest}."""
        with self.cond:
            self.ended, self.end_round, self.current = True, rounds, None
            self._answer_waiting()
            deadline = time.monotonic() + 2 * self.worker_timeout + 30  # a worker that never reports is left out
            self._wait(lambda: all(m.digest is not None for m in self.members.values()), lambda: deadline)
            return {name: m.digest for name, m in sorted(self.members.items()) if m.digest is not None}

    def timing(self) -> dict[str, Any]:
        """summary.json's ``transport.workers.coordinator``: the rounds' wall time (as the fixed runtimes' workers
        report ``round_s``), and the time spent waiting for a worker to be there."""
        return {"rounds": self.rounds_timed, "round_s": round(self.round_s, 6),
                "waiting_for_workers_s": round(self.waiting_s, 6)}  # fmt: skip

    def totals(self) -> dict[str, int]:
        return {"workers_lost": self.lost, "workers_joined": self.joined}
