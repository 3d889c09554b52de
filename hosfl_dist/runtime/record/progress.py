"""Progress on the console, on the process that shows it: a samples bar with the last evaluation beside it where
stderr is a terminal, periodic log lines where it is not (a file, a pipe, a batch system's log)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from hosfl_dist.config import Config

logger = logging.getLogger(__name__)

EVAL_SHOWN = ("eval_accuracy", "eval_f1", "eval_exact_match", "eval_loss")
"""The evaluation statistics the progress bar shows (those a task reports)."""
LINE_FRACTION = 0.1
"""Without a terminal: a progress line each time this fraction of the budget is done ..."""
LINE_SECONDS = 60.0
"""... or this many seconds after the previous line, whichever comes first. A bar's carriage returns written to a
file make one line of every redraw (61,172 characters for the quickstart)."""


class Progress:
    """The run's processed samples on stderr (nothing with ``job.progress=false``): a tqdm bar on a terminal,
    otherwise an INFO line every :data:`LINE_FRACTION` of the budget or :data:`LINE_SECONDS`, whichever comes first.

    ``terminal``: whether stderr is one (default: ask it)."""

    def __init__(self, cfg: Config, terminal: bool | None = None) -> None:
        self.total = cfg.train.budget_samples
        self.name = cfg.job.name
        self.bar: Any = None
        self.lines = False
        self.shown = ""
        if not cfg.job.progress:
            return
        if terminal is None:
            terminal = sys.stderr.isatty()
        if terminal:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="samples", desc=cfg.job.name, dynamic_ncols=True)
        else:
            self.lines = True
            self.start = self.last_time = time.monotonic()
            self.next_samples = self._step()

    def _step(self) -> int:
        return max(1, round(self.total * LINE_FRACTION))

    def advance_to(self, processed: int) -> None:
        if processed > self.total:  # the last round completes its batches past the budget: the figure done: says
            self.total = processed
            if self.bar is not None:
                self.bar.total = processed
        if self.bar is not None:
            self.bar.update(processed - self.bar.n)
        elif self.lines:
            now = time.monotonic()
            if processed >= self.next_samples or now - self.last_time >= LINE_SECONDS:
                self._line(processed, now)

    def _line(self, processed: int, now: float) -> None:
        elapsed = now - self.start
        rate = f", {processed / elapsed:,.0f} samples/s" if elapsed > 0 else ""
        shown = f"; {self.shown}" if self.shown else ""
        logger.info(f"{self.name}: {processed:,}/{self.total:,} samples ({processed / self.total:.0%}), "
                    f"{elapsed:.0f} s{rate}{shown}")  # fmt: skip
        self.last_time = now
        while self.next_samples <= processed:
            self.next_samples += self._step()

    def evaluating(self, t: int, processed: int) -> None:
        """An evaluation of round ``t`` begins: beside the bar, or a line (the final one, or any the minute's line
        would be due during; an LM's takes tens of seconds)."""
        what = f"evaluating round {t} ({'final' if processed >= self.total else f'{processed:,} samples'}) …"
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=True)
        elif self.lines and (processed >= self.total or time.monotonic() - self.last_time >= LINE_SECONDS / 2):
            logger.info(f"{self.name}: {what}")

    def show(self, row: dict[str, Any] | None) -> None:
        if self.lines:
            self.shown = eval_text(row)
        else:
            show_eval(self.bar, row)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.lines = False


def eval_text(row: dict[str, Any] | None) -> str:
    """The last evaluation in words, e.g. ``round 120: eval_accuracy 85.3%, eval_loss 0.412`` ("" without one)."""
    if not row:
        return ""
    shown = [f"{k} {row[k]:.1%}" if k.endswith(("accuracy", "f1", "exact_match")) else f"{k} {row[k]:.3g}"
             for k in EVAL_SHOWN if isinstance(row.get(k), (int, float))]  # fmt: skip
    return f"round {row['round']}: " + ", ".join(shown)


def show_eval(bar: Any, row: dict[str, Any] | None) -> None:
    """The last evaluation beside the progress bar (e.g. ``round 120: eval_accuracy 85.3%, eval_loss 0.412``)."""
    if bar is None or not row:
        return
    bar.set_postfix_str(eval_text(row), refresh=True)


class Counter:
    """A count of ``unit`` toward ``total`` for a command that is not a run (predict's batches): a tqdm bar where
    stderr is a terminal, else an INFO line every :data:`LINE_FRACTION` of ``total`` or :data:`LINE_SECONDS`, and
    one at the end, so a log file shows it too."""

    def __init__(self, total: int, name: str, unit: str, terminal: bool | None = None) -> None:
        self.total, self.name, self.unit, self.done = max(0, total), name, unit, 0
        self.start = self.last_time = time.monotonic()
        self.bar: Any = None
        if terminal if terminal is not None else sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit=unit, desc=name, dynamic_ncols=True)
        self.next = max(1, round(self.total * LINE_FRACTION))
        self.logged = 0

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if self.done >= self.next or now - self.last_time >= LINE_SECONDS:
            self._line(now)
            while self.next <= self.done:
                self.next += max(1, round(self.total * LINE_FRACTION))

    def _line(self, now: float) -> None:
        share = f" ({self.done / self.total:.0%})" if self.total else ""
        logger.info(f"{self.name}: {self.done:,}/{self.total:,} {self.unit}{share}, {now - self.start:.0f} s")
        self.last_time, self.logged = now, self.done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.done != self.logged:
            self._line(time.monotonic())


class Steps:
    """The steps of a long command on stderr, on a terminal and in a file alike: ``with steps("restoring the
    checkpoint"):`` logs ``restoring the checkpoint …`` as it starts and ``restoring the checkpoint: 12.3 s`` as it
    ends, so no step runs in silence."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def __call__(self, what: str) -> Any:
        import contextlib

        @contextlib.contextmanager
        def step() -> Any:
            t0 = time.monotonic()
            logger.info(f"{what} …")
            yield
            logger.info(f"{what}: {time.monotonic() - t0:.1f} s")

        return step()
