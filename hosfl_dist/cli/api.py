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
:class:`~hosfl_dist.errors.ConfigError` for bad input (an :class:`~hosfl_dist.errors.ArgumentError`, also a
TypeError, for an argument of the wrong type), a :class:`~hosfl_dist.errors.CallbackError` for a callback that raised,
a :class:`~hosfl_dist.errors.PluginError` for a plug-in that did, the run's own error otherwise (summary.json records
it, as the command does). The process is left as it was found: the torch threads, the signal handlers and the
package's log handler are restored when ``train`` returns or raises.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hosfl_dist.cli.run import run_config, train_here
from hosfl_dist.config import Config
from hosfl_dist.errors import ArgumentError
from hosfl_dist.logs import ROOT
from hosfl_dist.runfolder.run import Run
from hosfl_dist.runtime.callbacks import Callback, is_callback, resolve


def train(
    config: str | Path | Config | None,
    overrides: Iterable[str] = (),
    callbacks: Iterable[Callback | str] = (),
    plugins: Iterable[str] = (),
) -> Run:
    """Train one run in this process and return it (:class:`~hosfl_dist.runfolder.run.Run`: ``out_dir``, ``summary``,
    ``metrics``).

    ``config``: a YAML file, a :class:`~hosfl_dist.config.Config`, or None for the defaults; ``overrides``: dotted
    ``section.key=value`` strings on top of it; ``callbacks``: :class:`~hosfl_dist.Callback` instances, or
    ``module:Class`` names as ``job.callbacks`` takes them, called after those the config names; ``plugins``: modules
    imported first, like ``--plugin``. A run whose folder holds it finished already (``job.resume=auto``) is returned
    as it is. An argument of the wrong type is an :class:`~hosfl_dist.errors.ArgumentError` naming it."""
    config = _config(config)
    overrides = _strings("overrides", overrides, "'section.key=value' strings, e.g. ['train.budget_samples=6000']")
    plugins = _strings("plugins", plugins, "module names, e.g. ['mymethod']")
    given, named = _callbacks(callbacks)
    cfg = run_config(config, overrides, plugins)
    if named:  # as if the config named them (job.callbacks): checked, then built where the config's are
        for spec in named:
            resolve(spec)
        listed = [*cfg.job.callbacks, *(n for n in dict.fromkeys(named) if n not in cfg.job.callbacks)]
        cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, callbacks=listed))
    log = logging.getLogger(ROOT)
    handlers, level = list(log.handlers), log.level
    try:
        _, folder = train_here(cfg, given)
    finally:  # the process as it was: train_here's logging set-up undone (threads and signals undo themselves)
        for handler in [h for h in log.handlers if h not in handlers]:
            log.removeHandler(handler)
        for handler in handlers:
            if handler not in log.handlers:
                log.addHandler(handler)
        log.setLevel(level)
    return Run(folder)


def _shown(value: Any) -> str:
    return f"{type(value).__name__} ({value!r:.60})"


def _config(config: Any) -> str | Path | Config | None:
    if config is None or isinstance(config, (str, Config, os.PathLike)):
        return config
    raise ArgumentError(f"hosfl_dist.train: config must be a YAML file's path (str or pathlib.Path), a "
                        f"hosfl_dist.config.Config or None, not {_shown(config)}")  # fmt: skip


def _strings(name: str, values: Any, what: str) -> tuple[str, ...]:
    """``values`` as a tuple of strings: a list, tuple or other iterable of str (None: none). One string is refused,
    not taken letter by letter."""
    if values is None:
        return ()
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        hint = f" (one string: write [{values!r:.60}])" if isinstance(values, str) else ""
        raise ArgumentError(f"hosfl_dist.train: {name} must be a list of {what}, not {_shown(values)}{hint}")
    out = tuple(values)
    bad = [(i, v) for i, v in enumerate(out) if not isinstance(v, str)]
    if bad:
        i, v = bad[0]
        raise ArgumentError(f"hosfl_dist.train: {name}[{i}] must be a str ({what}), not {_shown(v)}")
    return out


def _callbacks(callbacks: Any) -> tuple[list[Any], list[str]]:
    """The callback instances, and the ``module:Class`` names, of ``callbacks`` (ArgumentError for anything else)."""
    if callbacks is None:
        return [], []
    if isinstance(callbacks, (str, bytes)) or is_callback(callbacks) or not isinstance(callbacks, Iterable):
        raise ArgumentError(f"hosfl_dist.train: callbacks must be a list of hosfl_dist.Callback instances or "
                            f"'module:Class' names, not {_shown(callbacks)} (one callback: write [it])")  # fmt: skip
    given, named = [], []
    for i, cb in enumerate(callbacks):
        if isinstance(cb, str):
            named.append(cb)
        elif is_callback(cb):
            given.append(cb)
        else:
            hint = f" (a class: pass an instance, {cb.__name__}())" if isinstance(cb, type) else ""
            raise ArgumentError(f"hosfl_dist.train: callbacks[{i}] is not a hosfl_dist.Callback instance or a "
                                f"'module:Class' name: {_shown(cb)}{hint}")  # fmt: skip
    return given, named
