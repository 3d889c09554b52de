"""``python -m hosfl_dist.run --config X --serve [--address HOST:PORT]``: the server of an elastic run, which client
workers join and leave while it runs (``--join RUN_DIR``; see :mod:`hosfl_dist.runtime.elastic`).

The process holds what rank 0 holds under torchrun (θs behind the endpoint, the run's front and record) and, for
the metrics rows, an evaluation worker of its own (θc of round t from the server's history, the held-out split), so
that evaluation does not depend on which workers are there. It writes ``join.json`` (address and token, readable by
its owner only) into the run folder while it serves, and removes it at the end.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import socket
from pathlib import Path
from typing import Any

import torch

from hosfl_dist.algorithms import get_algorithm
from hosfl_dist.config import Config
from hosfl_dist.data import build_data
from hosfl_dist.errors import ConfigError, Interrupted, first_line
from hosfl_dist.evaluation.client import Evaluator
from hosfl_dist.models import build_split_model
from hosfl_dist.runfolder.folder import chosen, resolve_out_dir
from hosfl_dist.runtime.build import client_stack, server_side
from hosfl_dist.runtime.checkpoint import CheckpointStore
from hosfl_dist.runtime.checks import check_config
from hosfl_dist.runtime.control import EvalReport, FinalReport
from hosfl_dist.runtime.elastic import entry
from hosfl_dist.runtime.elastic.coordinator import Coordinator
from hosfl_dist.runtime.elastic.membership import free_port, leave_rpc, serve_rpc
from hosfl_dist.runtime.elastic.worker import JOIN_FILE
from hosfl_dist.runtime.front import RunFront
from hosfl_dist.runtime.memory import process_memory
from hosfl_dist.runtime.process.host import check_devices, set_threads
from hosfl_dist.runtime.process.signals import StopRequest
from hosfl_dist.runtime.record.progress import Progress
from hosfl_dist.runtime.rpc import expect_token
from hosfl_dist.runtime.server_group import ServerGroup
from hosfl_dist.runtime.trainer import eval_points
from hosfl_dist.transport.endpoint import ServerEndpoint
from hosfl_dist.transport.inprocess import InProcessTransport, LocalCollective
from hosfl_dist.transport.wire import CommMeter

logger = logging.getLogger(__name__)

ELASTIC_METHODS = ("hosfl",)


def check_elastic(cfg: Config) -> None:
    """What an elastic run refuses, in one line each, before anything is built."""
    if cfg.algorithm.name not in ELASTIC_METHODS:
        raise ConfigError(f"invalid value for algorithm.name: {cfg.algorithm.name!r} with --serve (elastic runs "
                          f"support {', '.join(ELASTIC_METHODS)}; the baselines run with dropout emulated: "
                          "clients.dropout)")  # fmt: skip
    if cfg.clients.dropout or cfg.clients.participation:
        key = "clients.dropout" if cfg.clients.dropout else "clients.participation"
        raise ConfigError(f"invalid value for {key}: it emulates who takes part; with --serve the workers that "
                          "answer decide it (set it to its default)")  # fmt: skip
    if cfg.server.ranks != 1:
        raise ConfigError("invalid value for server.ranks: --serve runs the server in one process (server.ranks=1)")
    if cfg.comm.speed_spread and not cfg.comm.inject_delay:
        raise ConfigError(f"invalid value for comm.speed_spread: {cfg.comm.speed_spread:g} (per-client links are "
                          "emulated with comm.inject_delay=true)")  # fmt: skip
    if cfg.zo.batch_clients:
        raise ConfigError("invalid value for zo.batch_clients: true (an elastic worker serves its clients one by one; "
                          "set it to false with --serve)")  # fmt: skip
    if cfg.checkpoint.interval_samples:
        raise ConfigError("invalid value for checkpoint.interval_samples: elastic runs write no checkpoints yet "
                          "(checkpoint.interval_samples=0)")  # fmt: skip


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"invalid value for --address: {text!r} (HOST:PORT, e.g. 127.0.0.1:29600; port 0 picks one)")
    return host, int(port)


class ElasticServer:
    """The server side of an elastic run, built and its folder opened: the method's server behind its endpoint, the
    run's front, the evaluation worker and the :class:`Coordinator` (which :meth:`train` drives). How workers reach
    it is the caller's: RPC under ``--serve`` (:func:`run_serve`), direct calls in tests."""

    def __init__(self, cfg: Config, stop: Any = None) -> None:
        cfg = check_config(cfg)
        check_elastic(cfg)
        check_devices(cfg)
        if not chosen(cfg):
            cfg = resolve_out_dir(cfg)
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, final=False))
        self.cfg = cfg
        spec = get_algorithm(cfg.algorithm.name)
        data = build_data(cfg, clients=[], evaluation=True)
        self.split = split = build_split_model(cfg, data.info, spec.zeroth_order_client)
        self.server, evaluator = server_side(cfg, spec, split)
        store = CheckpointStore(cfg.job.out_dir, cfg.checkpoint.keep)
        servers = ServerGroup(self.server, evaluator, store=store)
        self.endpoint = ServerEndpoint(self.server, servers.execute, evaluator)
        self.meter = meter = CommMeter()
        self.front = RunFront(cfg, self.endpoint, servers, store, "elastic", {"workers": "elastic"}, "server",
                              {"server": "elastic, --serve"})  # fmt: skip
        transport, collective, _ = client_stack(cfg, spec, InProcessTransport(self.endpoint), LocalCollective(meter),
                                                meter)  # fmt: skip
        self.evaluating = spec.worker(cfg, split, data, [], transport, collective)
        params = sum(p.numel() for m in (split.client, split.server) for p in m.parameters())
        self.threads_before = torch.get_num_threads()  # restored by close: the process is left as it was
        threads, why = set_threads(cfg, params)
        self.front.open()
        logger.info(f"threads: {threads} intra-op ({why})")
        self.progress = Progress(cfg)
        self.coordinator = Coordinator(cfg, self.endpoint, meter, self._evaluate, stop)
        record = self.front.record
        record.participation.plan = self.server.round_plan.participation  # the rounds as the coordinator decides them
        record.participation.workers = self.coordinator.totals

    def _evaluate(self, t: int, processed: int) -> None:
        self.progress.advance_to(processed)
        Evaluator(self.evaluating).evaluate(t)
        shown = self.front.handle(EvalReport(t, processed, self.meter.snapshot()))
        self.progress.show(shown)

    def train(self) -> dict[str, Any]:
        """Rounds until the budget, the workers' digests, the summary (checked against the server's replay)."""
        cfg, coordinator = self.cfg, self.coordinator
        try:
            budget = cfg.train.budget_samples
            rounds, processed = coordinator.run(budget, eval_points(budget, cfg.train.eval_every_samples))
            self.progress.close()
            digests = {**coordinator.finish(rounds), "server_evaluation": self.evaluating.client_digest()}
            memory = [process_memory(0, "server", self.split.client, self.split.server)]
            timing = {"coordinator": coordinator.timing()}
            self.front.handle(FinalReport(rounds, processed, self.meter.snapshot(), digests, timing, memory))
            return self.front.conclude()
        except Interrupted as exc:
            if not self.front.record.finished:
                self.front.record.interrupt(str(exc), self.server.rounds_done, None)
            raise
        except BaseException as exc:
            if not self.front.record.finished:
                self.front.record_failure(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self.progress.close()
            (Path(cfg.job.out_dir) / "workers.json").unlink(missing_ok=True)  # its live workers: none now

    def close(self) -> None:
        self.front.close()
        torch.set_num_threads(self.threads_before)


def run_serve(cfg: Config, address: str) -> tuple[dict[str, Any], str]:
    """Serve an elastic run over RPC until its budget; returns its summary and folder."""
    host, port = parse_address(address)
    with StopRequest() as stop:
        served = ElasticServer(cfg, stop)
        cfg = served.cfg
        join_path = Path(cfg.job.out_dir) / JOIN_FILE
        try:
            port = port or free_port(host)
            token = secrets.token_hex(32)
            expect_token(token)
            try:
                serve_rpc(host, port, cfg.server.rpc_timeout_s, token)
            except (RuntimeError, OSError) as exc:  # the port is taken, the host is not this machine's
                first = first_line(exc)
                raise ConfigError(f"invalid value for --address: {host}:{port} (cannot serve there: {first})") from None
            fd = os.open(join_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                where = {"host": host, "port": port, "pid": os.getpid(), "node": socket.gethostname()}
                json.dump({**where, "token": token}, fh)
            entry.publish(served.coordinator)
            c = cfg.clients
            logger.info(f"{cfg.job.name}: {cfg.algorithm.name}, elastic: serving at {host}:{port}, {c.total} clients "
                        f"({c.per_round} per round), budget {cfg.train.budget_samples} samples; workers join with "
                        f"python -m hosfl_dist.run --join {cfg.job.out_dir}")  # fmt: skip
            return served.train(), cfg.job.out_dir
        except BaseException as exc:
            if not served.front.record.finished:  # before training started: the folder says why
                served.front.record_failure(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            join_path.unlink(missing_ok=True)
            served.close()
            leave_rpc()
