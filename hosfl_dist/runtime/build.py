"""What every runtime builds the same way: the server side's objects, a client worker's transport stack, and the
parts of live rounds (the gate on the server, a worker's rounds)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from hosfl_dist.algorithms import AlgorithmSpec
from hosfl_dist.algorithms.base import MethodConfig, RoundPlan
from hosfl_dist.config import Config
from hosfl_dist.data import DataSections, FederatedData, build_data
from hosfl_dist.evaluation.server import EvalServer
from hosfl_dist.models import SplitModel, build_split_model
from hosfl_dist.runtime.gate import RoundGate, RoundService
from hosfl_dist.runtime.live import LiveRounds
from hosfl_dist.runtime.process.host import set_threads
from hosfl_dist.runtime.server_compute import GroupCompute
from hosfl_dist.transport import Collective, Transport
from hosfl_dist.transport.client import ClientTransport
from hosfl_dist.transport.endpoint import ServerEndpoint
from hosfl_dist.transport.link import DelayedCollective, DelayedTransport, client_speed
from hosfl_dist.transport.metered import MeteredTransport
from hosfl_dist.transport.stub import ServerStub
from hosfl_dist.transport.wire import CommMeter


def method_config(cfg: Config) -> MethodConfig:
    """The sections of the run's config its method's server and worker are built from."""
    return MethodConfig(cfg.algorithm, cfg.clients, cfg.server, cfg.zo, cfg.train, cfg.model, cfg.job.seed)


def data_sections(cfg: Config) -> DataSections:
    """The sections of the run's config its data is built from (``hosfl_dist.data.build_data``, ``data_info``)."""
    return DataSections(cfg.data, cfg.model, cfg.clients, cfg.job.seed)


def worker_side(
    cfg: Config, spec: AlgorithmSpec, hosted: Any, evaluation: bool
) -> tuple[FederatedData, SplitModel, tuple[int, str]]:
    """A client worker's data (the shards of ``hosted``; the evaluation split where it evaluates) and the parts of the
    split it holds, its intra-op threads set from their size: (data, split, (threads, why))."""
    data = build_data(data_sections(cfg), clients=hosted, evaluation=evaluation)
    split = build_split_model(cfg, data.info, spec.zeroth_order_client, parts=spec.worker_parts)
    split.keep(spec.worker_parts)
    held = [m for m in (split.client, split.server) if m is not None]
    return data, split, set_threads(cfg, sum(p.numel() for m in held for p in m.parameters()))


def round_plan(cfg: Config) -> RoundPlan:
    """The run's rounds and who takes part in each, as its server and workers hold them."""
    return RoundPlan.of(method_config(cfg))


def server_side(
    cfg: Config, spec: AlgorithmSpec, split: SplitModel, group: dist.ProcessGroup | None = None
) -> tuple[Any, EvalServer]:
    """The method's server over f_s with its compute (on this rank, or over the server ranks' ``group``), and the
    evaluation server beside it (the same module). After any sharding: the optimizer must see the sharded
    parameters."""
    server = spec.server(method_config(cfg), split, GroupCompute(split.server, split.task, cfg.server, group))
    return server, EvalServer(server.model, split.task)


def served(spec: AlgorithmSpec) -> tuple[type, ...]:
    """The classes whose declared calls a worker's transport counts: the method's server, the evaluation server, and
    the round gate's service (live rounds)."""
    return (spec.server, EvalServer, RoundService)


def client_stack(
    cfg: Config, spec: AlgorithmSpec, transport: Transport, collective: Collective, meter: CommMeter
) -> tuple[ClientTransport, Collective, DelayedTransport | None]:
    """A worker's transport and collective: the emulated client-server link around them with ``comm.inject_delay``
    (App. C.1; each client's own speed with ``comm.speed_spread``), and the traffic meter outermost, so it counts
    what the algorithm sends. Returns the link too (its summary goes into summary.json; the runtime closes it)."""
    link = None
    if cfg.comm.inject_delay:
        speed = (lambda m: client_speed(cfg.comm, cfg.job.seed, m)) if cfg.comm.speed_spread else None
        transport = link = DelayedTransport(transport, cfg.comm, speed=speed)
        collective = DelayedCollective(collective, link)
    return ClientTransport(MeteredTransport(transport, served(spec), meter)), collective, link


def live_rounds(cfg: Config) -> bool:
    """Whether rounds are decided live at the server's gate under torchrun (``server.round_timeout_s`` > 0, not
    replaying a record)."""
    return bool(cfg.server.round_timeout_s) and not cfg.clients.participation


def round_gate(cfg: Config, server: Any, endpoint: ServerEndpoint, members: Any, auto_open: bool) -> RoundGate:
    """The round gate of a run whose rounds are decided live, in ``endpoint``."""
    return RoundGate(server, endpoint, members, per_round=cfg.clients.per_round, timeout_s=cfg.server.round_timeout_s,
                     width=cfg.zo.num_perturbations, on_nonfinite=cfg.train.on_nonfinite,
                     auto_open=auto_open)  # fmt: skip


def worker_rounds(
    cfg: Config, transport: ClientTransport, meter: CommMeter, clients_of: Any, is_leader: bool, counts: Any = None
) -> LiveRounds:
    """A worker's live rounds over its transport (the gate's ``close`` leaves in the same messages as its calls)."""
    return LiveRounds(ServerStub(RoundService, transport).close, clients_of, meter, is_leader, counts)
