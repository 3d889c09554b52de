"""What both runtimes build the same way: the server side's objects and a client worker's transport stack."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from hosfl_dist.algorithms import AlgorithmSpec
from hosfl_dist.config import Config
from hosfl_dist.evaluation.server import EvalServer
from hosfl_dist.models import SplitModel
from hosfl_dist.runtime.server_compute import GroupCompute
from hosfl_dist.transport import Collective, Transport
from hosfl_dist.transport.link import DelayedCollective, DelayedTransport
from hosfl_dist.transport.metered import MeteredTransport
from hosfl_dist.transport.wire import CommMeter


def server_side(
    cfg: Config, spec: AlgorithmSpec, split: SplitModel, group: dist.ProcessGroup | None = None
) -> tuple[Any, EvalServer]:
    """The method's server over f_s with its compute (on this rank, or over the server ranks' ``group``), and the
    evaluation server beside it (the same module). After any sharding: the optimizer must see the sharded
    parameters."""
    server = spec.server(cfg, split, GroupCompute(split.server, split.task, cfg.server, group))
    return server, EvalServer(server.model, split.task)


def served(spec: AlgorithmSpec) -> tuple[type, ...]:
    """The classes whose declared calls a worker's transport counts: the method's server and the evaluation server."""
    return (spec.server, EvalServer)


def client_stack(
    cfg: Config, spec: AlgorithmSpec, transport: Transport, collective: Collective, meter: CommMeter
) -> tuple[Transport, Collective, DelayedTransport | None]:
    """A worker's transport and collective: the emulated client-server link around them with ``comm.inject_delay``
    (App. C.1), and the traffic meter outermost, so it counts what the algorithm sends. Returns the link too (its
    summary goes into summary.json; the runtime closes it)."""
    link = None
    if cfg.comm.inject_delay:
        transport = link = DelayedTransport(transport, cfg.comm)
        collective = DelayedCollective(collective, link)
    return MeteredTransport(transport, served(spec), meter), collective, link
