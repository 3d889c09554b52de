"""Callbacks: user code that watches a run, called by the process that owns each event.

    class Collector(hosfl_dist.Callback):
        def on_evaluate(self, row): self.rows.append(row)

==================  ===========================================  ====================================================
event               when                                         where (in one process: there; under torchrun)
==================  ===========================================  ====================================================
on_train_start      the run's folder is locked, its record open  rank 0 (the front)
on_round_end        after each round the worker ran              the leader client worker
on_evaluate         a metrics row was written (the row)          rank 0 (the process that writes metrics.jsonl)
on_checkpoint       a checkpoint was written (its folder)        rank 0
on_train_end        a completed run's summary.json was written   rank 0
==================  ===========================================  ====================================================

Callbacks named in the config (``job.callbacks: [module:Class]``) are built without arguments in each process that
owns one of the events; :func:`hosfl_dist.train` also takes instances. A callback that raises stops the run: a
:class:`~hosfl_dist.errors.CallbackError` naming it and the event, summary.json ``failed``, the rows written so far
kept.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from hosfl_dist.errors import CallbackError, ConfigError

EVENTS = ("on_train_start", "on_round_end", "on_evaluate", "on_checkpoint", "on_train_end")


class Callback:
    """Override the events you need; each does nothing by default."""

    def on_train_start(self, run: Any) -> None:
        """The run started (or resumed): ``run`` is a :class:`~hosfl_dist.runfolder.run.Run` of its folder."""

    def on_round_end(self, round: int, info: dict[str, Any]) -> None:  # noqa: A002 - the issue's name for it
        """Round ``round`` (counted from 1) ended: ``info`` has ``processed`` (samples so far), ``samples`` (this
        round's) and ``seconds`` (its wall time on this worker)."""

    def on_evaluate(self, row: dict[str, Any]) -> None:
        """A metrics row, as written to metrics.jsonl."""

    def on_checkpoint(self, path: str) -> None:
        """A checkpoint's folder, written and verified."""

    def on_train_end(self, summary: dict[str, Any]) -> None:
        """The run completed: its summary.json."""


def resolve(spec: str) -> type:
    """The class ``module:Class`` names (ConfigError in one line when it cannot be imported or is no Callback)."""
    module, _, name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except Exception as exc:  # noqa: BLE001 - whatever the module raises, the user's input is what failed
        raise ConfigError(f"job.callbacks: cannot import {spec!r} ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''})") from None  # fmt: skip
    if not (isinstance(cls, type) and any(callable(getattr(cls, e, None)) for e in EVENTS)):
        raise ConfigError(f"job.callbacks: {spec!r} is not a callback class (subclass hosfl_dist.Callback)")
    return cls


class Callbacks:
    """The callbacks of one process; :meth:`fire` calls an event on each, in order."""

    def __init__(self, callbacks: Iterable[Any] = ()) -> None:
        self.callbacks = list(callbacks)

    @classmethod
    def of(cls, specs: Iterable[str], given: Iterable[Any] = ()) -> Callbacks:
        """Those the config names (built here, without arguments), then those handed in."""
        built = []
        for spec in specs:
            try:
                built.append(resolve(spec)())
            except ConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - its constructor failed
                raise CallbackError(f"callback {spec} could not be built ({type(exc).__name__}: {exc})") from None
        return cls([*built, *given])

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def fire(self, event: str, *args: Any) -> None:
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if method is None:
                continue
            try:
                method(*args)
            except Exception as exc:  # noqa: BLE001 - the run fails with one line naming the callback
                name = f"{type(cb).__module__}:{type(cb).__qualname__}"
                text = str(exc).splitlines()[0] if str(exc) else ""
                raise CallbackError(f"callback {name}.{event} raised {type(exc).__name__}: {text}") from exc
