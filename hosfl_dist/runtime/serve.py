"""``python -m hosfl_dist.run --config X --serve [--address HOST:PORT]``: the server of an elastic run (its
membership and the workers that join: :mod:`hosfl_dist.runtime.elastic`).

The run's one :class:`~hosfl_dist.runtime.trainer.Trainer` runs here, over the method's own worker hosting no
client (it keeps the evaluation replica and drives the run: rounds, evaluations, checkpoints, callbacks, progress,
the end), with the elastic differences as its components: the round gate in the server's endpoint
(:mod:`hosfl_dist.runtime.gate`) decides each round from who answers in time, the :class:`Membership` says who
serves whom and sums the workers' traffic, :class:`LeaderRounds` opens each round as the trainer starts it. The
client workers (``--join``, :mod:`hosfl_dist.runtime.elastic.driver`) run the same method's ``run_round`` over
live rounds.

It writes ``join.json`` (address and token, readable by its owner only: :mod:`hosfl_dist.runtime.process.join_file`)
into the run folder while it serves. A stopped server (SIGTERM) checkpoints and tells its workers, which wait for it
to come back; ``job.resume=auto`` restarts it from its last checkpoint (a SIGKILLed one too) and the workers rejoin.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hosfl_dist.algorithms import get_algorithm
from hosfl_dist.config import Config
from hosfl_dist.data import build_data
from hosfl_dist.errors import ConfigError, HosflError, first_line
from hosfl_dist.evaluation.client import Evaluator
from hosfl_dist.models import build_split_model
from hosfl_dist.runfolder.folder import chosen, resolve_out_dir
from hosfl_dist.runtime.build import client_stack, data_sections, method_config, round_gate, server_side
from hosfl_dist.runtime.callbacks import Callback, Callbacks
from hosfl_dist.runtime.checkpoint import CheckpointStore
from hosfl_dist.runtime.checks import check_config, check_live
from hosfl_dist.runtime.control import Beat, Join, Leave, MemberFinal, handles
from hosfl_dist.runtime.elastic.membership import Membership
from hosfl_dist.runtime.process.dynamic import free_port, leave_rpc, serve_rpc
from hosfl_dist.runtime.front import LocalControl, RunFront
from hosfl_dist.runtime.fsdp import shard_server_model
from hosfl_dist.runtime.live import LeaderRounds
from hosfl_dist.runtime.memory import process_memory
from hosfl_dist.runtime.peers import LocalPeers
from hosfl_dist.runtime.process.groups import init_distributed
from hosfl_dist.runtime.process.host import check_devices, set_threads
from hosfl_dist.runtime.process.join_file import JOIN_FILE, write_join
from hosfl_dist.runtime.process.launch import server_role_map
from hosfl_dist.runtime.process.signals import StopRequest
from hosfl_dist.runtime.record.progress import Progress
from hosfl_dist.runtime.rpc import expect_members, expect_token, publish
from hosfl_dist.runtime.server_group import ServerGroup
from hosfl_dist.runtime.torchrun import TorchrunJob
from hosfl_dist.runtime.trainer import Trainer
from hosfl_dist.transport.endpoint import ServerEndpoint
from hosfl_dist.transport.inprocess import InProcessTransport, LocalCollective
from hosfl_dist.transport.wire import CommMeter

logger = logging.getLogger(__name__)

def check_elastic(cfg: Config, grouped: bool = False) -> None:
    """What an elastic run refuses, in one line each, before anything is built (``grouped``: its server is a group of
    ``server.ranks`` ranks under torchrun)."""
    if cfg.clients.participation:
        raise ConfigError("invalid value for clients.participation: with --serve the workers that answer decide who "
                          "takes part; replay an elastic run's record in one process instead")  # fmt: skip
    check_live(cfg, "--serve")
    if cfg.server.ranks != 1 and not grouped:
        raise ConfigError(f"invalid value for server.ranks: {cfg.server.ranks} (an elastic server of several ranks "
                          "is a torchrun job: torchrun --nproc_per_node=S -m hosfl_dist.run --serve … "
                          "server.ranks=S)")  # fmt: skip
    if cfg.comm.speed_spread and not cfg.comm.inject_delay:
        raise ConfigError(f"invalid value for comm.speed_spread: {cfg.comm.speed_spread:g} (per-client links are "
                          "emulated with comm.inject_delay=true)")  # fmt: skip


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"invalid value for --address: {text!r} (HOST:PORT, e.g. 127.0.0.1:29600; port 0 picks one)")
    return host, int(port)


class ElasticFront(RunFront):
    """The run's front with the membership's control messages (a worker's join, beat, leave, end-of-run report)."""

    membership: Membership
    processed: Any = staticmethod(lambda: 0)

    @handles(Join)
    def _on_join(self, msg: Join) -> Any:
        info = msg.info if isinstance(msg.info, dict) else {}
        return self.membership.join(info, msg.identity, self.processed)

    @handles(Beat)
    def _on_beat(self, msg: Beat) -> bool:
        return self.membership.beat(msg.member)

    @handles(Leave)
    def _on_leave(self, msg: Leave) -> None:
        self.membership.leave(msg.member, str(msg.why)[:200])

    @handles(MemberFinal)
    def _on_member_final(self, msg: MemberFinal) -> None:
        member = self.membership.members.get(msg.member)
        if member is not None and not member.final.done():
            member.final.set_result(msg)


class ElasticServer:
    """The server side of an elastic run, built and its folder opened (resumed from its checkpoint where
    ``job.resume`` says); :meth:`train` runs it. How workers reach it is the caller's (RPC: :func:`run_serve`)."""

    def __init__(self, cfg: Config, stop: Any, callbacks: tuple[Callback, ...] = (), d: Any = None) -> None:
        cfg = check_config(cfg)
        check_elastic(cfg, grouped=d is not None)
        check_devices(cfg)
        if not chosen(cfg):
            cfg = resolve_out_dir(cfg)
        self.cfg, self.stop = cfg, stop
        spec = get_algorithm(cfg.algorithm.name)
        data = build_data(data_sections(cfg), clients=[], evaluation=True)
        group = d.server_group if d is not None else None  # --serve under torchrun: f_s sharded over the server group
        shard = None
        if group is not None:
            reshard = cfg.server.reshard_after_forward
            shard = lambda module: shard_server_model(module, group, d.device, reshard)  # noqa: E731
        self.split = split = build_split_model(cfg, data.info, spec.zeroth_order_client, shard=shard)
        server, evaluator = server_side(cfg, spec, split, group)
        store = CheckpointStore(cfg.job.out_dir, cfg.checkpoint.keep, group)
        self.servers = servers = ServerGroup(server, evaluator, group, store)
        self.endpoint = endpoint = ServerEndpoint(server, servers.execute, evaluator)
        payload = lambda ids: endpoint.locked(lambda: server.resume_payload(ids, False))  # noqa: E731
        self.membership = Membership(cfg.clients.total, cfg.server.worker_timeout_s, {}, Path(cfg.job.out_dir), payload)
        self.gate = round_gate(cfg, server, endpoint, self.membership, auto_open=False)
        self.membership.gate = self.gate
        self.callbacks = Callbacks.of(cfg.job.callbacks, callbacks)
        self.front = ElasticFront(cfg, endpoint, servers, store, "elastic", {"workers": "elastic"}, "server",
                                  {"server": "elastic, --serve"}, self.callbacks)  # fmt: skip
        self.front.membership = self.membership
        self.meter = meter = CommMeter()
        transport, collective, self.link = client_stack(cfg, spec, InProcessTransport(endpoint), LocalCollective(meter),
                                                        meter)  # fmt: skip
        self._opened = False
        self.peers = MembershipPeers(self.membership, lambda: self.gate.finish({"end": self.gate.next_t}),
                                     2 * cfg.server.worker_timeout_s + 30)  # fmt: skip
        rounds = LeaderRounds(self.gate, self._before_open)
        self.worker = spec.worker(method_config(cfg), split, data, [], transport, collective, rounds)
        self.front.processed = lambda: self.worker.processed
        params = sum(p.numel() for m in (split.client, split.server) for p in m.parameters())
        threads, why = set_threads(cfg, params)
        self.front.open()
        logger.info(f"threads: {threads} intra-op ({why})")
        self.membership.identity = self.front.identity
        self.gate.start_at(self.front.resume[0].round if self.front.resume else 0)
        self.front.record.participation.workers = self.membership.totals

    def _before_open(self, t: int) -> None:
        """Before round t opens with no workers there (the first round this server runs, or every worker gone):
        wait for ``server.min_workers`` (then 1) to join and share the clients of rounds t and t+1 among them."""
        if self.membership.started is not None:
            return
        least = self.cfg.server.min_workers if not self._opened else 1
        self._opened = True
        told, began = False, time.monotonic()
        while len(self.membership.members) < least and self.stop.signal is None:
            if not told:
                logger.info(f"round {t}: waiting for {least - len(self.membership.members)} more client worker(s) "
                            f"to join (python -m hosfl_dist.run --join {self.cfg.job.out_dir})")  # fmt: skip
                told = True
            time.sleep(0.05)
        self.peers.waited_s += time.monotonic() - began
        self.membership.start(t, self.worker.processed)

    def train(self) -> dict[str, Any]:
        """The run to its budget (or a stop); the summary, checked against the server's replay."""
        cfg, gate = self.cfg, self.gate
        watch = threading.Thread(target=self.membership.watch, name="hosfl-membership", daemon=True)
        watch.start()
        peers = self.peers
        split = self.split
        trainer = Trainer(
            cfg,
            self.worker,
            rank=0,
            peers=peers,
            control=LocalControl(self.front),
            meter=self.meter,
            stop=self.stop,
            memory=lambda: process_memory(0, "server", split.client, split.server),
            evaluator=Evaluator(self.worker),
            progress=Progress(cfg),
            link=self.link,
            callbacks=self.callbacks,
            extra=ElasticState(self.membership),
        )
        try:
            outcome = trainer.train()
        finally:
            self.membership.stop()
        if not outcome.completed:  # checkpointed: the workers wait for this server to come back
            gate.finish({"stop": f"the server stopped after round {outcome.rounds} (it can be resumed)"})
        self.front.record.base["members"] = self.membership.described()
        return self.front.conclude()  # an interrupted run raises Interrupted here, after recording it

    def close(self) -> None:
        self.membership.stop()
        self.front.close()


class MembershipPeers(LocalPeers):
    """The elastic server's trainer's peers: it is the leader and decides alone (nobody to wait for or agree with:
    :class:`LocalPeers`); the traffic is summed over the members' reports; the end-of-run reports are the members'."""

    def __init__(self, membership: Membership, end: Callable[[], None], deadline_s: float) -> None:
        self.membership = membership
        self.end = end
        """Tells every worker the run has ended (the round gate's :meth:`~hosfl_dist.runtime.gate.RoundGate.finish`)."""
        self.deadline_s = deadline_s

    waited_s = 0.0
    """Seconds the run's driver waited for workers to join (the first round, and whenever none was left)."""

    def sum_counts(self, counts: dict[str, int]) -> dict[str, int]:
        return self.membership.summed_counts(dict(counts))

    def gather(self, obj: Any) -> list[Any]:
        """This process's end-of-run entry and every member's: the workers are told the run ended first."""
        self.end()
        _, digest, timing, link, memory = obj
        # the server's evaluation replica's digest, and the rounds' wall time as the run's driver (the coordinator)
        # saw it: from each round's opening to its close at the gate, and the time spent waiting for workers
        out = [("server_evaluation", digest, None, link, memory),
               ("coordinator", None, {**timing, "waiting_for_workers_s": round(self.waited_s, 6)}, None, None)]
        for name, final in self.membership.finals(self.deadline_s).items():
            self.membership.report_counts(name, final.counts)
            out.append((name, final.digest, final.timing, final.link, final.memory))
        return out


@dataclasses.dataclass
class ElasticState:
    """What a checkpoint of an elastic run adds to the leader's part: each client's batches and the traffic counted
    by workers (the rest, the server's state, is every member's to rebuild from)."""

    membership: Membership

    def state_dict(self) -> dict[str, Any]:
        return self.membership.state_dict({})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.membership.load_state_dict(state)


def run_serve_group(cfg: Config, env: Any, address: str) -> tuple[int, tuple[dict[str, Any], str] | None]:
    """``torchrun --nproc_per_node=S -m hosfl_dist.run --serve … server.ranks=S``: an elastic run's server as a group
    of S ranks (f_s sharded with FSDP2). Rank 0 serves the run (:func:`run_serve`); ranks 1..S-1 follow its
    executions on their shards. Returns (exit code, on rank 0 of a completed run its summary and folder)."""
    cfg = check_config(cfg)
    check_elastic(cfg, grouped=True)
    d = init_distributed(cfg, env, server_role_map(cfg, env.world_size))
    cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, device=str(d.device)))
    job = TorchrunJob(cfg, get_algorithm(cfg.algorithm.name), d)
    ok = False
    try:
        job.cfg = job.agree_out_dir()
        if d.rank == 0:
            out = run_serve(job.cfg, address, d=d)
            ok = True
            return 0, out
        job.server_group().follow()
        ok = True
        return 0, None
    except BaseException as exc:  # noqa: BLE001 - every failure ends the group the same way
        job.report_failure(exc)
        return (exc.exit_code if isinstance(exc, HosflError) else 1), None
    finally:
        d.shutdown(graceful=ok)


def run_serve(cfg: Config, address: str, callbacks: tuple[Callback, ...] = (), d: Any = None) -> tuple[dict[str, Any],
                                                                                                        str]:
    """Serve an elastic run over RPC until its budget (``d``: its torchrun server group); returns its summary and
    folder."""
    host, port = parse_address(address)
    with StopRequest() as stop:
        served = ElasticServer(cfg, stop, callbacks, d)
        cfg = served.cfg
        join_path = Path(cfg.job.out_dir) / JOIN_FILE
        try:
            port = port or free_port(host)
            token = secrets.token_hex(32)
            expect_token(token)
            expect_members(served.membership.caller)
            try:
                serve_rpc(host, port, cfg.server.rpc_timeout_s, token)
            except (RuntimeError, OSError) as exc:  # the port is taken, the host is not this machine's
                first = first_line(exc)
                raise ConfigError(f"invalid value for --address: {host}:{port} (cannot serve there: {first})") from None
            publish(served.front)
            write_join(Path(cfg.job.out_dir), host, port, token)
            c = cfg.clients
            logger.info(f"{cfg.job.name}: {cfg.algorithm.name}, elastic: serving at {host}:{port}, {c.total} clients "
                        f"({c.per_round} per round), budget {cfg.train.budget_samples} samples; workers join with "
                        f"python -m hosfl_dist.run --join {cfg.job.out_dir}")  # fmt: skip
            return served.train(), cfg.job.out_dir
        except BaseException as exc:
            if not served.front.record.finished:  # the folder says why
                served.front.record_failure(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            join_path.unlink(missing_ok=True)
            served.close()
            leave_rpc()
