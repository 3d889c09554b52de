"""Early stopping (``train.early_stopping``): whether a run's metrics rows say it should end before its budget.

    stopper = EarlyStopping.of(cfg.train.early_stopping)      # None where it is off
    for row in rows: asked = stopper.update(row)             # the reason once the criterion is met, else None

The decision is a pure function of the metrics rows, in the order written: the best value of ``metric`` so far
(from the first row that holds it, round 0's included), and the evaluations since it improved by more than
``min_delta``; ``patience`` of them in a row end the run. A resumed run rebuilds it from the rows it kept, and a
run's folder says whether its own criterion ended it (:func:`stops_at`) without running anything. Lightning's
``EarlyStopping`` (monitor, patience, min_delta, mode) and HF's ``EarlyStoppingCallback`` decide the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from hosfl_dist.config import EarlyStoppingConfig

LOWER_IS_BETTER = ("loss", "perplexity", "error", "mae", "mse")
"""Words in a metric's name that make it an error (a plug-in task's ``eval_mae``): its best is its lowest."""


def higher_is_better(metric: str) -> bool:
    """The direction of a metric that says none: an error's best is its lowest (:data:`LOWER_IS_BETTER`)."""
    return not any(word in metric for word in LOWER_IS_BETTER)


class EarlyStopping:
    """The criterion over the rows seen so far (:meth:`update` them in order)."""

    def __init__(self, metric: str, patience: int, min_delta: float = 0.0, mode: str = "auto") -> None:
        self.metric = metric
        self.patience = patience
        self.min_delta = min_delta
        self.maximize = higher_is_better(metric) if mode == "auto" else mode == "max"
        self.best: float | None = None
        self.best_round: int | None = None
        self.waited = 0
        """Evaluations since the best one (those without an improvement of more than ``min_delta``)."""

    @classmethod
    def of(cls, section: EarlyStoppingConfig) -> EarlyStopping | None:
        """The criterion ``train.early_stopping`` sets (None where its metric is empty: off)."""
        if not section.metric:
            return None
        return cls(section.metric, section.patience, section.min_delta, section.mode)

    def improves(self, value: float) -> bool:
        if self.best is None:
            return True
        return value - self.best > self.min_delta if self.maximize else self.best - value > self.min_delta

    def update(self, row: dict[str, Any]) -> str | None:
        """Take one metrics row; the reason to stop once ``patience`` evaluations in a row did not improve (None
        otherwise). A row without a finite value of the metric (round 0's ``train_loss``) is not an evaluation of
        it."""
        value = row.get(self.metric)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        if self.improves(float(value)):
            self.best, self.best_round, self.waited = float(value), row.get("round"), 0
            return None
        self.waited += 1
        if self.waited < self.patience:
            return None
        way = "rise" if self.maximize else "fall"
        return (f"{self.metric} {value:.6g} at round {row.get('round')}: {self.waited} evaluation(s) without a {way} "
                f"of more than {self.min_delta:g} from the best, {self.best:.6g} at round {self.best_round} "
                f"(patience {self.patience})")  # fmt: skip


def stops_at(rows: Iterable[dict[str, Any]], section: EarlyStoppingConfig) -> dict[str, Any] | None:
    """Where ``section``'s criterion ends a run with these rows: the round and the reason (None: it never does)."""
    stopper = EarlyStopping.of(section)
    if stopper is None:
        return None
    for row in rows:
        reason = stopper.update(row)
        if reason is not None:
            return {"round": row.get("round"), "reason": reason}
    return None
