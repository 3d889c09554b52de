"""The Python API: a run from a notebook or a script, exactly as ``python -m hosfl_dist.run`` runs it in one process.

    import hosfl_dist

    class Rows(hosfl_dist.Callback):
        def __init__(self): self.rows = []
        def on_evaluate(self, row): self.rows.append(row)

    run = hosfl_dist.train("configs/quickstart.yaml", ["train.budget_samples=6000"], callbacks=[Rows()])
    run.summary["final_eval_accuracy"], run.metrics[-1]
    hosfl_dist.load_run(run.out_dir)                       # any run's folder, later

The run's folder, lock, logs, record and ways of ending are the command's (:func:`hosfl_dist.cli.run.train_here`);
what differs is that an error is raised, not turned into a line and an exit code: a
:class:`~hosfl_dist.errors.ConfigError` for bad input, a :class:`~hosfl_dist.errors.CallbackError` for a callback
that raised, the run's own error otherwise (summary.json records it, as the command does). The process is left as it
was found: the torch threads, the signal handlers and the package's log handler are restored when ``train`` returns
or raises.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from hosfl_dist.cli.run import run_config, train_here
from hosfl_dist.config import Config
from hosfl_dist.logs import ROOT
from hosfl_dist.runfolder.run import Run
from hosfl_dist.runtime.callbacks import Callback


def train(
    config: str | Path | Config | None,
    overrides: Iterable[str] = (),
    callbacks: Iterable[Callback] = (),
    plugins: Iterable[str] = (),
) -> Run:
    """Train one run in this process and return it (:class:`~hosfl_dist.runfolder.run.Run`: ``out_dir``, ``summary``,
    ``metrics``).

    ``config``: a YAML file, a :class:`~hosfl_dist.config.Config`, or None for the defaults; ``overrides``: dotted
    ``section.key=value`` strings on top of it; ``callbacks``: :class:`~hosfl_dist.Callback` instances, called after
    those the config names (``job.callbacks``); ``plugins``: modules imported first, like ``--plugin``. A run whose
    folder holds it completed already (``job.resume=auto``) is returned as it is."""
    cfg = run_config(config, tuple(overrides), tuple(plugins))
    log = logging.getLogger(ROOT)
    handlers, level = list(log.handlers), log.level
    try:
        _, folder = train_here(cfg, list(callbacks))
    finally:  # the process as it was: train_here's logging set-up undone (threads and signals undo themselves)
        for handler in [h for h in log.handlers if h not in handlers]:
            log.removeHandler(handler)
        for handler in handlers:
            if handler not in log.handlers:
                log.addHandler(handler)
        log.setLevel(level)
    return Run(folder)
