"""The in-process runtime: the server and all M logical clients in one process, through the algorithm code that
the torchrun runtime runs (laptops, tests, sweeps).

    summary = run_in_process(cfg)        # InProcessRunner(cfg).setup().run(): setup -> train -> cleanup
"""

from __future__ import annotations

from typing import Any

from hosfl_dist.algorithms import get_algorithm
from hosfl_dist.algorithms.base import ServerBase, WorkerBase
from hosfl_dist.config import Config
from hosfl_dist.data import FederatedData, build_data
from hosfl_dist.models import SplitModel, build_split_model
from hosfl_dist.runtime.loop import train_loop
from hosfl_dist.runtime.outputs import RunWriter, metrics_row, progress_bar, run_summary
from hosfl_dist.transport import Collective, Transport
from hosfl_dist.transport.endpoint import ServerEndpoint
from hosfl_dist.transport.inprocess import InProcessTransport, LocalCollective
from hosfl_dist.transport.link import DelayedCollective, DelayedTransport
from hosfl_dist.transport.metered import MeteredTransport
from hosfl_dist.transport.wire import CommMeter


class InProcessRunner:
    """One process, one worker hosting every client; the server behind an endpoint like under torchrun."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.spec = get_algorithm(cfg.algorithm.name)
        self.meter = CommMeter()
        self.writer: RunWriter | None = None
        self.link: DelayedTransport | None = None
        self.bar: Any = None

    def setup(self) -> InProcessRunner:
        cfg = self.cfg
        self.data: FederatedData = build_data(cfg)
        self.split: SplitModel = build_split_model(cfg, self.data.info, self.spec.zeroth_order_client)
        self.server: ServerBase = self.spec.server(cfg, self.split)
        self.endpoint = ServerEndpoint(self.server)
        transport: Transport = InProcessTransport(self.endpoint)
        collective: Collective = LocalCollective(self.meter)
        if cfg.comm.inject_delay:  # emulate the client-server link (App. C.1) to measure latency hiding
            transport = self.link = DelayedTransport(transport, cfg.comm)
            collective = DelayedCollective(collective, self.link)
        transport = MeteredTransport(transport, self.spec.server, self.meter)
        hosted = range(cfg.clients.total)
        self.worker: WorkerBase = self.spec.worker(cfg, self.split, self.data, hosted, transport, collective)
        return self

    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        self.writer = writer = RunWriter(cfg)
        self.bar = progress_bar(cfg)

        def on_eval(t: int, processed: int) -> None:
            writer.log(self.endpoint.locked(lambda: metrics_row(self.server, t, processed, self.meter.snapshot())))

        self.rounds, processed = train_loop(cfg, self.worker, on_eval, self.bar)
        self.worker.sync_all(self.rounds)
        digests = {"worker_0": self.worker.client_digest()}
        summary = run_summary(
            cfg,
            writer,
            "in_process",
            self.rounds,
            processed,
            self.meter.snapshot(),
            digests,
            self.server.server_digest(),
        )
        if self.link is not None:
            summary["link"] = self.link.summary()
        return writer.complete(summary)

    def cleanup(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.link is not None:
            self.link.close()

    def run(self) -> dict[str, Any]:
        """Train and clean up (after :meth:`setup`); a failure is recorded in summary.json before it propagates."""
        try:
            return self.train()
        except BaseException as exc:
            if self.writer is not None and not self.writer.finished:
                self.writer.fail(f"{type(exc).__name__}: {exc}", getattr(self, "rounds", None))
            raise
        finally:
            self.cleanup()


def run_in_process(cfg: Config) -> dict[str, Any]:
    """Set up, train and clean up one in-process run; returns its summary."""
    return InProcessRunner(cfg).setup().run()
