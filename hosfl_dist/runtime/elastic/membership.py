"""Who the live workers of an elastic run are, which logical clients each serves, and how they reach the server.

:class:`Membership` is the round gate's :class:`~hosfl_dist.runtime.gate.Members` for an elastic run and what the
server's trainer's peers read (:class:`~hosfl_dist.runtime.serve.MembershipPeers`). A worker joins
(:class:`~hosfl_dist.runtime.control.Join`: its identity must be the run's: config, inputs, code) and is given a name
and a token of its own by the server; it beats every quarter of ``server.worker_timeout_s`` and is lost when silent
longer (or when it leaves). Every logical client has an owner among the live workers, rebalanced when one joins or is
lost, moving as few as possible. Ownership is announced a round ahead: round t's close answers say who serves whom in
round t+2, so that every worker knows its clients of round t+1 before that round opens, and a client that moves in
round t+1 is handed over (adopted: its batch stream moved past the batches it drew, its method's state from the
server's) with round t's end. A lost worker's clients of the next round are dropped before their upload (nobody
serves them); from the round after they are someone else's.

How a worker reaches the server (torch's dynamic RPC group) is :mod:`hosfl_dist.runtime.process.dynamic`'s.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.futures import Future

from hosfl_dist.errors import ConfigError
from hosfl_dist.runfolder.identity import identity_differences
from hosfl_dist.safe_files import replace_file

logger = logging.getLogger(__name__)


@dataclass
class Member:
    name: str
    token: str
    seen: float
    info: dict[str, Any]
    joined_at: int
    final: Future = field(default_factory=Future)
    """Its end-of-run report (MemberFinal), once it sent it."""
    warned: bool = False


class Membership:
    """An elastic run's live workers and who serves which client (see the module docstring). ``payload(clients)``:
    the server's state for adopted clients (the method's ``resume_payload``, taken between executions); ``folder``:
    where ``workers.json`` (``--status``'s view) is written."""

    def __init__(self, total: int, worker_timeout_s: float, identity: dict[str, Any], folder: Path,
                 payload: Callable[[list[int]], dict[str, Any]]) -> None:  # fmt: skip
        self.total = total
        self.timeout = worker_timeout_s
        self.identity = identity
        self.folder = folder
        self.payload = payload
        self.lock = threading.RLock()
        self.members: dict[str, Member] = {}
        self.owned: dict[int, dict[int, str]] = {}
        """Round -> client -> the member that serves it (announced for the next two rounds)."""
        self.batches = dict.fromkeys(range(total), 0)
        """Client -> the batches it has drawn in the run (counted rounds)."""
        self.counts: dict[str, dict[str, int]] = {}
        """Member -> its traffic counters as last reported (kept for members that are gone)."""
        self.past_counts: dict[str, int] = {}
        """Traffic counted before this server process (a resumed run's checkpoint)."""
        self.lost = self.joined = 0
        self.next_id = 0
        self.round = 0
        self.started: int | None = None
        self.waiting: list[tuple[Member, Future]] = []
        """Joins before the first round opened: answered with their clients of it."""
        self.gate: Any = None
        self._stop = threading.Event()
        self._written = 0.0

    # -- joining, beating, leaving -------------------------------------------------------------------------------
    def join(self, info: dict[str, Any], identity: dict[str, Any], processed: Callable[[], int]) -> Future | dict:
        """A worker joins: refused in one line where it would not compute this run; else its name, token and where
        to start (answered once the first round opens, for a worker that joins before)."""
        differ = identity_differences(self.identity, identity) if isinstance(identity, dict) else ["its identity"]
        if differ:
            raise ConfigError(f"refused to join: this worker would compute another run (its {', '.join(differ[:4])} "
                              "not the run's); join with the run's config, data and code")  # fmt: skip
        with self.lock:
            self.next_id += 1
            member = Member(f"worker{self.next_id}", secrets.token_hex(32), time.monotonic(),
                            {k: info[k] for k in ("host", "pid") if k in info and isinstance(info[k], (str, int))},
                            self.round)  # fmt: skip
            self.members[member.name] = member
            self.joined += 1
            logger.info(f"{member.name} joined at round {self.round}: {len(self.members)} worker(s)")
            self._write()
            if self.started is None:
                fut: Future = Future()
                self.waiting.append((member, fut))
                return fut
            return self._welcome(member, self.round, processed())

    def _welcome(self, member: Member, t: int, processed: int, adopt: dict[str, Any] | None = None) -> dict:
        mine = {r: sorted(m for m, w in owners.items() if w == member.name) for r, owners in self.owned.items()}
        return {"member": member.name, "token": member.token, "t": t, "processed": processed, "owners": mine,
                **(adopt or {})}  # fmt: skip

    def caller(self, token: str) -> str | None:
        with self.lock:
            for member in self.members.values():
                if secrets.compare_digest(member.token, token):
                    member.seen = time.monotonic()
                    return member.name
        return None

    def beat(self, name: str) -> bool:
        with self.lock:
            return name in self.members

    def leave(self, name: str, why: str) -> None:
        with self.lock:
            member = self.members.pop(name, None)
            if member is None:
                return
            self.lost += 1
            for owners in self.owned.values():
                for m in [m for m, w in owners.items() if w == name]:
                    del owners[m]
            logger.warning(f"{name} lost at round {self.round} ({why}): {len(self.members)} worker(s) left")
            if not self.members:  # nobody to serve the next rounds: the run waits for a worker to join
                self.started = None
            self._write()
            if not member.final.done():
                member.final.set_result(None)
        if self.gate is not None:
            self.gate.member_lost(name)

    def watch(self) -> None:
        """Lose the members silent past ``server.worker_timeout_s`` (a thread of the server's, until :meth:`stop`)."""
        while not self._stop.wait(min(0.25, self.timeout / 8)):
            now = time.monotonic()
            with self.lock:
                for m, _ in self.waiting:  # its join waits for the first round (server.min_workers): it is there
                    m.seen = now
                silent = [(n, now - m.seen) for n, m in self.members.items() if now - m.seen > self.timeout]
                for name, m in self.members.items():  # a round waiting on a worker says so, before it gives up
                    quiet = now - m.seen
                    if quiet > self.timeout / 2 and not m.warned:
                        m.warned = True
                        logger.warning(f"{name} silent for {quiet:.0f} s: lost at {self.timeout:g} s "
                                       "(server.worker_timeout_s) unless it is heard from")  # fmt: skip
                    elif quiet <= self.timeout / 2:
                        m.warned = False
                if now - self._written > 1.0:
                    self._write()
            for name, quiet in silent:
                self.leave(name, f"silent for {quiet:.1f} s (server.worker_timeout_s={self.timeout:g})")

    def stop(self) -> None:
        self._stop.set()
        (self.folder / "workers.json").unlink(missing_ok=True)

    # -- the round gate's Members --------------------------------------------------------------------------------
    def owners(self, t: int) -> dict[int, str]:
        with self.lock:
            return dict(self.owned.get(t, {}))

    def alive(self, name: str) -> bool:
        with self.lock:
            return name in self.members

    def start(self, t: int, processed: int) -> None:
        """The first round this server runs opens: the workers there share the clients of rounds t and t+1."""
        with self.lock:
            self.started = self.round = t
            self.owned = {t: self._shared({}), t + 1: {}}
            self.owned[t + 1] = dict(self.owned[t])
            waiting, self.waiting = self.waiting, []
            handed = {name: sorted(m for m, w in self.owned[t].items() if w == name) for name in self.members}
        for member, fut in waiting:
            member.seen = time.monotonic()  # silent from its welcome on, not from its join
            clients = handed.get(member.name, [])
            adopt = {"adopt": {m: self.batches[m] for m in clients}, "from_server": self.payload(clients)}
            fut.set_result(self._welcome(member, t, processed, adopt))

    def end_of_round(self, t: int, batches: dict[int, int]) -> dict[str, dict[str, Any]]:
        """Round t has closed: count its clients' batches, share the clients of round t+2, and tell each worker its
        clients of round t+2 and hand over those it serves from round t+1 on."""
        with self.lock:
            for m, n in batches.items():
                self.batches[m] += n
            self.round = t + 1
            prev = self.owned.get(t, {})
            nxt = {m: w for m, w in self.owned.get(t + 1, {}).items() if w in self.members}
            self.owned = {t + 1: nxt, t + 2: self._shared(nxt)}
            out: dict[str, dict[str, Any]] = {}
            for name in self.members:
                came = sorted(m for m, w in nxt.items() if w == name and prev.get(m) != name)
                went = sorted(m for m, w in prev.items() if w == name and nxt.get(m) != name)
                out[name] = {"owners": {t + 2: sorted(m for m, w in self.owned[t + 2].items() if w == name)},
                             "adopt": {m: self.batches[m] for m in came}, "release": went}  # fmt: skip
            if time.monotonic() - self._written > 1.0:
                self._write()
        for extra in out.values():
            extra["from_server"] = self.payload(list(extra["adopt"])) if extra["adopt"] else {}
        return out

    def _shared(self, owners: dict[int, str]) -> dict[int, str]:
        """Every client owned by a live worker, as evenly as can be, moving as few as possible from ``owners``."""
        names = sorted(self.members, key=lambda n: int(n.removeprefix("worker")))  # oldest first
        if not names:
            return {}
        cap = math.ceil(self.total / len(names))
        held = {n: sorted(m for m, w in owners.items() if w == n) for n in names}
        out: dict[int, str] = {}
        for n in names:  # above its share: the highest ids go back
            for m in held[n][:cap]:
                out[m] = n
        for m in range(self.total):
            if m not in out:
                n = min(names, key=lambda k: (sum(1 for w in out.values() if w == k), names.index(k)))
                out[m] = n
        return out

    # -- the end, and the record -----------------------------------------------------------------------------------
    def finals(self, deadline_s: float) -> dict[str, Any]:
        """Every live member's end-of-run report (those that do not send it within ``deadline_s`` are left out)."""
        end = time.monotonic() + deadline_s
        with self.lock:
            members = list(self.members.values())
        out = {}
        for member in members:
            while not member.final.done() and time.monotonic() < end:
                time.sleep(0.05)
            if member.final.done() and member.final.value() is not None:
                out[member.name] = member.final.value()
        return out

    def report_counts(self, name: str, counts: dict[str, int]) -> None:
        with self.lock:
            self.counts[name] = dict(counts)

    def summed_counts(self, own: dict[str, int]) -> dict[str, int]:
        """The run's traffic: this process's, every member's as last reported, and what came before a restart."""
        with self.lock:
            out = {k: own.get(k, 0) + self.past_counts.get(k, 0) for k in set(own) | set(self.past_counts)}
            for counts in self.counts.values():
                for k, v in counts.items():
                    out[k] = out.get(k, 0) + v
            return out

    def totals(self) -> dict[str, int]:
        return {"workers_lost": self.lost, "workers_joined": self.joined}

    def described(self) -> dict[str, Any]:
        """summary.json's ``members``: who took part (where it ran), each one proven to run the run's identity."""
        with self.lock:
            return {"joined": self.joined, "lost": self.lost, "identity": "every member's config, inputs and code "
                    "equal the run's (checked at its join)"}  # fmt: skip

    def state_dict(self, own: dict[str, int]) -> dict[str, Any]:
        with self.lock:
            return {"batches": dict(self.batches), "counts": self.summed_counts(own), "lost": self.lost,
                    "joined": self.joined}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.lock:
            self.batches = {int(m): int(n) for m, n in state["batches"].items()}
            self.past_counts = dict(state["counts"])
            self.lost, self.joined = int(state["lost"]), int(state["joined"])

    def _write(self) -> None:
        """``workers.json`` in the run folder: the live workers, their clients and when each was last heard."""
        now = time.monotonic()
        owners = self.owned.get(self.round, {})
        workers = {n: {**m.info, "joined_at_round": m.joined_at, "clients": sorted(c for c, w in owners.items()
                   if w == n), "last_heard_s": round(now - m.seen, 1), "timeout_s": self.timeout}
                   for n, m in sorted(self.members.items())}  # fmt: skip
        record = {"round": self.round, "written_at": time.time(), "workers": workers, **self.totals()}
        self._written = now
        try:
            replace_file(self.folder / "workers.json", json.dumps(record, indent=1) + "\n")
        except OSError as exc:  # a status file: never the run's failure
            logger.warning(f"could not write {self.folder / 'workers.json'}: {exc}")
