"""A client worker of an elastic run (``python -m hosfl_dist.run --join RUN_DIR``), until the run ends.

It reads the run's address and token (``join.json``) and config from the run folder, proves it would compute the run
(its config's, inputs' and code's identity: :class:`~hosfl_dist.runtime.control.Join`) and gets a name and a token
of its own; then it runs the method's own worker over live rounds (:class:`~hosfl_dist.runtime.live.LiveRounds`):
each round, the sampled clients it serves, as every runtime's worker does. Between rounds it takes the clients
handed to it (their batch streams moved past the batches they drew, the method's state of them from the server's)
and lets go of those that moved. At the end it brings its replicas to the last round and reports their digest.

Its server going away is not its end: it waits up to ``server.rejoin_timeout_s`` for a server of the same run to
come back (``job.resume=auto``: a new ``join.json``) and joins it, its clients' state rebuilt from the server's; if
none comes, it exits with one line and a non-zero status. One the server counted as lost joins again as a new member.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from hosfl_dist.algorithms import get_algorithm
from hosfl_dist.config import Config
from hosfl_dist.core.params import bind_slots, slot_tensors, trainable_slots
from hosfl_dist.errors import ConfigError, HosflError, ProtocolError, first_line
from hosfl_dist.runfolder.identity import run_identity
from hosfl_dist.runtime.build import client_stack, method_config, round_plan, worker_rounds, worker_side
from hosfl_dist.runtime.checks import check_config
from hosfl_dist.runtime.control import Beat, Join, Leave, MemberFinal
from hosfl_dist.runtime.process.dynamic import CONNECT_S, join_rpc, leave_rpc
from hosfl_dist.runtime.memory import process_memory
from hosfl_dist.runtime.process.join_file import read_join, reachable
from hosfl_dist.runtime.rpc import RPCControl, RPCTransport, TransportStats, fetch_front
from hosfl_dist.runtime.trainer import RoundTimer
from hosfl_dist.transport.inprocess import LocalCollective
from hosfl_dist.transport.wire import CommMeter

logger = logging.getLogger(__name__)


class ServerGone(HosflError):
    """The run's server does not answer (it died, stopped, or ended without this worker)."""

    exit_code = 1


class Member:
    """This process as a member of the run in ``folder`` (see the module docstring)."""

    def __init__(self, cfg: Config, folder: Path) -> None:
        self.folder = folder
        self.cfg = cfg = check_config(cfg)  # the run's plug-ins imported, as the server did
        self.spec = spec = get_algorithm(cfg.algorithm.name)
        self.data, self.split, (threads, why) = worker_side(cfg, spec, range(cfg.clients.total), False)
        logger.info(f"threads: {threads} intra-op ({why})")
        self.identity = run_identity(cfg)
        self.slots = trainable_slots(self.split.client)
        self.initial = slot_tensors(self.slots)
        """f_c's own trainable tensors: a worker binds its replicas into the module; a new one starts from these."""
        self.draw = round_plan(cfg).participation
        self.name = ""
        self._gone_since: float | None = None
        """When its server last stopped answering (the rejoin bound counts from there)."""
        self.rounds_run = 0
        self.beating = threading.Event()

    # -- the run, across its server's restarts -----------------------------------------------------------------------
    def run(self) -> int:
        """Take part until the run ends; returns the rounds this worker ran."""
        join, _ = read_join(self.folder)
        while True:
            try:
                if self._take_part(join):
                    return self.rounds_run
            except ServerGone as exc:
                time.sleep(0.5 if self._gone_since is not None else 0.0)
                if not self.name:  # it never joined: the folder's server is not there (one line, at once)
                    raise ServerGone(f"cannot join the run in {self.folder}: {exc}; is it still running? (python -m "
                                     f"hosfl_dist.run --status {self.folder})") from None  # fmt: skip
                logger.warning(f"{self.name or 'worker'}: {exc}; waiting up to {self.cfg.server.rejoin_timeout_s:g} s "
                               "(server.rejoin_timeout_s) for it to come back")  # fmt: skip
                join = self._wait_for_server(join, str(exc))
            finally:
                self.beating.set()
                leave_rpc()

    def _wait_for_server(self, old: dict[str, Any], why: str) -> dict[str, Any]:
        """A ``join.json`` of a server to join: another than ``old``'s (its server gone), or ``old``'s once more where
        that server answers but counted this worker as lost, or could not be joined yet."""
        if self._gone_since is None:
            self._gone_since = time.monotonic()
        end = self._gone_since + self.cfg.server.rejoin_timeout_s
        while True:
            try:
                join, _ = read_join(self.folder)
                if reachable(join) and (join.get("token") != old.get("token") or "lost" in why
                                         or "does not answer" in why):  # fmt: skip
                    return join
            except ConfigError:  # no join file (yet), or one of a server that is not running
                pass
            if time.monotonic() >= end:
                raise ServerGone(f"the server of {self.folder} did not come back within server.rejoin_timeout_s="
                                 f"{self.cfg.server.rejoin_timeout_s:g} s ({why})")  # fmt: skip
            time.sleep(0.5)

    def _take_part(self, join: dict[str, Any]) -> bool:
        """Join the server of ``join`` and run rounds; True once the run ended (ServerGone where the server went)."""
        cfg = self.cfg
        timeout = cfg.server.rpc_timeout_s
        host, port = join["host"], int(join["port"])
        try:
            # one attempt waits CONNECT_S at most (a join file read as its server died names an address nobody
            # will answer at again: the next look at the folder finds the new one), and never past what is left
            # of server.rejoin_timeout_s
            gone = self._gone_since
            left = CONNECT_S if gone is None else min(CONNECT_S, gone + cfg.server.rejoin_timeout_s - time.monotonic())
            join_rpc(host, port, timeout, join["token"], left)
            front = fetch_front(timeout, join["token"])
            where = {"host": socket.gethostname(), "pid": os.getpid()}
            welcome = RPCControl(front, timeout, join["token"]).send(Join(where, self.identity))
        except HosflError:
            raise
        except (RuntimeError, ValueError, OSError) as exc:  # a store or agent that cannot be reached
            raise ServerGone(f"its server at {host}:{port} does not answer ({first_line(exc)})") from None
        self.name, token = welcome["member"], welcome["token"]
        control = RPCControl(front, timeout, token)
        meter, stats = CommMeter(), TransportStats()
        transport, collective, link = client_stack(cfg, self.spec, RPCTransport(front, timeout, stats, token),
                                                   _Follower(meter), meter)  # fmt: skip
        owned = {int(r): set(ms) for r, ms in welcome["owners"].items()}
        rounds = worker_rounds(cfg, transport, meter, lambda t: self._clients(owned, t), False, meter.snapshot)
        rounds.processed = int(welcome["processed"])
        bind_slots(self.slots, self.initial)  # as built (a worker before this one bound its replicas)
        worker = self.spec.worker(method_config(cfg), self.split, self.data, [], transport, collective, rounds)
        if welcome.get("adopt"):
            worker.adopt(welcome["adopt"], welcome["from_server"])
        t = int(welcome["t"])
        self._gone_since = None
        timer = RoundTimer(stats)
        logger.info(f"{self.name} joined {self.folder} at round {t}")
        self.beating.clear()
        threading.Thread(target=self._beat, args=(control,), name="hosfl-heartbeat", daemon=True).start()
        try:
            while True:
                try:
                    if rounds.processed < cfg.train.budget_samples:
                        timer.run(worker, t)
                    else:  # the budget is reached: the run's end is all there is to hear
                        rounds.close(t)
                except HosflError:
                    raise
                except RuntimeError as exc:  # the RPC to the server failed: it is gone, or it gave up on us
                    raise ServerGone(self._why_gone(control, exc)) from None
                extra = rounds.last.extra if rounds.last is not None else {}
                if "end" in extra:
                    self._finish(worker, int(extra["end"]), control, meter, link, timer)
                    return True
                if "stop" in extra:
                    raise ServerGone(str(extra["stop"]))
                if set(rounds.last.counted) & set(self._clients(owned, t) or ()):
                    self.rounds_run += 1
                for r, clients in (extra.get("owners") or {}).items():
                    owned[int(r)] = set(clients)
                for r in [r for r in owned if r <= t]:
                    del owned[r]
                if extra.get("release"):
                    worker.release(extra["release"])
                if extra.get("adopt"):
                    worker.adopt(extra["adopt"], extra["from_server"])
                t += 1
        except KeyboardInterrupt:
            with contextlib.suppress(Exception):
                control.send(Leave(why="stopped by a signal"))
            raise
        finally:
            if link is not None:
                link.close()

    def _clients(self, owned: dict[int, set[int]], t: int) -> tuple[int, ...] | None:
        if t not in owned:
            return None
        return tuple(sorted(m for m in self.draw.sampled(t) if m in owned[t]))

    def _why_gone(self, control: RPCControl, exc: BaseException) -> str:
        try:
            control.send(Beat())
        except ProtocolError as refused:  # it answers, but not to us: it counted this worker as lost
            return f"the server counted this worker as lost ({first_line(refused)})"
        except Exception:  # noqa: BLE001 - it does not answer at all
            pass
        return f"the server does not answer ({first_line(exc)})"

    def _finish(self, worker: Any, t: int, control: RPCControl, meter: CommMeter, link: Any, timer: RoundTimer) -> None:
        worker.transport.flush()
        worker.sync_all(t)  # every replica at the last round: the digest the server checks against its replay
        digest = worker.client_digest()
        memory = process_memory(0, "worker", self.split.client, self.split.server)
        timing = {**timer.summary(), "rounds_with_clients": self.rounds_run}
        control.send(MemberFinal(digest, timing, memory, link.summary() if link is not None else None,
                                 meter.snapshot()))  # fmt: skip
        logger.info(f"{self.name}: the run ended after round {t}; θc {str(digest)[:12]}")

    def _beat(self, control: RPCControl) -> None:
        every = max(0.2, self.cfg.server.worker_timeout_s / 4)
        while not self.beating.wait(every):
            with contextlib.suppress(Exception):  # the next call's answer says what happened
                control.send(Beat())


class _Follower(LocalCollective):
    """Live rounds aggregate at the server's gate: a worker's collective is never asked to sum."""

    is_leader = False


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_join(run_dir: str) -> int:
    """``--join RUN_DIR``: one client worker, until the run ends (or SIGTERM/SIGINT: it leaves the run, which goes
    on without it)."""
    folder = Path(run_dir)
    _, cfg = read_join(folder)
    member = Member(cfg, folder)
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        rounds = member.run()
    except KeyboardInterrupt as exc:
        logger.warning(f"{member.name or 'worker'}: stopped by {exc or 'SIGINT'}; left the run, which goes on without "
                       "it")  # fmt: skip
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    logger.info(f"{member.name}: took part in {rounds} round(s); pid {os.getpid()} leaves")
    return 0
