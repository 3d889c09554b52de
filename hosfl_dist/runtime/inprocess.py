"""The in-process runtime: the server and all M logical clients in one process, through the algorithm code that
the torchrun runtime runs (laptops, tests, sweeps).

    summary = run_in_process(cfg)        # InProcessRunner(cfg).setup().run(): setup -> train -> cleanup
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hosfl_dist.algorithms import get_algorithm
from hosfl_dist.algorithms.base import ServerBase, WorkerBase
from hosfl_dist.config import Config
from hosfl_dist.data import FederatedData, build_data
from hosfl_dist.models import SplitModel, build_split_model
from hosfl_dist.errors import ConfigError, Interrupted, ProtocolError
from hosfl_dist.runtime.checkpoint import Checkpointer, LoopState
from hosfl_dist.runtime.env import StopRequest, check_devices, set_threads
from hosfl_dist.runtime.loop import train_loop
from hosfl_dist.measure.tracker import process_memory
from hosfl_dist.runtime.outputs import (
    RunWriter,
    announce,
    metrics_row,
    prepare_out_dir,
    progress_bar,
    run_summary,
    show_eval,
)
from hosfl_dist.runtime.run_dir import chosen, resolve_out_dir
from hosfl_dist.transport import Collective, Transport
from hosfl_dist.transport.endpoint import ServerEndpoint
from hosfl_dist.transport.inprocess import InProcessTransport, LocalCollective
from hosfl_dist.transport.link import DelayedCollective, DelayedTransport, describe_link, describe_traffic
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
        self.rounds: int | None = None
        self.stop = StopRequest()
        self.threads_before: int | None = None

    def setup(self) -> InProcessRunner:
        check_devices(self.cfg)
        if not chosen(self.cfg):  # runs/<job.name>/<start time>, and latest -> it
            self.cfg = resolve_out_dir(self.cfg)
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
        self.checkpointer = Checkpointer(cfg.job.out_dir, cfg.checkpoint.keep)
        return self

    def resume(self, path: Path) -> LoopState:
        """Restore the server, the worker (replicas rebuilt from the history) and the counters from a checkpoint."""
        loop, workers, meta = self.checkpointer.load(self.server, path)
        if meta["engine"] != "in_process":
            raise ConfigError(f"checkpoint {path} was written by the {meta['engine']} runtime; resume it there")
        part = workers["0"]
        payload = self.server.resume_payload(sorted(self.worker.hosted), leader=True)
        self.worker.load_state_dict(part["worker"], payload)
        self.meter.load_state_dict(part["meter"])
        self.endpoint.closed = loop.round
        return loop

    def save(self, t: int, processed: int) -> Path:
        self.worker.quiesce()
        loop = LoopState(t, processed, self.writer.wall_s if self.writer is not None else 0.0)
        part = {"worker": self.worker.state_dict(), "meter": self.meter.state_dict()}
        meta = {"engine": "in_process", "algorithm": self.cfg.algorithm.name, "workers": 1}
        return self.endpoint.locked(lambda: self.checkpointer.save(self.server, loop, {"0": part}, meta))

    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        ckpt = prepare_out_dir(cfg)
        start = self.resume(ckpt) if ckpt is not None else None
        self.writer = writer = RunWriter(
            cfg, "in_process", start.round if start else None, start.wall_s if start else 0.0, str(ckpt or "")
        )
        params = sum(p.numel() for m in (self.split.client, self.split.server) for p in m.parameters())
        self.threads_before = torch.get_num_threads()  # restored by cleanup: a library call leaves the process as is
        threads, why = set_threads(cfg, params)
        c = cfg.clients
        announce([
            f"{cfg.job.name}: {cfg.algorithm.name} in one process, {c.total} clients ({c.per_round} per round), "
            f"budget {cfg.train.budget_samples} samples; run folder {cfg.job.out_dir}",
            f"threads: {threads} intra-op ({why})",
            *([describe_link(cfg.comm)] if self.link is not None else []),
        ])  # fmt: skip
        self.bar = progress_bar(cfg)
        every, last = cfg.checkpoint.interval_samples, [start.processed if start else 0]

        def on_eval(t: int, processed: int) -> None:
            row = self.endpoint.locked(lambda: metrics_row(self.server, t, processed, self.meter.snapshot()))
            show_eval(self.bar, writer.log(row))

        def after_round(t: int, processed: int) -> bool:
            if (every and processed // every > last[0] // every) or self.stop.signal:
                self.saved = self.save(t, processed)
                last[0] = processed
            return self.stop.signal is not None

        self.saved: Path | None = None
        with self.stop:
            self.rounds, processed = train_loop(cfg, self.worker, on_eval, self.bar, start, after_round)
        server_stats = self.endpoint.stats()  # the rounds and their evaluations, not the final catch-up below
        if self.stop.signal is not None:
            writer.interrupt(f"{self.stop.signal} after round {self.rounds}", self.rounds, str(self.saved))
            raise Interrupted(f"{self.stop.signal}: stopped after round {self.rounds}; checkpoint {self.saved} "
                              "(resume with job.resume=auto)")  # fmt: skip
        if self.bar is not None:
            self.bar.close()
        announce([f"budget reached after {self.rounds} rounds: bringing the {cfg.clients.total} client replicas up to "
                  "date (Algorithm 3), checking them against the server, writing summary.json"])  # fmt: skip
        self.worker.sync_all(self.rounds)
        digests = {"worker_0": self.worker.client_digest()}
        problem = self.server.audit(self.rounds, digests)
        if problem is not None:
            raise ProtocolError(f"end-of-run check: {problem}")
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
            announce([describe_traffic(summary["link"])])
        summary["memory"] = [process_memory(0, "in-process", self.split.client, self.split.server)]
        summary["transport"] = {"server": server_stats}
        return writer.complete(summary)

    def cleanup(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)
        if self.link is not None:
            self.link.close()

    def run(self) -> dict[str, Any]:
        """Train and clean up (after :meth:`setup`); a failure is recorded in summary.json before it propagates."""
        try:
            return self.train()
        except BaseException as exc:
            if self.writer is not None and not self.writer.finished:
                self.writer.fail(f"{type(exc).__name__}: {exc}", self.rounds)
            raise
        finally:
            self.cleanup()


def run_in_process(cfg: Config) -> dict[str, Any]:
    """Set up, train and clean up one in-process run; returns its summary."""
    return InProcessRunner(cfg).setup().run()
