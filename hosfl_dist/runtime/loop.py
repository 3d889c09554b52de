"""The training loop every runtime shares: rounds until the processed-samples budget, evaluations at thresholds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hosfl_dist.algorithms.base import WorkerBase
from hosfl_dist.config import Config


def eval_points(budget: int, every: int) -> list[int]:
    """Processed-sample thresholds at which to evaluate: 0, every, 2·every, …, and the budget."""
    pts = list(range(0, budget, every)) + [budget]
    return sorted(set(pts))


def train_loop(
    cfg: Config,
    worker: WorkerBase,
    on_eval: Callable[[int, int], None],
    progress: Any = None,
) -> tuple[int, int]:
    """Run rounds until ``train.budget_samples`` processed samples; evaluate at the thresholds (leader only).

    Returns (rounds run, processed samples). Every client worker runs this loop in lockstep; ``on_eval`` runs on
    every worker after the leader evaluated (the torchrun runtime sums its workers' traffic counters there).
    """
    budget = cfg.train.budget_samples
    points = eval_points(budget, cfg.train.eval_every_samples)[1:]  # 0 is evaluated before the first round
    t = processed = 0
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
    return t, processed
