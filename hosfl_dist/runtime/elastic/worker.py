"""A client worker that joins an elastic run (``python -m hosfl_dist.run --join RUN_DIR``) and leaves when it ends.

It reads the run's config and join address from the run folder, joins the server's dynamic RPC group
(:mod:`.membership`) and serves whichever logical clients the server gives it each round, with one replica of θc:

    join      θc at the start of the server's history, replayed to its end (Algorithm 3)
    round t   the clients it serves in t, the seeds, the rows to replay to θc^t, the data-stream positions of the
              clients it did not hold; each client draws its batch and uploads z (one message), then, for those the
              round counts, sends its P scalars (one message); a late client's batch is put back
    end       its replica brought to the last round; its digest, which the server checks against its own replay

A heartbeat every quarter of ``server.worker_timeout_s`` keeps it a member while a round's compute runs; a worker
the server has given up on (stopped past the timeout, then continued) joins again as a new member.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from hosfl_dist.algorithms import get_algorithm
from hosfl_dist.algorithms.hosfl import _load_replica
from hosfl_dist.config import Config, load_config
from hosfl_dist.core.zo import Projector
from hosfl_dist.data import build_data
from hosfl_dist.errors import ConfigError, HosflError, NonFiniteError, ProtocolError, first_line
from hosfl_dist.models import build_split_model
from hosfl_dist.runtime.elastic import entry
from hosfl_dist.runtime.elastic.membership import SERVER_NAME, join_rpc, leave_rpc
from hosfl_dist.runtime.checks import check_config
from hosfl_dist.runtime.process.host import set_threads
from hosfl_dist.runtime.rpc import from_wire, to_wire
from hosfl_dist.config.schema import link_delay_s
from hosfl_dist.transport import chained, done, failed, forward
from hosfl_dist.transport.inprocess import LocalCollective
from hosfl_dist.transport.link import client_speed
from hosfl_dist.transport.wire import CommMeter, payload_bytes

logger = logging.getLogger(__name__)

JOIN_FILE = "join.json"


def read_join(run_dir: Path) -> tuple[dict[str, Any], Config]:
    """The run's join address and token (``join.json``, written by ``--serve``) and its config."""
    path = run_dir / JOIN_FILE
    try:
        join = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"invalid value for --join: {str(run_dir)!r} (no {JOIN_FILE}: not a run started with "
                          "--serve, or one that has ended)") from None  # fmt: skip
    except (OSError, ValueError) as exc:
        raise ConfigError(f"invalid value for --join: {str(path)!r} cannot be read ({exc})") from None
    if not isinstance(join, dict) or not {"host", "port", "token"} <= set(join):
        raise ConfigError(f"invalid value for --join: {str(path)!r} is not a join file of this version")
    pid = join.get("pid")
    if join.get("node") == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
        raise ConfigError(f"invalid value for --join: {str(run_dir)!r} (its server, pid {pid} on this machine, is not "
                          f"running: python -m hosfl_dist.run --status {run_dir})")  # fmt: skip
    cfg = load_config(run_dir / "config.yaml")
    return join, cfg


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class RPCLink:
    """How a worker process reaches the elastic server: torch RPC, as a member of the server's dynamic group."""

    def __init__(self, join: dict[str, Any], run_dir: Path, timeout_s: float) -> None:
        self.join, self.run_dir, self.timeout = join, run_dir, timeout_s
        self.token = join["token"]
        self.name = ""

    def open(self) -> str:
        host, port = self.join["host"], int(self.join["port"])
        try:
            _, self.name = join_rpc(host, port, self.timeout, self.token)
        except (RuntimeError, ValueError) as exc:  # a store or agent that cannot be reached
            first = first_line(exc)
            raise ProtocolError(f"cannot join the run in {self.run_dir}: its server at {host}:{port} does not "
                                f"answer ({first}); is it still running? (python -m hosfl_dist.run --status "
                                f"{self.run_dir})") from None  # fmt: skip
        return self.name

    def send(self, method: str, *args: Any, timeout: float | None = None) -> Future:
        fut = rpc.rpc_async(SERVER_NAME, getattr(entry, method), args=(self.token, self.name, *map(to_wire, args)),
                            timeout=timeout or self.timeout)  # fmt: skip
        return chained(fut, from_wire)

    def close(self) -> None:
        leave_rpc()


class DirectLink:
    """A worker in the server's own process (tests): the coordinator's calls, without RPC."""

    def __init__(self, coordinator: Any, name: str) -> None:
        self.coordinator, self.name = coordinator, name

    def open(self) -> str:
        return self.name

    def send(self, method: str, *args: Any, timeout: float | None = None) -> Future:
        try:
            got = getattr(self.coordinator, method)(self.name, *args)
        except Exception as exc:  # noqa: BLE001 - the caller's wait raises it
            return failed(exc)
        return got if isinstance(got, Future) else done(got)

    def close(self) -> None:
        pass


class ElasticWorker:
    """One client worker of an elastic run (see the module docstring), reaching the server through ``link``."""

    def __init__(self, cfg: Config, link: Any, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.cfg = cfg = check_config(cfg)  # the run's plug-ins imported, as the server did
        self.link = link
        spec = get_algorithm(cfg.algorithm.name)
        self.data = build_data(cfg, clients=range(cfg.clients.total), evaluation=False)
        split = build_split_model(cfg, self.data.info, spec.zeroth_order_client, parts=spec.worker_parts)
        split.keep(spec.worker_parts)
        self.split = split
        threads, why = set_threads(cfg, sum(p.numel() for p in split.client.parameters()))
        logger.info(f"threads: {threads} intra-op ({why})")
        # the method's worker, for its forwards, projections and replays (it talks to no one itself)
        self.zo = spec.worker(cfg, split, self.data, [], _NoTransport(), _Follower(CommMeter()))
        self.replica = self.zo._new_replica()
        self.name = ""
        self.stopped = threading.Event()

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        return self._wait(self.link.send(method, *args, timeout=timeout), method)

    def _beat(self) -> None:
        every = max(0.2, self.cfg.server.worker_timeout_s / 4)
        while not self.stopped.wait(every):
            try:
                self.link.send("beat").wait()
            except Exception:  # noqa: BLE001 - the server's answer to the next call says what happened
                if self.stopped.is_set():
                    return

    def run(self) -> int:
        """Join, serve rounds until the run ends; returns the rounds this worker took part in."""
        self.name = self.link.open()
        beat = threading.Thread(target=self._beat, name="hosfl-heartbeat", daemon=True)
        ended = False
        try:
            if not self._join():
                logger.info(f"{self.name}: the run in {self.run_dir} has ended already")
                ended = True
                return 0
            beat.start()
            rounds = self._rounds()
            ended = True
            return rounds
        finally:
            self.stopped.set()
            if not ended:  # stopped, or failed: the server moves this worker's clients at once
                with contextlib.suppress(Exception):
                    self._call("leave", timeout=5.0)
            self.link.close()

    def _join(self) -> bool:
        """Join the run (again, after the server gave up on this worker); False: the run has ended."""
        state = self._call("join", {"host": socket.gethostname(), "pid": os.getpid()})
        if state.get("end"):
            return False
        rep = self.replica
        _load_replica(rep, state["base"])
        self.zo.replay(rep, state["hist_seeds"], state["hist_scalars"])
        logger.info(f"{self.name} joined {self.run_dir} at round {rep.round} (θc by replaying "
                    f"{len(state['hist_seeds'])} round(s) of the server's history)")  # fmt: skip
        return True

    def _rounds(self) -> int:
        t, took_part = 0, 0
        pending: list[Future] = []
        while True:
            task = self._call("next_round", t, self.replica.round)
            for fut in pending:  # the scalars of the round before: answered by now (an error is raised here)
                self._wait(fut, "scalars")
            pending = []
            if task.get("lost"):  # the server gave up on this worker (stopped too long): join again
                logger.warning(f"{self.name}: the server counted this worker as lost; joining again")
                if not self._join():
                    return took_part
                continue
            self.zo.replay(self.replica, task["hist_seeds"], task["hist_scalars"])
            t = task["t"]
            if task.get("end"):
                digest = self.replica.digest()
                self._call("final", digest)
                logger.info(f"{self.name}: the run ended after round {t}; θc {digest[:12]}")
                return took_part
            if task["clients"]:
                took_part += 1
                pending = self._serve(t, task)
            t += 1

    def _send(self, delay_s: float, method: str, *args: Any) -> Future:
        """``method`` on the server after ``delay_s`` (the client's emulated link time), without waiting for it."""
        if delay_s <= 0:
            return self.link.send(method, *args)
        out: Future = Future()

        def go() -> None:
            self.link.send(method, *args).add_done_callback(lambda f: forward(f, out))

        timer = threading.Timer(delay_s, go)
        timer.daemon = True
        timer.start()
        return out

    def _wait(self, fut: Future, what: str) -> Any:
        try:
            return fut.wait()
        except HosflError:
            raise
        except RuntimeError as exc:
            first = first_line(exc)
            raise ProtocolError(f"{self.name}: the server of {self.run_dir} did not answer {what} (gone, or "
                                f"stopped: {first})") from None  # fmt: skip

    def _link_s(self, client: int, nbytes: int, up: bool) -> float:
        """The emulated one-way time of a message of ``client`` (0 without comm.inject_delay)."""
        comm = self.cfg.comm
        if not comm.inject_delay:
            return 0.0
        speed = client_speed(comm, self.cfg.job.seed, client)
        return link_delay_s(nbytes, (comm.uplink_mbps if up else comm.downlink_mbps) * speed, comm.rtt_ms)

    def _serve(self, t: int, task: dict[str, Any]) -> list[Future]:
        """Round t for this worker's clients. Without an emulated link their uploads go in one message, and their
        scalars in another; with one (``comm.inject_delay``), each client's messages leave after its own link time,
        so a client on a slow link arrives late (``comm.speed_spread``)."""
        zo, rep = self.zo, self.replica
        for m, state in task["data"].items():
            self.data.load_state_dict({m: state})
        zo.bind(rep.params)
        delayed = self.cfg.comm.inject_delay
        before, jobs, uploads, sent = {}, {}, [], []
        for m in task["clients"]:
            before[m] = self.data.state_dict([m])
            x, y = self.data.next_batch(m)
            act = zo.zo_forward(x)
            upload = {"client": m, "act": zo.precision.upload(act), "labels": y, "data": self.data.state_dict([m])[m]}
            jobs[m] = (x, act["z"])
            if delayed:  # this client's upload leaves after its link time
                nbytes = payload_bytes((upload["act"], y))
                sent.append(self._send(self._link_s(m, nbytes, up=True), "upload", t, [upload]))
            else:
                uploads.append(upload)
        if uploads:
            sent.append(self._send(0.0, "upload", t, uploads))
        del uploads
        seeds = task["seeds"].tolist()
        # latency hiding (zo.overlap, as the fixed runtimes' workers do): the P perturbed forwards need θc^t and the
        # seeds only, so they run while the server steps; their projections wait for λ
        held = self.cfg.zo.num_perturbations * sum(z.numel() * z.element_size() for _, z in jobs.values())
        early = {}
        if self.cfg.zo.overlap_on(held):
            early = {m: zo.zo_activations(x, seeds) for m, (x, _) in jobs.items()}
        answers = {m: a for fut in sent for m, a in self._wait(fut, "upload").items()}
        rows, scalars_sent = {}, []
        for m in task["clients"]:
            answer = answers[m]
            if answer.get("late"):  # not this round: the batch was not used, put it back
                self.data.load_state_dict(before[m])
                continue
            if answer.get("skip"):
                continue
            x, z = jobs.pop(m)
            lam = answer["lam"]
            if delayed:  # λ reaches this client after its downlink time
                time.sleep(self._link_s(m, payload_bytes(lam), up=False))
            proj = Projector(lam.to(z.device), z)
            v = zo.zo_scalars(x, seeds, proj, early.pop(m, None))
            if not bool(torch.isfinite(v).all()) and self.cfg.train.on_nonfinite == "stop":
                raise NonFiniteError(f"round {t}: non-finite scalars v of client {m} (train.on_nonfinite=stop)")
            if delayed:
                scalars_sent.append(self._send(self._link_s(m, payload_bytes(v), up=True), "scalars", t, {m: v}))
            else:
                rows[m] = v
        if rows:
            scalars_sent.append(self._send(0.0, "scalars", t, rows))
        return scalars_sent  # answered when the round closes: the next round is asked for meanwhile


class _NoTransport:
    """The method's worker is used for its compute only: a call to the server from it is a bug."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"the elastic worker's compute called its transport ({name})")


class _Follower(LocalCollective):
    is_leader = False


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_join(run_dir: str) -> int:
    """``--join RUN_DIR``: one client worker, until the run ends (or SIGTERM/SIGINT: it leaves the run, which goes
    on without it)."""
    folder = Path(run_dir)
    join, cfg = read_join(folder)
    worker = ElasticWorker(cfg, RPCLink(join, folder, cfg.server.rpc_timeout_s), folder)
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        rounds = worker.run()
    except KeyboardInterrupt as exc:
        logger.warning(f"{worker.name or 'worker'}: stopped by {exc or 'SIGINT'}; left the run, which goes on without "
                       "it")  # fmt: skip
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    logger.info(f"{worker.name}: took part in {rounds} round(s); pid {os.getpid()} leaves")
    return 0
