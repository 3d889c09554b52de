"""The in-process runtime: the server and all M logical clients in one process (laptops, tests, sweeps).

    summary = run_in_process(cfg)        # InProcessRunner(cfg).setup().run(): setup -> train -> cleanup

Callbacks (``job.callbacks``, and those handed to the runner by :func:`hosfl_dist.train`) are the front's and the
worker's alike: this process owns every event.

The same parts as under torchrun, in one process: the server behind an endpoint and the run's front, one worker
hosting every client, reaching the server through direct calls (:class:`InProcessTransport`) and the front through
:class:`LocalControl`; :class:`~hosfl_dist.runtime.trainer.Trainer` drives the run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from hosfl_dist.algorithms import get_algorithm
from hosfl_dist.algorithms.base import ServerBase, WorkerBase
from hosfl_dist.config import Config
from hosfl_dist.data import FederatedData, build_data
from hosfl_dist.evaluation.client import Evaluator
from hosfl_dist.models import SplitModel, build_split_model
from hosfl_dist.runtime.callbacks import Callback, Callbacks
from hosfl_dist.runtime.build import client_stack, data_sections, method_config, server_side
from hosfl_dist.runtime.checkpoint import CheckpointStore
from hosfl_dist.runtime.checks import check_config, check_fixed_runtime
from hosfl_dist.runtime.front import LocalControl, RunFront
from hosfl_dist.runtime.memory import process_memory
from hosfl_dist.runtime.peers import LocalPeers
from hosfl_dist.runtime.process.host import check_devices, resumed_threads, set_threads
from hosfl_dist.runtime.process.signals import StopRequest
from hosfl_dist.runfolder.folder import chosen, resolve_out_dir
from hosfl_dist.runtime.record.progress import Progress
from hosfl_dist.runtime.server_group import ServerGroup
from hosfl_dist.runtime.trainer import Trainer
from hosfl_dist.transport.endpoint import ServerEndpoint
from hosfl_dist.transport.inprocess import InProcessTransport, LocalCollective
from hosfl_dist.transport.link import describe_link
from hosfl_dist.transport.wire import CommMeter

logger = logging.getLogger(__name__)


class InProcessRunner:
    """One process, one worker hosting every client; the server behind an endpoint like under torchrun."""

    def __init__(self, cfg: Config, callbacks: Iterable[Callback] = ()) -> None:
        self.cfg = check_config(cfg)
        check_fixed_runtime(cfg)
        self.callbacks = Callbacks.of(cfg.job.callbacks, callbacks)
        self.spec = get_algorithm(cfg.algorithm.name)
        self.meter = CommMeter()
        self.stop = StopRequest()
        self.trainer: Trainer | None = None
        self.threads_before: int | None = None

    def setup(self) -> InProcessRunner:
        check_devices(self.cfg)
        if not chosen(self.cfg):  # runs/<job.name>/<start time>, and latest -> it
            self.cfg = resolve_out_dir(self.cfg)
        cfg, spec = self.cfg, self.spec
        self.data: FederatedData = build_data(data_sections(cfg))
        self.split: SplitModel = build_split_model(cfg, self.data.info, spec.zeroth_order_client)
        self.server: ServerBase
        self.server, self.evaluator = server_side(cfg, spec, self.split)
        store = CheckpointStore(cfg.job.out_dir, cfg.checkpoint.keep)
        self.servers = ServerGroup(self.server, self.evaluator, store=store)
        self.endpoint = ServerEndpoint(self.server, self.servers.execute, self.evaluator)
        self.front = RunFront(
            cfg, self.endpoint, self.servers, store, "in_process", {"workers": 1}, callbacks=self.callbacks
        )
        transport, collective, self.link = client_stack(
            cfg, spec, InProcessTransport(self.endpoint), LocalCollective(self.meter), self.meter
        )
        hosted = range(cfg.clients.total)
        self.worker: WorkerBase = spec.worker(method_config(cfg), self.split, self.data, hosted, transport, collective)
        return self

    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        params = sum(p.numel() for m in (self.split.client, self.split.server) for p in m.parameters())
        self.threads_before = torch.get_num_threads()  # restored by cleanup: a library call leaves the process as is
        # before open(): the threads are part of the run's identity (a resume takes its checkpoint's where auto)
        threads, why = set_threads(cfg, params, recorded=resumed_threads(cfg))
        self.front.open()
        c = cfg.clients
        logger.info(f"{cfg.job.name}: {cfg.algorithm.name} in one process, {c.total} clients ({c.per_round} per "
                    f"round), budget {cfg.train.budget_samples} samples; run folder {cfg.job.out_dir}")  # fmt: skip
        logger.info(f"threads: {threads} intra-op ({why})")
        if self.link is not None:
            logger.info(describe_link(cfg.comm))
        split = self.split
        self.trainer = Trainer(
            cfg,
            self.worker,
            rank=0,
            peers=LocalPeers(),
            control=LocalControl(self.front),
            meter=self.meter,
            stop=self.stop,
            memory=lambda: process_memory(0, "in-process", split.client, split.server),
            evaluator=Evaluator(self.worker),
            progress=Progress(cfg),
            link=self.link,
            callbacks=self.callbacks,
        )
        with self.stop:
            self.trainer.train()
        return self.front.conclude()  # an interrupted run raises Interrupted here, after recording it

    def cleanup(self) -> None:
        self.front.close()
        if self.trainer is not None:
            self.trainer.cleanup()
        elif self.link is not None:
            self.link.close()
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)

    def run(self) -> dict[str, Any]:
        """Train and clean up (after :meth:`setup`); a failure is recorded in summary.json before it propagates, a
        KeyboardInterrupt (Ctrl-C a second time, or raised by a callback) as an interruption without a checkpoint of
        its own, as the command line says it."""
        try:
            return self.train()
        except BaseException as exc:
            if self.front.record is not None and not self.front.record.finished:
                rounds = self.trainer.round if self.trainer is not None else None
                if isinstance(exc, KeyboardInterrupt):
                    self.front.record_interrupt(rounds)
                else:
                    self.front.record_failure(f"{type(exc).__name__}: {exc}", rounds)
            raise
        finally:
            self.cleanup()


def run_in_process(cfg: Config, callbacks: Iterable[Callback] = ()) -> dict[str, Any]:
    """Set up, train and clean up one in-process run; returns its summary."""
    return InProcessRunner(cfg, callbacks).setup().run()
