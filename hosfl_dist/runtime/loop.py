"""The training loop every runtime shares: rounds until the processed-samples budget, evaluations at thresholds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hosfl_dist.algorithms.base import WorkerBase
from hosfl_dist.config import Config
from hosfl_dist.runtime.checkpoint import LoopState


def eval_points(budget: int, every: int) -> list[int]:
    """Processed-sample thresholds at which to evaluate: 0, every, 2·every, …, and the budget."""
    pts = list(range(0, budget, every)) + [budget]
    return sorted(set(pts))


def train_loop(
    cfg: Config,
    worker: WorkerBase,
    on_eval: Callable[[int, int], None],
    progress: Any = None,
    start: LoopState | None = None,
    after_round: Callable[[int, int], bool] | None = None,
) -> tuple[int, int]:
    """Run rounds until ``train.budget_samples`` processed samples; evaluate at the thresholds (leader only).

    Returns (rounds run, processed samples). Every client worker runs this loop in lockstep; ``on_eval`` runs on
    every worker after the leader evaluated (the torchrun runtime sums its workers' traffic counters there).
    ``start``: resume after a checkpoint (its thresholds were evaluated already). ``after_round(t, processed)`` runs
    at every round boundary, after any evaluation (checkpoints are taken there); True stops the loop early.
    """
    budget = cfg.train.budget_samples
    t, processed = (start.round, start.processed) if start is not None else (0, 0)
    points = [p for p in eval_points(budget, cfg.train.eval_every_samples)[1:] if p > processed]
    if progress is not None:
        progress.update(min(processed, budget))
    if start is None:  # 0 is evaluated before the first round
        if worker.collective.is_leader:
            worker.evaluate(t)
        on_eval(t, processed)
    while processed < budget:
        processed += worker.run_round(t)
        t += 1
        if progress is not None:
            progress.update(min(processed, budget) - progress.n)
        if points and processed >= points[0]:
            while points and processed >= points[0]:  # a round can cross several thresholds: evaluate once
                points.pop(0)
            if worker.collective.is_leader:
                worker.evaluate(t)
            on_eval(t, processed)
        if after_round is not None and after_round(t, processed):
            break
    return t, processed
