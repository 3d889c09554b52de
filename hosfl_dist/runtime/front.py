"""The run's front: the server side of a run, in the process that writes its record (in-process, or rank 0).

It holds what the client workers reach: the endpoint that serves the algorithm's calls (through the server group),
and the run's bookkeeping, which they drive with the control messages of :mod:`hosfl_dist.runtime.control`:

    open()        the run's folder made ready, the checkpoint to resume from loaded, the record started
    ResumeRequest a worker's part of that checkpoint, and what the server adds to it
    EvalReport    a metrics row (the server's train loss, the evaluation server's statistics, the summed traffic)
    CheckpointPart / SaveCheckpoint
                  the workers' parts, then the checkpoint written (every server rank writes its shard)
    Stopped / FinalReport / FailureReport
                  how the run ends; conclude() writes it: interrupted, completed or stopped early (checked against
                  the server's own state), or failed

The front's callbacks (the start, the rows, the checkpoints, the end) and ``train.early_stopping``, which follows the
metrics rows it writes, may ask the run to end early: the answers to EvalReport and SaveCheckpoint carry the request
to the leader worker (:meth:`RunFront.stop_answer`), which the workers then agree on.

Both runtimes use it the same way: in one process the trainer's control calls it directly
(:class:`LocalControl`), under torchrun over RPC (:class:`~hosfl_dist.runtime.rpc.RPCControl`). Handlers run on
the caller's thread (an RPC thread under torchrun); whatever reads or changes the server does so between its
executions (``endpoint.locked``).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from hosfl_dist.config import Config
from hosfl_dist.core.stopping import EarlyStopping
from hosfl_dist.errors import CallbackError, ConfigError, Interrupted, ProtocolError
from hosfl_dist.runfolder.checkpoints import checkpoint_folders, trusted_manifest
from hosfl_dist.runfolder.environment import environment_differences
from hosfl_dist.runfolder.folder import EARLY_STOPPING, prepare_out_dir
from hosfl_dist.runfolder.identity import identity_differences, run_identity
from hosfl_dist.runfolder.lock import RunLock
from hosfl_dist.runfolder.run import Run
from hosfl_dist.runfolder.signing import SIGNATURE, UNSIGNED
from hosfl_dist.runtime.callbacks import Callbacks
from hosfl_dist.runtime.checkpoint import CheckpointStore, LoopState
from hosfl_dist.runtime.control import (
    CheckpointPart,
    EvalReport,
    FailureReport,
    FinalReport,
    Handler,
    ResumeRequest,
    SaveCheckpoint,
    Stopped,
    handles,
)
from hosfl_dist.runtime.memory import process_memory
from hosfl_dist.runtime.record.progress import EVAL_SHOWN
from hosfl_dist.runtime.record.writer import RunRecord, metrics_row, record_gap
from hosfl_dist.runtime.server_group import ServerGroup
from hosfl_dist.transport.endpoint import ServerEndpoint
from hosfl_dist.transport.link import describe_traffic

logger = logging.getLogger(__name__)


class PeerFailure(RuntimeError):
    """Another process of the job failed; this one stops."""


class RunFront(Handler):
    """The server side of one run (see the module docstring).

    ``engine`` and ``layout`` are written into every checkpoint and must match to resume from one (the in-process
    runtime: ``{"workers": 1}``; torchrun: the world size and the ranks of each role). ``memory_role``: the role of
    this process's memory entry in the summary (None when a worker's entry covers the process, in one process).
    ``roles``: what the summary says of the processes (torchrun).
    """

    def __init__(
        self,
        cfg: Config,
        endpoint: ServerEndpoint,
        servers: ServerGroup,
        store: CheckpointStore,
        engine: str,
        layout: dict[str, Any],
        memory_role: str | None = None,
        roles: dict[str, Any] | None = None,
        callbacks: Callbacks | None = None,
    ) -> None:
        self.cfg = cfg
        self.callbacks = callbacks if callbacks is not None else Callbacks()
        """The user's callbacks of the events this process owns: the start, the rows, the checkpoints, the end; and
        this process's stop request (``callbacks.control``)."""
        self.early_stopping = EarlyStopping.of(cfg.train.early_stopping)
        """``train.early_stopping`` over the rows written (rebuilt from those a resume keeps)."""
        self.endpoint = endpoint
        self.server = endpoint.server
        self.evaluator = endpoint.evaluator
        self.servers = servers
        self.store = store
        self.engine = engine
        self.layout = layout
        self.memory_role = memory_role
        self.roles = roles
        self.record: RunRecord | None = None
        self.lock: RunLock | None = None
        self.identity: dict[str, Any] = {}
        self.resumed_from: Path | None = None
        self.recorded_environment: dict[str, Any] | None = None
        """The environment the checkpoint being resumed was written in (None: starting, or a checkpoint written before
        environments were recorded); each worker's is compared with it as the worker starts."""
        self.resume: tuple[LoopState, dict[str, Any]] | None = None
        self.parts: dict[str, Any] = {}
        self.saved: str | None = None
        self.server_stats: dict[str, Any] | None = None
        """The endpoint's statistics at the last evaluation (the rounds and their evaluations, not the final check)."""
        self.done = threading.Event()
        self.stopped: Stopped | None = None
        self.final: FinalReport | None = None
        self.failure = ""
        self.callback_failed = False
        """The failure recorded is a callback's (rank 0 ends the run with a CallbackError)."""

    def open(self, restarted: bool = False) -> None:
        """Lock the run's folder, make it ready, and start the record; resuming, verify the checkpoints newest first
        and load the newest intact one, if it was written by this run (config, inputs, code, environment). Called
        after this process's threads are set: they are part of the environment."""
        candidates, self.lock = prepare_out_dir(self.cfg, restarted)
        self.store.key()  # a key that cannot be made or read stops the run now, not at its first checkpoint
        self.identity = run_identity(self.cfg)
        loop, ckpt, notes = None, None, {}
        if candidates:
            ckpt, manifest = self._verified(candidates)
            notes = self._same_run(ckpt, manifest)
            self.servers.load(str(ckpt))
            loop, parts, meta = self.store.load(self.server, ckpt)
            gap = record_gap(Path(self.cfg.job.out_dir), self.cfg, loop.round, loop.processed)
            if gap is not None:
                raise ConfigError(f"checkpoint {ckpt} cannot be resumed: {gap}; remove it (job.resume=auto then takes "
                                  "the newest one before it)")  # fmt: skip
            if meta.get("engine") != self.engine:
                raise ConfigError(f"checkpoint {ckpt} was written by the {meta.get('engine')} runtime; resume it there")
            written = {k: meta.get(k) for k in self.layout}
            if written != self.layout:
                raise ConfigError(f"checkpoint {ckpt} was written by another layout ({meta.get('engine')}, "
                                  f"{written}); resume it with that world")  # fmt: skip
            self.resume = (loop, parts)
            self.endpoint.resume_at(loop.round)
            logger.info(f"resuming from {ckpt} (round {loop.round}, {loop.processed} samples)")
        self.record = RunRecord(
            self.cfg,
            self.engine,
            loop.round if loop else None,
            loop.wall_s if loop else 0.0,
            str(ckpt or ""),
            self.identity,
            notes,
            plan=self.server.round_plan.participation,  # the rounds as the server runs them (decided live, or drawn)
        )
        if self.early_stopping is not None:  # the rows a resume keeps are the criterion's history
            for row in self.record.history:
                self.early_stopping.update(row)
        self._fire("on_train_start", Run(self.cfg.job.out_dir, self.callbacks.control))

    def _verified(self, candidates: list[Path]) -> tuple[Path, dict[str, Any]]:
        """The newest checkpoint every server rank verifies, with its manifest if it is signed by this key (or is
        unsigned and ``job.allow_unsigned`` accepts it); damaged ones are named in one line and passed over, a
        signature mismatch or an unsigned one refused in one line."""
        failed = []
        key = self.store.key()
        for path in candidates:
            problem = next((p for p in self.servers.verify(str(path)) if p), None)
            if problem is None:
                manifest, state = trusted_manifest(path, key, self.cfg.job.allow_unsigned, "job.allow_unsigned=true")
                if state == UNSIGNED:
                    logger.warning(f"resuming {_round(path)}, which is unsigned (job.allow_unsigned)")
                if failed:
                    logger.warning(f"resuming from {_round(path)}: " + "; ".join(
                        f"{_round(p)} failed verification ({why})" for p, why in failed))  # fmt: skip
                return path, manifest
            failed.append((path, problem))
        listed = "; ".join(f"{_round(p)}: {why}" for p, why in failed[:3])
        raise ConfigError(f"job.out_dir {self.cfg.job.out_dir}: no checkpoint verifies ({listed}); set "
                          "job.overwrite=true to start the run afresh")  # fmt: skip

    def _same_run(self, ckpt: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        """Refuse a checkpoint of another run (by the identity in its verified manifest); what summary.json notes of
        a resume that ``job.allow_code_change``, ``job.allow_environment_change`` or ``job.allow_unsigned`` let
        through."""
        recorded = manifest.get("identity") or {}
        unsigned = {} if SIGNATURE in manifest else {"resumed_unsigned": str(ckpt)}
        differ = identity_differences(recorded, self.identity, code=False)
        if differ:
            raise ConfigError(f"job.out_dir {self.cfg.job.out_dir}: {_round(ckpt)} was written by another run "
                              f"({', '.join(differ[:4])}); resume it with what it was run with, or choose another "
                              "folder")  # fmt: skip
        notes: dict[str, Any] = dict(unsigned)
        code = identity_differences(recorded, self.identity)
        if code:
            if not self.cfg.job.allow_code_change:
                raise ConfigError(f"job.out_dir {self.cfg.job.out_dir}: {_round(ckpt)} was written by other code "
                                  f"({code[0].removeprefix('the code ')}); resuming would not continue it bit for bit "
                                  "(job.allow_code_change=true resumes anyway)")  # fmt: skip
            logger.warning(f"resuming {_round(ckpt)} with other code (job.allow_code_change): {code[0]}")
            notes["resumed_with_other_code"] = {"checkpoint": recorded.get("code"), "now": self.identity["code"]}
        environment = recorded.get("environment")
        if not isinstance(environment, dict):
            logger.warning(f"{_round(ckpt)} records no environment (written before threads, library versions and CPU "
                           "kernels were recorded): resuming without comparing them")  # fmt: skip
            return {**notes, "resumed_with_unrecorded_environment": True}
        self.resumed_from, self.recorded_environment = ckpt, environment
        now = self.identity["environment"]
        changed = self._environment_changed(_round(ckpt), _own(environment), now)
        if changed:
            notes["resumed_with_other_environment"] = {"checkpoint": _own(environment), "now": now, "differs": changed}
        return notes

    def _environment_changed(self, what: str, recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
        """What differs between the environment ``what`` was written in and this one; refused in one line unless
        ``job.allow_environment_change``."""
        differ = environment_differences(recorded, now)
        if differ and not self.cfg.job.allow_environment_change:
            raise ConfigError(f"job.out_dir {self.cfg.job.out_dir}: {what} was written in another environment "
                              f"({', '.join(differ[:4])}); resuming would not continue it bit for bit "
                              "(job.allow_environment_change=true resumes anyway)")  # fmt: skip
        if differ:
            logger.warning(
                f"resuming {what} in another environment (job.allow_environment_change): " + ", ".join(differ)
            )
        return differ

    def _worker_environment(self, rank: int, env: dict[str, Any]) -> None:
        """Record a worker's environment where it differs from this process's (the checkpoints carry it), and
        compare it with the one it had in the checkpoint being resumed."""
        own = self.identity.get("environment")
        if own is None:  # an identity without one (as recorded before environments were)
            return
        separate = env != _own(own)
        if separate:
            own.setdefault("workers", {})[str(rank)] = env
        recorded = self.recorded_environment
        if recorded is None:
            return
        theirs = (recorded.get("workers") or {}).get(str(rank))
        if theirs is None and not separate:  # the same as this process's then and now: compared in _same_run
            return
        changed = self._environment_changed(f"{_round(self.resumed_from)} (worker rank {rank})",
                                            theirs or _own(recorded), env)  # fmt: skip
        if changed:
            noted = self.record.base.setdefault("resumed_with_other_environment", {})
            noted.setdefault("workers", {})[str(rank)] = changed

    def close(self) -> None:
        """Release the run's folder (the end of the process releases it too, however it ends)."""
        if self.lock is not None:
            self.lock.release()

    # -- control messages ------------------------------------------------------------------------------------------
    @handles(ResumeRequest)
    def _on_resume(self, msg: ResumeRequest) -> dict[str, Any] | None:
        if msg.environment is not None:
            self._worker_environment(msg.rank, msg.environment)
        if self.resume is None:
            return None
        loop, parts = self.resume
        from_server = self.endpoint.locked(lambda: self.server.resume_payload(list(msg.hosted), msg.leader))
        return {"loop": loop, "part": parts[str(msg.rank)], "from_server": from_server}

    @handles(EvalReport)
    def _on_eval(self, msg: EvalReport) -> dict[str, Any]:
        if self.callback_failed:  # the run is ending (torchrun): no row after the failure
            return {}
        # between executions: the row pops the server's train loss and the evaluation server's statistics
        row = self.endpoint.locked(lambda: metrics_row(self.server, self.evaluator, msg.t, msg.processed, msg.comm))
        row = self.record.log(row)
        self.server_stats = self.endpoint.stats()
        self._fire("on_evaluate", dict(row), handling=True)
        self._follow(row)
        shown = {k: row[k] for k in ("round", *EVAL_SHOWN) if k in row}  # for the leader's progress bar
        return {**shown, **self.stop_answer()}

    def _follow(self, row: dict[str, Any]) -> None:
        """``train.early_stopping`` on the row just written: a request to stop once its criterion is met."""
        stopper = self.early_stopping
        if stopper is None:
            return
        if stopper.metric not in row:  # what checks.py could not tell from the config (a plug-in's own rows)
            held = ", ".join(sorted(k for k in row if k.startswith("eval_") or k == "train_loss"))
            raise ConfigError(f"invalid value for train.early_stopping.metric: {stopper.metric!r} (the metrics rows "
                              f"hold {held})")  # fmt: skip
        reason = stopper.update(row)
        if reason is not None:
            self.callbacks.control.stop(EARLY_STOPPING, reason)

    def stop_answer(self) -> dict[str, Any]:
        """What the answers to the leader carry of this process's request to end the run (``stop``), if any."""
        asked = self.callbacks.control.request()
        return {"stop": asked} if asked is not None else {}

    @handles(CheckpointPart)
    def _on_part(self, msg: CheckpointPart) -> None:
        self.parts[str(msg.rank)] = msg.part

    @handles(SaveCheckpoint)
    def _on_save(self, msg: SaveCheckpoint) -> dict[str, Any]:
        if self.callback_failed:  # the run is ending (torchrun): no checkpoint after the failure
            return {"path": ""}
        loop = LoopState(msg.t, msg.processed, self.record.wall_s)
        self.record.rounds_run(msg.t)  # participation.jsonl covers what the checkpoint holds
        workers = self.layout.get("worker_ranks", [0])
        if sorted(self.parts) != sorted(str(r) for r in workers):
            raise RuntimeError(f"checkpoint of round {loop.round}: parts from {sorted(self.parts)} only")
        parts, self.parts = self.parts, {}
        meta = {"engine": self.engine, "algorithm": self.cfg.algorithm.name, **self.layout}

        def save() -> Path:
            self.servers.save(loop, meta)  # the other server ranks write their shards of θs
            return self.store.save(self.server, loop, parts, meta, self.identity)

        self.saved = str(self.endpoint.locked(save))
        self._fire("on_checkpoint", self.saved, handling=True)
        return {"path": self.saved, **self.stop_answer()}

    @handles(Stopped)
    def _on_stopped(self, msg: Stopped) -> None:
        self.stopped = msg
        self.done.set()

    @handles(FinalReport)
    def _on_final(self, msg: FinalReport) -> None:
        self.final = msg
        self.done.set()

    @handles(FailureReport)
    def _on_failure(self, msg: FailureReport) -> None:
        self.fail(msg.message)

    # -- the end -------------------------------------------------------------------------------------------------------
    def fail(self, message: str) -> None:
        """A process failed: the run ends (the first failure is the one recorded)."""
        if not self.failure:
            self.failure = message
        self.done.set()

    def record_failure(self, message: str, rounds: int | None = None) -> None:
        """Write ``failed`` into summary.json unless the run already ended there. Where even that write fails (a full
        disk), one line says so: summary.json keeps ``running``, which readers report as ``died`` once this process
        has let go of the folder."""
        self.fail(message)
        if self.record is not None and not self.record.finished:
            try:
                self.record.fail(self.failure, rounds)
            except OSError as exc:
                logger.error(f"error: could not record the failure in {self.record.dir}/summary.json: {exc}")

    def record_interrupt(self, rounds: int | None) -> None:
        """Write ``interrupted`` into summary.json for a run a KeyboardInterrupt ended at once (a second Ctrl-C, or
        user code that raised it): no checkpoint of its own; a resume continues from the newest one its folder holds
        (named; null where it holds none)."""
        if self.record is None or self.record.finished:
            return
        held = checkpoint_folders(Path(self.cfg.job.out_dir))
        after = f" after round {rounds}" if rounds is not None else ""
        why = f"KeyboardInterrupt{after}: stopped at once, without a checkpoint of its own"
        try:
            self.record.interrupt(why, rounds, str(held[0]) if held else None)
        except OSError as exc:
            logger.error(f"error: could not record the interruption in {self.record.dir}/summary.json: {exc}")

    def wait(self, stop: Any) -> None:
        """Wait until the workers end the run (rank 0 under torchrun). After a signal to this process, the workers
        have ``server.rpc_timeout_s`` to stop."""
        while not self.done.wait(0.2):  # a short wait keeps the main thread responsive to signals
            if stop.signal and time.monotonic() - stop.since > self.cfg.server.rpc_timeout_s:
                limit = self.cfg.server.rpc_timeout_s
                raise Interrupted(f"{stop.signal}: the client workers did not stop within {limit} s")

    def conclude(self) -> dict[str, Any]:
        """Write how the run ended: a completed or stopped run's summary (returned); an interrupted or failed run
        raises. A callback that fails in ``on_train_end`` leaves the summary as written, its error beside it."""
        if self.stopped is not None:  # the workers checkpointed and stopped
            why = f"{self.stopped.signal} after round {self.stopped.t}"
            self.record.interrupt(why, self.stopped.t, self.saved)
            self.servers.stop()
            raise Interrupted(f"{why}; checkpoint {self.saved}; resume it: the same command with job.resume=auto "
                              f"job.out_dir={self.cfg.job.out_dir}")  # fmt: skip
        if self.failure:
            raise CallbackError(self.failure) if self.callback_failed else PeerFailure(self.failure)
        final = self.final
        if final is None:
            raise RuntimeError("the run ended without the workers' final report")
        problem = self.endpoint.locked(lambda: self.server.audit(final.rounds, final.client_digests))
        digest = self.servers.digest()
        memory = []
        if self.memory_role is not None:
            memory = self.servers.memory(process_memory(0, self.memory_role, self.server.model))
        self.servers.stop()
        if problem is not None:
            raise ProtocolError(f"end-of-run report refused: {problem}")
        summary = self.record.completed_summary(final.rounds, final.processed, final.comm, final.client_digests, digest)
        if final.stopped is not None:  # asked to end before its budget: the same record, and what asked
            summary["status"] = "stopped"
            summary["stopped"] = {**final.stopped, "round": final.rounds, "processed_samples": final.processed,
                                  "budget_samples": self.cfg.train.budget_samples}  # fmt: skip
        if self.roles is not None:  # with each rank's host, and who chose the interface where job.interface is unset
            hosts = {f"rank_{e['rank']}": e["host"] for e in memory + final.memory if "host" in e}
            chosen = {} if self.roles.get("interface") else {"interface_chosen_by": "torch (job.interface unset)"}
            summary["roles"] = {**self.roles, **chosen, "hosts": hosts}
        summary["memory"] = memory + final.memory
        summary["transport"] = {"workers": final.transport, "server": self.server_stats or self.endpoint.stats()}
        if final.link:
            summary["link"] = final.link
            logger.info(describe_traffic(final.link))
        summary = self.record.complete(summary)
        try:
            self._fire("on_train_end", dict(summary))
        except CallbackError as exc:  # after the record: it stands, with the callback's error beside it
            self.failure, self.callback_failed = "", False
            summary = self.record.note("callback_error", str(exc))
            logger.warning(f"{exc}, after the run had ended: summary.json keeps status {summary['status']}, with this "
                           "error as callback_error")  # fmt: skip
        return summary

    def _fire(self, event: str, *args: Any, handling: bool = False) -> None:
        """Call the callbacks' ``event``; one that raises is the run's failure (the first, if several processes
        fail), named in one line. In a control message's handler under torchrun (``handling``) the error is recorded,
        not raised into RPC: rank 0's main thread ends the run with it (the workers are stopped with the job)."""
        try:
            self.callbacks.fire(event, *args)
        except CallbackError as exc:
            self.callback_failed = self.callback_failed or not self.failure
            self.fail(str(exc))
            if not (handling and self.engine == "torchrun"):
                raise


class LocalControl:
    """The control messages of a worker in the front's own process: handled at once, on the caller's thread."""

    def __init__(self, front: RunFront) -> None:
        self.front = front

    def send(self, msg: Any) -> Any:
        return self.front.handle(msg)


def _own(environment: dict[str, Any]) -> dict[str, Any]:
    """A recorded environment without its workers' (those that differ from the process that recorded it)."""
    return {k: v for k, v in environment.items() if k != "workers"}


def _round(checkpoint: Path) -> str:
    """``round 8`` for ``…/checkpoints/round-00000008``."""
    return f"round {int(checkpoint.name.removeprefix('round-'))}" if checkpoint.name[6:].isdigit() else checkpoint.name
