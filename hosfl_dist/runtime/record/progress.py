"""Progress on the console: a samples bar with the last evaluation beside it, on the process that shows it."""

from __future__ import annotations

from typing import Any

from hosfl_dist.config import Config

EVAL_SHOWN = ("eval_accuracy", "eval_f1", "eval_exact_match", "eval_loss")
"""The evaluation statistics the progress bar shows (those a task reports)."""


class Progress:
    """A samples progress bar on stderr (nothing with ``job.progress=false``)."""

    def __init__(self, cfg: Config) -> None:
        self.total = cfg.train.budget_samples
        self.bar: Any = None
        if cfg.job.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="samples", desc=cfg.job.name, dynamic_ncols=True)

    def advance_to(self, processed: int) -> None:
        if self.bar is not None:
            self.bar.update(min(processed, self.total) - self.bar.n)

    def show(self, row: dict[str, Any] | None) -> None:
        show_eval(self.bar, row)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def show_eval(bar: Any, row: dict[str, Any] | None) -> None:
    """The last evaluation beside the progress bar (e.g. ``round 120: eval_accuracy 85.3%, eval_loss 0.412``)."""
    if bar is None or not row:
        return
    shown = [f"{k} {row[k]:.1%}" if k.endswith(("accuracy", "f1", "exact_match")) else f"{k} {row[k]:.3g}"
             for k in EVAL_SHOWN if isinstance(row.get(k), (int, float))]  # fmt: skip
    bar.set_postfix_str(f"round {row['round']}: " + ", ".join(shown), refresh=True)
