"""The trainer: one run's training loop, from a client worker's side, the same in every runtime.

    Trainer(cfg, worker, ...).train()      resume -> rounds until the budget -> the end-of-run report

A run is rounds until ``train.budget_samples`` processed samples (paper App. B.5), evaluated by the leader worker at
0, every ``train.eval_every_samples`` and the budget, checkpointed every ``checkpoint.interval_samples`` and when a
signal stops it. It ends earlier where it is asked to (a callback's ``control.should_training_stop``,
``run.should_stop``, ``train.early_stopping``: :mod:`hosfl_dist.runtime.callbacks`): after that round it is
evaluated (where the round was not), checkpointed and reported like a run that reached its budget, with what asked
(summary.json ``status: "stopped"``). The workers agree on both ends at each round's end (``peers.any``): on a signal,
and on the leader's request, which holds its own callbacks' and those of the front's answers (rank 0's callbacks,
early stopping on the metrics row). What differs between runtimes is handed in as components:

- ``worker``: the algorithm's worker, over its transport (in-process, or RPC; with the emulated link) and collective;
- ``peers``: the other client workers (:mod:`hosfl_dist.runtime.peers`): agreeing to stop, summing traffic counters,
  waiting for what only the leader does;
- ``control``: the typed control messages to the run's front (:mod:`hosfl_dist.runtime.control`), which writes the
  record and the checkpoints on the server side;
- ``evaluator`` (the leader), ``progress`` (the process that shows it), ``stop`` (signals), the transport's
  statistics and the emulated link (torchrun and ``comm.inject_delay``: reported in the summary);
- ``extra``: what a runtime adds to the leader's checkpoint part (an elastic run's membership).

The rounds themselves are the worker's (its method's ``run_round``), opened and closed through the rounds component
it was built with: planned (every process draws the same plan) or live (decided at the server's round gate, in an
elastic run and under torchrun with ``server.round_timeout_s``).

The checkpoint cadence, resume and the end of the run are written here once (:class:`CheckpointManager` for the
checkpoints), for every runtime.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hosfl_dist.algorithms.base import WorkerBase
from hosfl_dist.config import Config
from hosfl_dist.runtime.callbacks import Callbacks
from hosfl_dist.runtime.checkpoint import CheckpointManager
from hosfl_dist.runtime.control import EvalReport, FinalReport, Stopped
from hosfl_dist.runtime.peers import Peers
from hosfl_dist.transport.wire import CommMeter

logger = logging.getLogger(__name__)


def eval_points(budget: int, every: int) -> list[int]:
    """Processed-sample thresholds at which to evaluate: 0, every, 2·every, …, and the budget."""
    pts = list(range(0, budget, every)) + [budget]
    return sorted(set(pts))


@dataclass(frozen=True)
class Outcome:
    rounds: int
    processed: int
    completed: bool
    """False: stopped by a signal after a checkpoint (the front records the run as interrupted)."""
    stopped: bool = False
    """Ended before its budget because it was asked to (the front records it as stopped): it completed otherwise."""


class RoundTimer:
    """A worker's round times and, where the transport keeps statistics (RPC), its time blocked in rounds."""

    def __init__(self, stats: Any = None) -> None:
        self.stats = stats
        self.in_rounds = type(stats)() if stats is not None else None
        self.rounds = 0
        self.round_s = 0.0
        self.first_round_s = 0.0

    def run(self, worker: WorkerBase, t: int) -> int:
        before = self.stats.copy() if self.stats is not None else None
        start = time.perf_counter()
        n = worker.run_round(t)
        took = time.perf_counter() - start
        self.round_s += took
        self.first_round_s = self.first_round_s or took  # connections and caches warm up in the first round
        self.rounds += 1
        if self.stats is not None:
            self.in_rounds.add_delta(self.stats, before)
        return n

    def summary(self) -> dict[str, Any]:
        """Timing of the training rounds (evaluation and reports excluded)."""
        return {
            "rounds": self.rounds,
            "round_s": round(self.round_s, 6),
            "first_round_s": round(self.first_round_s, 6),
            **(self.in_rounds.as_dict() if self.in_rounds is not None else {}),
        }


class Trainer:
    def __init__(
        self,
        cfg: Config,
        worker: WorkerBase,
        *,
        rank: int,
        peers: Peers,
        control: Any,
        meter: CommMeter,
        stop: Any,
        memory: Callable[[], dict[str, Any]],
        evaluator: Any = None,
        progress: Any = None,
        stats: Any = None,
        link: Any = None,
        callbacks: Callbacks | None = None,
        extra: Any = None,
    ) -> None:
        self.cfg = cfg
        self.worker = worker
        self.rank = rank
        self.peers = peers
        self.control = control
        self.meter = meter
        self.stop = stop
        self.memory = memory
        self.evaluator = evaluator
        self.progress = progress
        self.link = link
        self.callbacks = callbacks if callbacks is not None else Callbacks()
        """The leader's callbacks (``on_round_end``) and its stop request (``control``); the others' are the front's."""
        self.timer = RoundTimer(stats)
        self.round: int | None = None
        """The rounds run so far (resumed ones included), once training started."""
        self.checkpoints = CheckpointManager(cfg, rank, worker, meter, peers, control, extra)

    def train(self) -> Outcome:
        """Resume or start, run rounds until the budget (or a signal), and report the end; cleans up after itself."""
        try:
            return self._train()
        finally:
            self.cleanup()

    def _train(self) -> Outcome:
        budget = self.cfg.train.budget_samples
        start = self.checkpoints.resume()
        t, processed = (start.round, start.processed) if start is not None else (0, 0)
        self.round = t
        points = [p for p in eval_points(budget, self.cfg.train.eval_every_samples)[1:] if p > processed]
        self._advance(processed)
        if start is None:  # 0 is evaluated before the first round
            self.evaluate(t, processed)
        asked = False
        while processed < budget:
            began = time.perf_counter()
            samples = self.timer.run(self.worker, t)
            processed += samples
            t = self.round = t + 1
            if self.callbacks and self.peers.is_leader:
                info = {"processed": processed, "samples": samples, "seconds": time.perf_counter() - began}
                self.callbacks.fire("on_round_end", t, info)
            self._advance(processed)
            evaluated = bool(points) and processed >= points[0]
            if evaluated:
                while points and processed >= points[0]:  # a round can cross several thresholds: evaluate once
                    points.pop(0)
                self.evaluate(t, processed)
            stopping = self.peers.any(self.stop.signal is not None)  # every worker agrees
            # asked to end here (the leader's callbacks, or the front's with its answers): every worker agrees too; a
            # request in the last round, or beside a signal, changes nothing (the run ends as it would have)
            asked = not stopping and processed < budget and self.peers.any(self._asked() is not None)
            if asked and not evaluated:  # a stopped run's last row is of its last round, as a finished run's
                self.evaluate(t, processed)
            if stopping or asked or self.checkpoints.due(processed):
                self._heard(self.checkpoints.save(t, processed))
            if stopping and processed < budget:  # a signal in the last round: the run ends as it would have
                if self.peers.is_leader:
                    self.control.send(Stopped(t, self.stop.signal or "SIGTERM"))
                return Outcome(t, processed, completed=False)
            if asked:
                break
        if self.cfg.checkpoint.final and self.checkpoints.last != processed:  # what export reads (a finished run)
            self.checkpoints.save(t, processed)  # a request heard here comes after the last round: nothing to stop
        self.finish(t, processed, self._asked() if asked else None)
        return Outcome(t, processed, completed=True, stopped=asked)

    def _asked(self) -> dict[str, str] | None:
        """The leader's request to end the run after this round (None: none); the other workers have none."""
        return self.callbacks.control.request() if self.peers.is_leader else None

    def _heard(self, answer: Any) -> None:
        """The front's answer to the leader's report: its callbacks' or early stopping's request, if any, is the
        leader's (the workers agree on it at the round's end)."""
        stop = answer.get("stop") if isinstance(answer, dict) else None
        if stop:
            self.callbacks.control.stop(stop.get("by", "the run's front"), stop.get("reason", ""))

    def evaluate(self, t: int, processed: int) -> None:
        """The leader evaluates θ of round t and sends the metrics row; the others wait for it.

        The others wait through the store, as long as ``train.eval_timeout_s`` allows, and only then enter the
        collectives below, whose timeout (``server.collective_timeout_s``) is for a collective, not an evaluation.
        """
        key = f"evaluated/{t}"
        if self.peers.is_leader:
            self.worker.transport.flush()  # the last round is closed on the server (its error, if any, here)
            if self.progress is not None:  # an LM's evaluation takes a while: not after a silent 100 %
                self.progress.evaluating(t, processed)
            self.evaluator.evaluate(t)
            self.peers.post(key)
        else:
            try:
                self.peers.wait_for(key, self.cfg.train.eval_timeout_s)
            except TimeoutError:
                raise TimeoutError(f"the leader's evaluation after round {t} took longer than "
                                   f"train.eval_timeout_s={self.cfg.train.eval_timeout_s:g} s") from None  # fmt: skip
        comm = self.peers.sum_counts(self.meter.snapshot())
        if self.peers.is_leader:
            shown = self.control.send(EvalReport(t, processed, comm))
            self._heard(shown)
            if self.progress is not None:
                self.progress.show({k: v for k, v in (shown or {}).items() if k != "stop"})
        self.peers.barrier()  # no worker starts the next round before the row is written

    def finish(self, t: int, processed: int, stopped: dict[str, str] | None = None) -> None:
        """Bring every replica to round t, and send the front what the summary needs from the workers (``stopped``:
        the leader's, where the run was asked to end before its budget)."""
        if self.progress is not None:
            self.progress.close()
        if self.peers.is_leader:
            end = (f"stopped early after {t} rounds ({stopped['by']})" if stopped is not None
                   else f"budget reached after {t} rounds")  # fmt: skip
            logger.info(f"{end}: {self.worker.sync_all_words(t)}, checking the client digests against the server's, "
                        "writing summary.json")  # fmt: skip
        self.worker.transport.flush()
        self.worker.sync_all(t)  # e.g. Algorithm 3 up to round t for every hosted replica: digests are comparable
        link = self.link.summary() if self.link is not None else None
        mine = (self.rank, self.worker.client_digest(), self.timer.summary(), link, self.memory())
        everyone = self.peers.gather(mine)
        comm = self.peers.sum_counts(self.meter.snapshot())
        if self.peers.is_leader:
            report = FinalReport(
                rounds=t,
                processed=processed,
                comm=comm,
                client_digests={_label(r): digest for r, digest, _, _, _ in everyone if digest is not None},
                transport={_label(r): timing for r, _, timing, _, _ in everyone if timing is not None},
                memory=[mem for *_, mem in everyone if mem is not None],
                link=sum_links([lk for _, _, _, lk, _ in everyone if lk is not None]),
                stopped=stopped,
            )
            self.control.send(report)

    def _advance(self, processed: int) -> None:
        if self.progress is not None:
            self.progress.advance_to(processed)

    def cleanup(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.link is not None:
            self.link.close()


def _label(rank: int | str) -> str:
    """A worker's key in summary.json: ``worker_<rank>``, or an elastic member's own name."""
    return rank if isinstance(rank, str) else f"worker_{rank}"


def sum_links(links: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The workers' emulated links: the settings once, what they carried summed."""
    if not links:
        return None
    out = dict(links[0])
    for other in links[1:]:
        for k, v in other.items():
            if k not in ("uplink_mbps", "downlink_mbps", "rtt_ms"):
                out[k] += v
    return out
