"""The torchrun runtime: what each role runs, and how the job ends (cleanly, or on the first failure).

- rank 0, **server**: builds θs (sharded when server.ranks > 1) behind a
  :class:`~hosfl_dist.transport.endpoint.ServerEndpoint`, publishes the front over RPC, writes config.yaml /
  metrics.jsonl / summary.json, and waits for the leader worker's end-of-run report;
- ranks 1..S-1, **server shards**: replay rank 0's executions on their FSDP shard of θs;
- ranks S..W-1, **client workers**: run :func:`hosfl_dist.runtime.loop.train_loop` over the algorithm's worker,
  which reaches the server through :class:`RPCTransport` and its peers through :class:`ProcessGroupCollective`
  (each wrapped in the emulated link with ``comm.inject_delay``).

Traffic is counted per logical client on the worker that hosts it; at every evaluation the workers all_reduce
their per-category counters and the leader hands the sums to the server, which writes the row (so rows and
summary equal the in-process runtime's). At the end every worker brings its replicas to the last round
(Algorithm 3) and reports the digest of θc; summary.json lists them per worker and the run fails if they differ.

Failure: the first process that raises claims the failure in the rendezvous store and prints its error (a remote
error carries the server's traceback); the others print one line. It tells the server (summary.json records
status "failed" and the error), leaves RPC without waiting for peers and exits non-zero; torchrun then stops the
rest of the job.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from hosfl_dist.algorithms import AlgorithmSpec, get_algorithm
from hosfl_dist.config import Config
from hosfl_dist.data import build_data, data_info
from hosfl_dist.errors import ConfigError, HosflError, Interrupted, ProtocolError
from hosfl_dist.measure.tracker import process_memory
from hosfl_dist.models import build_split_model
from hosfl_dist.runtime.checkpoint import Checkpointer, LoopState, rng_state, set_rng_state
from hosfl_dist.runtime.env import (
    Distributed,
    LaunchEnv,
    StopRequest,
    check_devices,
    init_distributed,
    role_map,
    set_threads,
)
from hosfl_dist.runtime.fsdp import CallBroadcast, follow, shard_server_model
from hosfl_dist.runtime.loop import train_loop
from hosfl_dist.runtime.outputs import (
    EVAL_SHOWN,
    RunWriter,
    metrics_row,
    prepare_out_dir,
    progress_bar,
    run_summary,
    show_eval,
)
from hosfl_dist.runtime.run_dir import chosen, resolve_out_dir, with_out_dir
from hosfl_dist.transport import Collective, Transport
from hosfl_dist.transport.endpoint import ServerEndpoint
from hosfl_dist.transport.link import DelayedCollective, DelayedTransport, describe_link, describe_traffic
from hosfl_dist.transport.metered import MeteredTransport
from hosfl_dist.transport.server_group import ServerGroup
from hosfl_dist.transport.rpc import (
    ProcessGroupCollective,
    RPCTransport,
    TransportStats,
    fetch_front,
    notify_failure,
    publish,
)
from hosfl_dist.transport.wire import CommMeter, wire_specs


class PeerFailure(RuntimeError):
    """Another process of the job failed; this one stops."""


def run_torchrun(cfg: Config, env: LaunchEnv) -> int:
    """Run this process's role until the job ends; returns the process exit code (0 = the whole run completed)."""
    roles = role_map(cfg, env.world_size)  # refused here, before any process group exists
    spec = get_algorithm(cfg.algorithm.name)
    check_devices(cfg)
    d = init_distributed(cfg, env, roles)
    cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, device=str(d.device)))
    state: dict[str, Any] = {}
    ok = False
    try:
        cfg = _agree_out_dir(cfg, d)
        with StopRequest() as stop:
            state["stop"] = stop
            if env.rank == 0:
                _server_main(cfg, spec, d, state)
            elif env.rank in roles.server_ranks:
                _shard_main(cfg, spec, d)
            else:
                _worker_main(cfg, spec, d, stop)
        ok = True
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure ends the job the same way
        _report_failure(d, exc, state)
        return exc.exit_code if isinstance(exc, HosflError) else 1
    finally:
        d.shutdown(graceful=ok)


# ------------------------------------------------------------------------------------------------------------------
# Roles


class ServerFront:
    """What rank 0 publishes over RPC: the endpoint that serves the algorithm's calls, and the run's bookkeeping
    (metrics rows from the leader's reports, checkpoints, the end-of-run report, failures reported by any process)."""

    def __init__(
        self,
        endpoint: ServerEndpoint,
        writer: RunWriter,
        checkpointer: Checkpointer,
        mirror: CallBroadcast | None,
        resume: tuple[LoopState, dict[str, Any]] | None,
        world: dict[str, Any],
    ) -> None:
        self.endpoint = endpoint
        self.writer = writer
        self.checkpointer = checkpointer
        self.mirror = mirror
        self.resume = resume
        self.world = world
        self.parts: dict[str, Any] = {}
        self.saved: str | None = None
        self.done = threading.Event()
        self.final: dict[str, Any] = {}
        self.failure = ""
        self.interrupted = ""
        self.stopped_at: int | None = None

    def report(self, kind: str, payload: dict[str, Any]) -> Any:
        server = self.endpoint.server
        if kind == "eval":  # between executions: the row pops the server's train loss / eval statistics
            row = self.endpoint.locked(lambda: metrics_row(server, payload["t"], payload["processed"], payload["comm"]))
            row = self.writer.log(row)
            return {k: row[k] for k in ("round", *EVAL_SHOWN) if k in row}  # for the leader's progress bar
        elif kind == "resume":  # a worker starting: its own part of the checkpoint and what the server adds to it
            if self.resume is None:
                return None
            loop, parts = self.resume
            hosted, leader = payload["hosted"], payload["leader"]
            from_server = self.endpoint.locked(lambda: server.resume_payload(hosted, leader))
            return {"loop": loop, "part": parts[str(payload["rank"])], "from_server": from_server}
        elif kind == "checkpoint_part":
            self.parts[str(payload["rank"])] = payload["part"]
        elif kind == "checkpoint":  # the leader, once every worker's part is in
            loop = LoopState(payload["t"], payload["processed"], self.writer.wall_s)
            if len(self.parts) != len(self.world["worker_ranks"]):
                raise RuntimeError(f"checkpoint of round {loop.round}: parts from {sorted(self.parts)} only")
            parts, self.parts = self.parts, {}
            self.saved = str(self.endpoint.locked(lambda: self._save(loop, parts)))
            return self.saved
        elif kind == "interrupted":
            self.interrupted, self.stopped_at = payload["why"], payload["t"]
            self.done.set()
        elif kind == "final":
            self.final = payload
            self.done.set()
        elif kind == "failure":
            self.fail(payload["message"])
        else:
            raise ValueError(f"unknown report {kind!r}")
        return None

    def _save(self, loop: LoopState, parts: dict[str, Any]) -> Path:
        meta = {"engine": "torchrun", "algorithm": self.writer.cfg.algorithm.name, **self.world}
        if self.mirror is not None:
            self.mirror.save(loop, meta)
        return self.checkpointer.save(self.endpoint.server, loop, parts, meta)

    def fail(self, message: str) -> None:
        if not self.failure:
            self.failure = message
        self.done.set()


def _server_main(cfg: Config, spec: AlgorithmSpec, d: Distributed, state: dict[str, Any]) -> None:
    roles = d.roles
    _log(d, roles.describe())
    _log(d, f"gloo and TensorPipe bound to {d.interface or 'the interface torch chooses'} (job.interface)")
    world = {
        "world_size": roles.world_size,
        "server_ranks": list(roles.server_ranks),
        "worker_ranks": list(roles.worker_ranks),
    }
    ckpt = prepare_out_dir(cfg, restarted=d.env.restart > 0)
    lean = ()  # a data-parallel server's gathered rounds: the other ranks get their rows from the server itself
    if getattr(spec.server, "data_parallel", False):
        lean = tuple(name for name, w in wire_specs(spec.server).items() if w.gather)
    mirror = CallBroadcast(d.server_group, lean) if d.server_group is not None else None
    server = _server(cfg, spec, d)
    _log(d, f"run folder {cfg.job.out_dir}")
    checkpointer = Checkpointer(cfg.job.out_dir, cfg.checkpoint.keep, d.server_group)
    resume = None
    if ckpt is not None:
        if mirror is not None:
            mirror.load(str(ckpt))
        loop, parts, meta = checkpointer.load(server, ckpt)
        if {k: meta.get(k) for k in world} != world or meta.get("engine") != "torchrun":
            raise ConfigError(f"checkpoint {ckpt} was written by another layout ({meta.get('engine')}, "
                              f"{ {k: meta.get(k) for k in world} }); resume it with that world")  # fmt: skip
        resume = (loop, parts)
        _log(d, f"resuming from {ckpt} (round {loop.round}, {loop.processed} samples)")
    writer = RunWriter(
        cfg, "torchrun", resume[0].round if resume else None, resume[0].wall_s if resume else 0.0, str(ckpt or "")
    )
    endpoint = ServerEndpoint(server, mirror)
    endpoint.closed = resume[0].round if resume else 0
    front = state["front"] = ServerFront(endpoint, writer, checkpointer, mirror, resume, world)
    publish(front)
    stop = state["stop"]
    while not front.done.wait(0.2):  # a short wait keeps the main thread responsive to signals
        if stop.signal and time.monotonic() - stop.since > cfg.server.rpc_timeout_s:
            raise Interrupted(f"{stop.signal}: the client workers did not stop within {cfg.server.rpc_timeout_s} s")
    if front.interrupted:  # the workers checkpointed and stopped (their own exits may report failures after)
        writer.interrupt(front.interrupted, front.stopped_at, front.saved)
        if mirror is not None:
            mirror.stop()
        raise Interrupted(f"{front.interrupted}; checkpoint {front.saved} (resume with job.resume=auto)")
    if front.failure:
        raise PeerFailure(front.failure)
    final = front.final
    problem = endpoint.locked(lambda: server.audit(final["rounds"], final["client_digests"]))
    digest = mirror.digest(server.model) if mirror is not None else server.server_digest()
    mine = process_memory(0, "server", server.model)
    memory = mirror.memory(mine) if mirror is not None else [mine]
    if mirror is not None:
        mirror.stop()
    if problem is not None:
        raise ProtocolError(f"end-of-run report refused: {problem}")
    summary = run_summary(
        cfg, writer, "torchrun", final["rounds"], final["processed"], final["comm"], final["client_digests"], digest
    )
    summary["roles"] = {
        **world,
        "hosted": {f"worker_{r}": list(ids) for r, ids in roles.hosted.items()},
        "interface": d.interface,
    }
    summary["memory"] = memory + final.get("memory", [])
    summary["transport"] = {"workers": final["transport"], "server": endpoint.stats()}
    if final.get("link"):
        summary["link"] = final["link"]
        _log(d, describe_traffic(final["link"]))
    writer.complete(summary)


def _agree_out_dir(cfg: Config, d: Distributed) -> Config:
    """Every rank's ``job.out_dir``: the user's, or the folder rank 0 makes for this run (runs/<job.name>/<start
    time>, see :mod:`hosfl_dist.runtime.run_dir`), handed to the others through the store."""
    if chosen(cfg):
        return cfg
    if d.rank == 0:
        cfg = resolve_out_dir(cfg, restarted=d.env.restart > 0)
        d.put("hosfl/out_dir", cfg.job.out_dir)
        return cfg
    return with_out_dir(cfg, d.get("hosfl/out_dir", cfg.server.rpc_timeout_s))


def _shard_main(cfg: Config, spec: AlgorithmSpec, d: Distributed) -> None:
    checkpointer = Checkpointer(cfg.job.out_dir, cfg.checkpoint.keep, d.server_group)
    follow(_server(cfg, spec, d), d.server_group, checkpointer)


def _server(cfg: Config, spec: AlgorithmSpec, d: Distributed) -> Any:
    """The method's server over f_s (sharded over the server group before its weights exist), from ``job.seed``.

    Of f_c only the trainable tensors are materialised (θc^0: HO-SFL's base replica, the baselines' θc^t); no
    training data is loaded."""
    group = d.server_group
    data_parallel = bool(getattr(spec.server, "data_parallel", False))
    shard = (lambda module: shard_server_model(module, group, d.device)) if group is not None else None
    split = build_split_model(cfg, data_info(cfg), spec.zeroth_order_client, parts=("server",), shard=shard)
    _log(d, "threads: {} intra-op ({})".format(*set_threads(cfg, sum(p.numel() for p in split.server.parameters()))))
    server = spec.server(cfg, split)  # after sharding: the optimizer must see the sharded parameters
    if group is not None and data_parallel:
        server.group = ServerGroup(group)  # submit spreads each round's rows over the group
    split.keep(spec.server_parts)  # the server copied what it needs of the others (HO-SFL: θc^0)
    return server


def _worker_main(cfg: Config, spec: AlgorithmSpec, d: Distributed, stop: StopRequest) -> None:
    roles, rank = d.roles, d.rank
    leader = rank == roles.leader
    data = build_data(cfg, clients=roles.hosted[rank], evaluation=leader)  # its clients' shards (+ evaluation)
    split = build_split_model(cfg, data.info, spec.zeroth_order_client, parts=spec.worker_parts)
    split.keep(spec.worker_parts)
    parts = [m for m in (split.client, split.server) if m is not None]  # the parts this worker holds
    threads, why = set_threads(cfg, sum(p.numel() for m in parts for p in m.parameters()))
    if leader:
        _log(d, f"threads: {threads} intra-op per worker ({why})")
        if cfg.comm.inject_delay:
            _log(d, describe_link(cfg.comm))
    meter, stats = CommMeter(), TransportStats()
    group = ProcessGroupCollective(d.worker_group, leader, d.device, meter, stats)
    rpc = RPCTransport(fetch_front(cfg.server.rpc_timeout_s), cfg.server.rpc_timeout_s, stats)
    transport: Transport = rpc
    collective: Collective = group
    link = None
    if cfg.comm.inject_delay:  # the emulated client-server link around the real RPC transport
        transport = link = DelayedTransport(transport, cfg.comm)
        collective = DelayedCollective(group, link)
    transport = MeteredTransport(transport, spec.server, meter)
    worker = spec.worker(cfg, split, data, roles.hosted[rank], transport, collective)
    timed = _TimedWorker(worker, stats)
    start = None
    resumed = rpc.report("resume", rank=rank, hosted=list(roles.hosted[rank]), leader=leader)
    if resumed is not None:  # replicas rebuilt from the server's base replica and history (Algorithm 3)
        start = resumed["loop"]
        worker.load_state_dict(resumed["part"]["worker"], resumed["from_server"])
        meter.load_state_dict(resumed["part"]["meter"])
        set_rng_state(resumed["part"]["rng"])
    every, last = cfg.checkpoint.interval_samples, [start.processed if start else 0]

    def on_eval(t: int, processed: int) -> None:
        # The leader evaluated alone; the others wait for it through the store, as long as train.eval_timeout_s
        # allows, and only then enter the collectives below, whose timeout (server.collective_timeout_s) is for a
        # collective, not for an evaluation.
        done = f"hosfl/evaluated/{t}"
        if leader:
            d.post(done)
        else:
            try:
                d.wait_for(done, cfg.train.eval_timeout_s)
            except TimeoutError:
                raise TimeoutError(f"the leader's evaluation after round {t} took longer than "
                                   f"train.eval_timeout_s={cfg.train.eval_timeout_s:g} s") from None  # fmt: skip
        comm = group.sum_counts(meter.snapshot())
        if leader:
            show_eval(bar, rpc.report("eval", t=t, processed=processed, comm=comm))
        group.barrier()  # no worker starts the next round before the row is written

    def after_round(t: int, processed: int) -> bool:
        stopping = bool(group.coordinate(torch.tensor([1 if stop.signal else 0])).item())  # every worker agrees
        if (every and processed // every > last[0] // every) or stopping:
            worker.quiesce()
            part = {"worker": worker.state_dict(), "meter": meter.state_dict(), "rng": rng_state()}
            rpc.report("checkpoint_part", rank=rank, part=part)
            group.barrier()  # every part is in before the leader asks for the save
            # nobody goes on (or exits) before the checkpoint is complete: the save is one RPC of the leader's, waited
            # for with that RPC's timeout (a barrier would wait with a collective's)
            saved = f"hosfl/checkpointed/{t}"
            if leader:
                rpc.report("checkpoint", t=t, processed=processed)
                d.post(saved)
            else:
                d.wait_for(saved, cfg.server.rpc_timeout_s)
            last[0] = processed
        return stopping

    bar = progress_bar(cfg) if leader else None
    try:
        t, processed = train_loop(cfg, timed, on_eval, bar, start, after_round)
        if processed < cfg.train.budget_samples:  # stopped by a signal, after the checkpoint
            if leader:
                rpc.report("interrupted", t=t, why=f"{stop.signal or 'SIGTERM'} after round {t}")
            raise Interrupted(f"{stop.signal or 'a signal to another worker'}: stopped after round {t}")
        if bar is not None:
            bar.close()
            _log(d, f"budget reached after {t} rounds: bringing every worker's client replicas up to date "
                    "(Algorithm 3), checking them against the server, writing summary.json")  # fmt: skip
        worker.sync_all(t)  # Algorithm 3 up to round t for every hosted replica, so the digests are comparable
    finally:
        if bar is not None:
            bar.close()
        if link is not None:
            link.close()
    memory = process_memory(rank, "worker", split.client, split.server)
    mine = (rank, worker.client_digest(), timed.summary(), link.summary() if link is not None else None, memory)
    everyone = group.gather(mine)
    comm = group.sum_counts(meter.snapshot())
    if leader:
        rpc.report(
            "final",
            rounds=t,
            processed=processed,
            comm=comm,
            client_digests={f"worker_{r}": dig for r, dig, _, _, _ in everyone},
            transport={f"worker_{r}": st for r, _, st, _, _ in everyone},
            link=_sum_links([lk for _, _, _, lk, _ in everyone if lk is not None]),
            memory=[mem for *_, mem in everyone],
        )


def _sum_links(links: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The workers' emulated links: the settings once, what they carried summed."""
    if not links:
        return None
    out = dict(links[0])
    for other in links[1:]:
        for k, v in other.items():
            if k not in ("uplink_mbps", "downlink_mbps", "rtt_ms"):
                out[k] += v
    return out


class _TimedWorker:
    """The worker as train_loop sees it, timing run_round and the transport time spent inside rounds."""

    def __init__(self, worker: Any, stats: TransportStats) -> None:
        self.worker = worker
        self.stats = stats
        self.in_rounds = TransportStats()
        self.rounds = 0
        self.round_s = 0.0
        self.first_round_s = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)

    def run_round(self, t: int) -> int:
        before, start = self.stats.copy(), time.perf_counter()
        n = self.worker.run_round(t)
        took = time.perf_counter() - start
        self.round_s += took
        self.first_round_s = self.first_round_s or took  # connections and caches warm up in the first round
        self.rounds += 1
        self.in_rounds.add_delta(self.stats, before)
        return n

    def summary(self) -> dict[str, Any]:
        """Per-worker timing of the training rounds (evaluation and reports excluded)."""
        return {
            "rounds": self.rounds,
            "round_s": round(self.round_s, 6),
            "first_round_s": round(self.first_round_s, 6),
            **self.in_rounds.as_dict(),
        }


# ------------------------------------------------------------------------------------------------------------------
# Failure


def _report_failure(d: Distributed, exc: BaseException, state: dict[str, Any]) -> None:
    label = d.roles.label(d.rank)
    first = _claim_failure(d)
    message = f"{label}: {_one_line(exc)}"
    if isinstance(exc, Interrupted):  # an orderly stop after a checkpoint: no failure to report
        print(f"[{label}] interrupted: {exc}", file=sys.stderr, flush=True)
        return
    if first:
        if isinstance(exc, HosflError):
            print(f"[{label}] error: {exc}", file=sys.stderr, flush=True)
        else:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            print(f"[{label}] error:\n{text}", file=sys.stderr, end="", flush=True)
    else:
        print(f"[{label}] stopping: another process of the job failed first", file=sys.stderr, flush=True)
    front = state.get("front")
    if front is not None:  # rank 0 itself: record the failure in summary.json
        front.fail(message)
        if not front.writer.finished:
            front.writer.fail(front.failure)
    elif first and d.rpc_up:
        notify_failure(message)


def _claim_failure(d: Distributed) -> bool:
    """True for exactly one process of the job: the first to fail, which shows its error."""
    store = d.store()
    if store is None:
        return True
    try:
        return store.add(f"hosfl/failed/{d.env.restart}", 1) == 1
    except Exception:  # noqa: BLE001 - store gone with its host: report rather than stay silent
        return True


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    if len(lines) > 1 and lines[0].startswith("On WorkerInfo"):  # a remote error: "On WorkerInfo(...):\nError(...)"
        lines = [f"{lines[0]} {lines[1]}"]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]


def _log(d: Distributed, msg: str) -> None:
    label = d.roles.label(d.rank)
    for line in msg.splitlines():
        print(f"[{label}] {line}", file=sys.stderr, flush=True)
