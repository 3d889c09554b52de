"""The torchrun runtime: what each role builds, and how the job ends (cleanly, or on the first failure).

- rank 0, **server**: builds θs (sharded when server.ranks > 1) behind the step executor, the endpoint and the run's
  front (:class:`~hosfl_dist.runtime.front.RunFront`), publishes the front over RPC and serves until the client
  workers end the run;
- ranks 1..S-1, **server shards**: follow rank 0's executions on their FSDP shard of θs
  (:meth:`~hosfl_dist.runtime.server_group.ServerGroup.follow`);
- ranks S..W-1, **client workers**: train (:class:`~hosfl_dist.runtime.trainer.Trainer`) over the algorithm's worker,
  which reaches the server through :class:`RPCTransport` and its peers through :class:`ProcessGroupCollective`
  (each wrapped in the emulated link with ``comm.inject_delay``), and the front through :class:`RPCControl`.

Traffic is counted per logical client on the worker that hosts it; at every evaluation the workers sum their
per-category counters and the leader hands the sums to the front, which writes the row (so rows and summary equal
the in-process runtime's). At the end every worker brings its replicas to the last round and reports the digest of
θc; summary.json lists them per worker and the run fails if they differ.

Failure: the first process that raises claims the failure in the rendezvous store and logs its error (a remote
error carries the server's traceback); the others log one line. It tells the front (summary.json records status
"failed" and the error), leaves RPC without waiting for peers and exits non-zero; torchrun then stops the rest of
the job.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import traceback
from typing import Any

from hosfl_dist.algorithms import AlgorithmSpec, get_algorithm
from hosfl_dist.config import Config
from hosfl_dist.data import data_info
from hosfl_dist.errors import HosflError, Interrupted
from hosfl_dist.evaluation.client import Evaluator
from hosfl_dist.models import build_split_model
from hosfl_dist.runtime.callbacks import Callbacks
from hosfl_dist.runtime.build import (
    client_stack,
    data_sections,
    live_rounds,
    method_config,
    round_gate,
    round_plan,
    server_side,
    worker_rounds,
    worker_side,
)
from hosfl_dist.runtime.gate import FixedMembers
from hosfl_dist.runtime.checkpoint import CheckpointStore
from hosfl_dist.runtime.checks import check_config, check_fixed_runtime
from hosfl_dist.runtime.front import RunFront
from hosfl_dist.runtime.fsdp import shard_server_model
from hosfl_dist.runtime.memory import process_memory
from hosfl_dist.runtime.peers import GroupPeers
from hosfl_dist.runtime.process.groups import Distributed, init_distributed
from hosfl_dist.runtime.process.host import check_devices, set_threads
from hosfl_dist.runtime.process.launch import LaunchEnv, role_map
from hosfl_dist.runtime.process.signals import StopRequest
from hosfl_dist.runfolder.folder import chosen, resolve_out_dir, with_out_dir
from hosfl_dist.runtime.record.progress import Progress
from hosfl_dist.runtime.server_group import ServerGroup
from hosfl_dist.runtime.trainer import Trainer
from hosfl_dist.transport.endpoint import ServerEndpoint
from hosfl_dist.transport.link import describe_link
from hosfl_dist.runtime.rpc import (
    ProcessGroupCollective,
    RPCControl,
    RPCTransport,
    TransportStats,
    fetch_front,
    notify_failure,
    publish,
)
from hosfl_dist.transport.wire import CommMeter

logger = logging.getLogger(__name__)


def run_torchrun(cfg: Config, env: LaunchEnv) -> tuple[int, tuple[dict[str, Any], str] | None]:
    """Run this process's role until the job ends: (exit code, on rank 0 of a completed run its summary and
    folder)."""
    check_config(cfg)
    check_fixed_runtime(cfg, "torchrun")
    roles = role_map(cfg, env.world_size)  # refused here, before any process group exists
    spec = get_algorithm(cfg.algorithm.name)
    check_devices(cfg)
    d = init_distributed(cfg, env, roles)
    job = TorchrunJob(dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, device=str(d.device))), spec, d)
    ok = False
    try:
        summary = job.run()
        ok = True
        return 0, (summary, job.cfg.job.out_dir) if summary is not None else None
    except BaseException as exc:  # noqa: BLE001 - every failure ends the job the same way
        job.report_failure(exc)
        return (exc.exit_code if isinstance(exc, HosflError) else 1), None
    finally:
        if job.front is not None:
            job.front.close()
        d.shutdown(graceful=ok)


class TorchrunJob:
    """One process of a torchrun job: its role's parts, built and run."""

    def __init__(self, cfg: Config, spec: AlgorithmSpec, d: Distributed) -> None:
        self.cfg = cfg
        self.spec = spec
        self.d = d
        self.front: RunFront | None = None
        """Rank 0's front, once built (a failure is recorded through it)."""

    def run(self) -> dict[str, Any] | None:
        self.cfg = self.agree_out_dir()
        d = self.d
        with StopRequest() as stop:
            if d.rank == 0:
                return self.serve(stop)
            if d.rank in d.roles.server_ranks:
                self.server_group().follow()
            else:
                self.work(stop)
        return None

    # -- roles -------------------------------------------------------------------------------------------------------
    def serve(self, stop: StopRequest) -> dict[str, Any]:
        """Rank 0: build the server side, publish the front, serve until the workers end the run, conclude it."""
        cfg, d, roles = self.cfg, self.d, self.d.roles
        logger.info(roles.describe())
        logger.info(f"gloo and TensorPipe bound to {d.interface or 'the interface torch chooses'} (job.interface)")
        servers = self.server_group()
        logger.info(f"run folder {cfg.job.out_dir}")
        layout = {
            "world_size": roles.world_size,
            "server_ranks": list(roles.server_ranks),
            "worker_ranks": list(roles.worker_ranks),
        }
        described = {
            **layout,
            "hosted": {f"worker_{r}": list(ids) for r, ids in roles.hosted.items()},
            "interface": d.interface,
        }
        endpoint = ServerEndpoint(servers.server, servers.execute, servers.evaluator)
        gate = None
        if live_rounds(cfg):  # server.round_timeout_s: the gate decides each round from who answers in time
            gate = round_gate(cfg, servers.server, endpoint, FixedMembers(roles.hosted), auto_open=True)
        callbacks = Callbacks.of(cfg.job.callbacks)  # the start, the rows, the checkpoints and the end are rank 0's
        self.front = RunFront(cfg, endpoint, servers, servers.store, "torchrun", layout, "server", described, callbacks)
        self.front.open(restarted=d.env.restart > 0)
        if gate is not None:
            gate.start_at(self.front.resume[0].round if self.front.resume else 0)
        publish(self.front)
        self.front.wait(stop)
        return self.front.conclude()

    def server_group(self) -> ServerGroup:
        """A server rank's executor over the method's server on f_s (sharded over the server group before its weights
        exist), from ``job.seed``. Of f_c only the trainable tensors are materialised (θc^0: HO-SFL's base replica,
        the baselines' θc^t); no training data is loaded."""
        cfg, spec, d = self.cfg, self.spec, self.d
        group = d.server_group
        reshard = cfg.server.reshard_after_forward
        shard = (lambda module: shard_server_model(module, group, d.device, reshard)) if group is not None else None
        info = data_info(data_sections(cfg))
        split = build_split_model(cfg, info, spec.zeroth_order_client, parts=("server",), shard=shard)
        threads, why = set_threads(cfg, sum(p.numel() for p in split.server.parameters()))
        logger.info(f"threads: {threads} intra-op ({why})")
        server, evaluator = server_side(cfg, spec, split, group)
        split.keep(spec.server_parts)  # the server copied what it needs of the others (HO-SFL: θc^0)
        return ServerGroup(server, evaluator, group, CheckpointStore(cfg.job.out_dir, cfg.checkpoint.keep, group))

    def work(self, stop: StopRequest) -> None:
        """A client worker: its clients' shards (+ evaluation for the leader), f_c, the transport stack; train."""
        cfg, spec, d = self.cfg, self.spec, self.d
        roles, rank = d.roles, d.rank
        leader = rank == roles.leader
        data, split, (threads, why) = worker_side(cfg, spec, roles.hosted[rank], leader)
        if leader:
            logger.info(f"threads: {threads} intra-op per worker ({why})")
            if cfg.comm.inject_delay:
                logger.info(describe_link(cfg.comm))
        meter, stats = CommMeter(), TransportStats()
        group = ProcessGroupCollective(d.worker_group, leader, d.worker_device or d.device, meter, stats)
        front = fetch_front(cfg.server.rpc_timeout_s, d.token)
        rpc = RPCTransport(front, cfg.server.rpc_timeout_s, stats, d.token)
        transport, collective, link = client_stack(cfg, spec, rpc, group, meter)
        rounds = None
        if live_rounds(cfg):  # decided at the server's gate: this worker runs the sampled clients it hosts
            hosted, draw = set(roles.hosted[rank]), round_plan(cfg).participation

            def clients_of(t: int) -> tuple[int, ...]:
                return tuple(sorted(m for m in draw.sampled(t) if m in hosted))

            rounds = worker_rounds(cfg, transport, meter, clients_of, leader)
        worker = spec.worker(method_config(cfg), split, data, roles.hosted[rank], transport, collective, rounds)
        trainer = Trainer(
            cfg,
            worker,
            rank=rank,
            peers=GroupPeers(group, d),
            control=RPCControl(front, cfg.server.rpc_timeout_s, d.token),
            meter=meter,
            stop=stop,
            memory=lambda: process_memory(rank, "worker", split.client, split.server),
            evaluator=Evaluator(worker) if leader else None,
            progress=Progress(cfg) if leader else None,
            stats=stats,
            link=link,
            callbacks=Callbacks.of(cfg.job.callbacks) if leader else None,  # the leader's: on_round_end
        )
        outcome = trainer.train()
        if not outcome.completed:  # stopped by a signal, after the checkpoint
            raise Interrupted(f"{stop.signal or 'a signal to another worker'}: stopped after round {outcome.rounds}")

    def agree_out_dir(self) -> Config:
        """Every rank's ``job.out_dir``: the user's, or the folder rank 0 makes for this run (runs/<job.name>/<start
        time>, see :mod:`hosfl_dist.runfolder.folder`), handed to the others through the store."""
        cfg, d = self.cfg, self.d
        if chosen(cfg):
            return cfg
        if d.rank == 0:
            cfg = resolve_out_dir(cfg, restarted=d.env.restart > 0, pin=d.env.invocation)  # a restart: its own
            d.put("hosfl/out_dir", cfg.job.out_dir)
            return cfg
        return with_out_dir(cfg, d.get("hosfl/out_dir", cfg.server.rpc_timeout_s))

    # -- failure -----------------------------------------------------------------------------------------------------
    def report_failure(self, exc: BaseException) -> None:
        d = self.d
        first = _claim_failure(d)
        message = f"{d.roles.label(d.rank)}: {_one_line(exc)}"
        if isinstance(exc, Interrupted):  # an orderly stop after a checkpoint: no failure to report
            logger.warning(f"interrupted: {exc}")
            return
        if first:
            if isinstance(exc, HosflError):
                logger.error(f"error: {exc}")
            else:
                text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                logger.error(f"error:\n{text.rstrip()}")
        else:
            logger.warning(f"stopping: another process of the job failed first (here: {type(exc).__name__})")
        if self.front is not None:  # rank 0 itself: record the failure in summary.json
            self.front.record_failure(message)
        elif d.rpc_up:  # every failing process tells the front, which records the first to arrive: a claim in the
            notify_failure(message, d.token)  # store made by something outside the job cannot hide the real error


def _claim_failure(d: Distributed) -> bool:
    """True for exactly one process of the job: the first to fail, which shows its error. The key is named after the
    job's token, so a process outside the job cannot claim it first."""
    store = d.store()
    if store is None:
        return True
    key = hashlib.sha256(f"failed:{d.token}".encode()).hexdigest()[:24]
    try:
        return store.add(f"hosfl/failed/{d.env.restart}/{key}", 1) == 1
    except Exception:  # noqa: BLE001 - store gone with its host: report rather than stay silent
        return True


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    if len(lines) > 1 and lines[0].startswith("On WorkerInfo"):  # a remote error: "On WorkerInfo(...):\nError(...)"
        lines = [f"{lines[0]} {lines[1]}"]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]
