"""The torchrun runtime: what each role runs, and how the job ends (cleanly, or on the first failure).

- rank 0, **server**: builds θs (sharded when server.ranks > 1), publishes the server front over RPC, writes
  config.yaml / metrics.jsonl / summary.json, and waits for the leader worker's end-of-run report;
- ranks 1..S-1, **server shards**: replay rank 0's calls on their FSDP shard of θs;
- ranks S..W-1, **client workers**: run :func:`hosfl_dist.engine.train_loop` over the algorithm's worker, which
  reaches the server through :class:`RPCTransport` and its peers through :class:`ProcessGroupCollective`.

Traffic is counted per logical client on the worker that hosts it; at every evaluation the workers all_reduce
their per-category counters and the leader hands the sums to the server, which writes the row (so rows and
summary equal the in-process engine's). At the end every worker brings its replicas to the last round
(Algorithm 3) and reports the digest of θc; summary.json lists them per worker and the run fails if they differ.

Failure: the first process that raises claims the failure in the rendezvous store and prints its error (a remote
error carries the server's traceback); the others print one line. It tells the server (summary.json records
status "failed" and the error), leaves RPC without waiting for peers and exits non-zero; torchrun then stops the
rest of the job.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from typing import Any

from hosfl_dist.algorithms.base import get_algorithm
from hosfl_dist.comm import CommMeter
from hosfl_dist.config import Config
from hosfl_dist.data import build_data
from hosfl_dist.distributed.env import Distributed, LaunchEnv, init_distributed, role_map
from hosfl_dist.distributed.fsdp_server import CallBroadcast, follow, shard_server_model
from hosfl_dist.distributed.front import ServerFront
from hosfl_dist.distributed.rpc_transport import (
    ProcessGroupCollective,
    RPCTransport,
    TransportStats,
    fetch_front,
    notify_failure,
    publish,
)
from hosfl_dist.engine import Recorder, _progress, run_summary, train_loop
from hosfl_dist.errors import HosflError
from hosfl_dist.models import SplitModel, build_split_model


class PeerFailure(RuntimeError):
    """Another process of the job failed; this one stops."""


def run_distributed(cfg: Config, env: LaunchEnv) -> int:
    """Run this process's role until the job ends; returns the process exit code (0 = the whole run completed)."""
    roles = role_map(cfg, env.world_size)  # refused here, before any process group exists
    d = init_distributed(cfg, env, roles)
    cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, device=str(d.device)))
    state: dict[str, Any] = {}
    ok = False
    try:
        if env.rank == 0:
            _server_main(cfg, d, state)
        elif env.rank in roles.server_ranks:
            _shard_main(cfg, d)
        else:
            _worker_main(cfg, d)
        ok = True
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure ends the job the same way, exit code 1
        _report_failure(d, exc, state)
        return 1
    finally:
        d.shutdown(graceful=ok)


# ------------------------------------------------------------------------------------------------------------------
# Roles


def _server_main(cfg: Config, d: Distributed, state: dict[str, Any]) -> None:
    roles = d.roles
    _log(d, roles.describe())
    server_cls, _ = get_algorithm(cfg.algorithm.name)
    split = _server_half(cfg, d)
    mirror = CallBroadcast(d.server_group) if d.server_group is not None else None
    server = server_cls(cfg, split)  # after sharding: the optimizer must see the sharded parameters
    rec = Recorder(cfg)
    front = state["front"] = ServerFront(server, rec, mirror)
    publish(front)
    while not front.done.wait(0.2):  # a short wait keeps the main thread responsive to signals
        pass
    if front.failure:
        raise PeerFailure(front.failure)
    final = front.final
    digest = mirror.digest(server.model) if mirror is not None else server.server_digest()
    if mirror is not None:
        mirror.stop()
    summary = run_summary(
        cfg, rec, "torchrun", final["rounds"], final["processed"], final["comm"], final["client_digests"], digest
    )
    summary["roles"] = {
        "world_size": roles.world_size,
        "server_ranks": list(roles.server_ranks),
        "worker_ranks": list(roles.worker_ranks),
        "hosted": {f"worker_{r}": list(ids) for r, ids in roles.hosted.items()},
    }
    summary["transport"] = {"workers": final["transport"], "server": front.server_stats()}
    diverged = len(set(final["client_digests"].values())) != 1
    if diverged:  # every replica replayed the same history: different digests are a bug, not noise
        summary.update(status="failed", error=f"client replicas diverged across workers: {final['client_digests']}")
    summary = rec.finish(summary)
    state["finished"] = True
    if diverged:
        raise RuntimeError(summary["error"])
    last = summary["final"]
    _log(
        d,
        f"done: {summary['rounds']} rounds, {summary['processed_samples']} samples, "
        f"eval_accuracy={last.get('eval_accuracy')}, wall {summary['wall_time_s']} s -> {cfg.job.out_dir}",
    )


def _shard_main(cfg: Config, d: Distributed) -> None:
    server_cls, _ = get_algorithm(cfg.algorithm.name)
    follow(server_cls(cfg, _server_half(cfg, d)), d.server_group)


def _worker_main(cfg: Config, d: Distributed) -> None:
    roles, rank = d.roles, d.rank
    server_cls, worker_cls = get_algorithm(cfg.algorithm.name)
    data = build_data(cfg)
    split = build_split_model(cfg, data.info)  # both halves: some methods' workers need f_s too (FSL-SAGE's aux)
    meter, stats = CommMeter(), TransportStats()
    transport = RPCTransport(fetch_front(cfg.server.rpc_timeout_s), server_cls, meter, cfg.server.rpc_timeout_s, stats)
    leader = rank == roles.leader
    collective = ProcessGroupCollective(d.worker_group, leader, d.device, stats)
    worker = worker_cls(cfg, split, data, roles.hosted[rank], transport, collective)
    timed = _TimedWorker(worker, stats)

    def on_eval(t: int, processed: int) -> None:
        comm = collective.sum_counts(meter.snapshot())
        if leader:
            transport.report("eval", t=t, processed=processed, comm=comm)
        collective.barrier()  # no worker starts the next round before the row is written

    bar = _progress(cfg) if leader else None
    try:
        t, processed = train_loop(cfg, timed, on_eval, bar)
    finally:
        if bar is not None:
            bar.close()
    worker.sync_all(t)  # Algorithm 3 up to round t for every hosted replica, so the digests are comparable
    mine = (rank, worker.client_digest(), timed.summary())
    everyone = collective.gather(mine)
    comm = collective.sum_counts(meter.snapshot())
    if leader:
        transport.report(
            "final",
            rounds=t,
            processed=processed,
            comm=comm,
            client_digests={f"worker_{r}": dig for r, dig, _ in everyone},
            transport={f"worker_{r}": st for r, _, st in everyone},
        )


def _server_half(cfg: Config, d: Distributed) -> SplitModel:
    split = build_split_model(cfg, build_data(cfg).info)  # f_c too: model-aggregating servers start from θc^0
    if d.server_group is not None:
        shard_server_model(split.server, d.server_group, d.device)
    return split


class _TimedWorker:
    """The worker as train_loop sees it, timing run_round and the transport time spent inside rounds."""

    def __init__(self, worker: Any, stats: TransportStats) -> None:
        self.worker = worker
        self.stats = stats
        self.in_rounds = TransportStats()
        self.rounds = 0
        self.round_s = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)

    def run_round(self, t: int) -> int:
        before, start = self.stats.copy(), time.perf_counter()
        n = self.worker.run_round(t)
        self.round_s += time.perf_counter() - start
        self.rounds += 1
        self.in_rounds.add_delta(self.stats, before)
        return n

    def summary(self) -> dict[str, Any]:
        """Per-worker timing of the training rounds (evaluation and reports excluded)."""
        return {"rounds": self.rounds, "round_s": round(self.round_s, 6), **self.in_rounds.as_dict()}


# ------------------------------------------------------------------------------------------------------------------
# Failure


def _report_failure(d: Distributed, exc: BaseException, state: dict[str, Any]) -> None:
    label = d.roles.label(d.rank)
    first = _claim_failure(d)
    message = f"{label}: {_one_line(exc)}"
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
        if not state.get("finished"):
            front.recorder.finish({"status": "failed", "error": front.failure})
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
