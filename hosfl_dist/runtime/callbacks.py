"""Callbacks: user code that watches a run, called by the process that owns each event, and may end it early.

    class Collector(hosfl_dist.Callback):
        def on_evaluate(self, row): self.rows.append(row)

    class StopAt20(hosfl_dist.Callback):
        def on_round_end(self, round, info, control):
            control.should_training_stop = round >= 20

==================  ===========================================  ====================================================
event               when                                         where (in one process: there; under torchrun)
==================  ===========================================  ====================================================
on_train_start      the run's folder is locked, its record open  rank 0 (the front)
on_round_end        after each round the worker ran              the leader client worker
on_evaluate         a metrics row was written (the row)          rank 0 (the process that writes metrics.jsonl)
on_checkpoint       a checkpoint was written (its folder)        rank 0
on_train_end        a finished run's summary.json was written    rank 0
==================  ===========================================  ====================================================

**Stopping.** An event method that takes a ``control`` argument is given the process's :class:`TrainingControl`
(HF's ``TrainerControl``): ``control.should_training_stop = True`` ends the run after the current round; the
:class:`~hosfl_dist.runfolder.run.Run` that ``on_train_start`` is given does the same with ``run.should_stop = True``
(Lightning's ``trainer.should_stop``). The run then evaluates (where the round was not evaluated), writes its final
checkpoint, its curves and summary.json with ``status: "stopped"`` (:class:`~hosfl_dist.runtime.trainer.Trainer`).
Under torchrun the leader worker's request (``on_round_end``) and rank 0's (the other events, which reach the leader
with the front's answers) are shared among the workers at the round's end, as a signal is.

Callbacks named in the config (``job.callbacks: [module:Class]``) are built without arguments in each process that
owns one of the events; :func:`hosfl_dist.train` also takes instances (and ``module:Class`` names). A callback that
raises, ``SystemExit`` included, stops the run: a :class:`~hosfl_dist.errors.CallbackError` naming it and the
event, summary.json ``failed``, the rows written so far kept (a ``KeyboardInterrupt`` is what Ctrl-C raises: the run
is interrupted at once). One that raises in ``on_train_end``, after summary.json recorded the run's end, leaves that
record as it is and is written beside it (``callback_error``).
"""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hosfl_dist.errors import CallbackError, ConfigError

EVENTS = ("on_train_start", "on_round_end", "on_evaluate", "on_checkpoint", "on_train_end")


class Callback:
    """Override the events you need; each does nothing by default."""

    def on_train_start(self, run: Any) -> None:
        """The run started (or resumed): ``run`` is a :class:`~hosfl_dist.runfolder.run.Run` of its folder."""

    def on_round_end(self, round: int, info: dict[str, Any]) -> None:  # noqa: A002 - the issue's name for it
        """Round ``round`` (counted from 1) ended: ``info`` has ``processed`` (samples so far), ``samples`` (this
        round's) and ``seconds`` (its wall time on this worker). Any event may take a ``control`` argument too
        (:class:`TrainingControl`)."""

    def on_evaluate(self, row: dict[str, Any]) -> None:
        """A metrics row, as written to metrics.jsonl."""

    def on_checkpoint(self, path: str) -> None:
        """A checkpoint's folder, written and verified."""

    def on_train_end(self, summary: dict[str, Any]) -> None:
        """The run finished (``status`` completed, or stopped early): its summary.json."""


@dataclass
class TrainingControl:
    """What the callbacks of one process ask of the run (HF's ``TrainerControl``): set ``should_training_stop`` to
    end it after the current round. ``asked_by`` names who asked first (filled in by :meth:`Callbacks.fire`, or
    :meth:`stop`'s caller)."""

    should_training_stop: bool = False
    asked_by: str = ""
    reason: str = ""

    def stop(self, by: str, reason: str = "") -> None:
        """Ask the run to stop after the current round (the first request is the one recorded)."""
        if not self.should_training_stop or not self.asked_by:
            self.asked_by, self.reason = by, reason
        self.should_training_stop = True

    def request(self) -> dict[str, str] | None:
        """The request as summary.json's ``stopped`` records it (``by``, ``reason``), or None."""
        if not self.should_training_stop:
            return None
        return {"by": self.asked_by or "run.should_stop", "reason": self.reason}


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


def is_callback(obj: Any) -> bool:
    """Whether ``obj`` is a callback instance: a :class:`Callback`, or an object (not a class) with one of its
    events, as a class ``job.callbacks`` names must have."""
    if isinstance(obj, Callback):
        return True
    return not isinstance(obj, type) and any(callable(getattr(obj, e, None)) for e in EVENTS)


def _takes_control(method: Any) -> bool:
    """Whether an event method takes ``control`` (by name, or through ``**kwargs``)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # a builtin or an object that hides its signature: called without it
        return False
    return any(p.name == "control" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class Callbacks:
    """The callbacks of one process and their :class:`TrainingControl`; :meth:`fire` calls an event on each, in
    order."""

    def __init__(self, callbacks: Iterable[Any] = ()) -> None:
        self.callbacks = list(callbacks)
        self.control = TrainingControl()

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
        """Call ``event`` on each callback (with ``control=`` where its method takes it). One that raises, or calls
        ``sys.exit``, is a :class:`~hosfl_dist.errors.CallbackError` naming it and the event; a KeyboardInterrupt
        on the main thread passes through (Ctrl-C raises it there, wherever the process is), off it (an RPC handler
        under torchrun) it is the callback's."""
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if method is None:
                continue
            name = f"{type(cb).__module__}:{type(cb).__qualname__}"
            asked = self.control.should_training_stop
            try:
                if _takes_control(method):
                    method(*args, control=self.control)
                else:
                    method(*args)
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - the run fails with one line naming the callback
                raise CallbackError(f"callback {name}.{event} raised {_said(exc)}") from exc
            except KeyboardInterrupt as exc:  # Ctrl-C's, on the main thread; off it (an RPC handler) the callback's
                if threading.current_thread() is threading.main_thread():
                    raise
                raise CallbackError(f"callback {name}.{event} raised KeyboardInterrupt") from exc
            if self.control.should_training_stop and not asked and not self.control.asked_by:
                self.control.asked_by = f"callback {name}.{event}"


def _said(exc: BaseException) -> str:
    """An exception in a few words: its type and first line; ``sys.exit(code)`` as ``SystemExit(code)`` with what
    a callback does instead."""
    if isinstance(exc, SystemExit):
        return (f"SystemExit({exc.code!r}) (sys.exit ends the process, not the run: a callback ends a run with "
                "control.should_training_stop = True)")  # fmt: skip
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"
