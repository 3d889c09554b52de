"""Calls into a plug-in's code (``job.plugins``, ``--plugin``): whatever it raises is one line naming the plug-in.

    with plugin_call(spec.load, f"task {spec.name}: load(data section, job.seed)"):
        data = spec.load(cfg.data, cfg.job.seed)

A registry entry (a task, a model, a model source) holds functions the user wrote, which the package calls while it
builds and trains. An exception they raise (``SystemExit`` included) is a :class:`~hosfl_dist.errors.PluginError`:
``plug-in mytask: task soft_blobs: metric eval_top2_accuracy(outputs, labels) raised ZeroDivisionError: …``, not the
traceback through the package's frames. The package's own entries are the same registries' (their functions live in
``hosfl_dist``): their errors pass through as they are, and so does one of the package's own errors (a DataError) a
plug-in raises on purpose.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from hosfl_dist.errors import HosflError, PluginError, first_line


def plugin_of(fn: Any) -> str | None:
    """The module outside the package that defined ``fn`` (a plug-in's), or None for the package's own."""
    module = getattr(fn, "__module__", None) if fn is not None else None
    if not isinstance(module, str) or module == "hosfl_dist" or module.startswith("hosfl_dist."):
        return None
    return module


@contextlib.contextmanager
def plugin_call(fn: Any, what: str) -> Iterator[None]:
    """Run the block, in which ``fn`` is called (``what`` says how); if ``fn`` is a plug-in's, what the block raises is
    one :class:`PluginError` line naming the plug-in and ``what``."""
    try:
        yield
    except HosflError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a plug-in's bug, said in one line
        module = plugin_of(fn)
        if module is None:
            raise
        said = f"{type(exc).__name__}: {first_line(exc)}"
        if isinstance(exc, SystemExit):
            said = f"SystemExit({exc.code!r})"
        raise PluginError(f"plug-in {module}: {what} raised {said}") from exc


def refuse(fn: Any, what: str, why: str) -> PluginError:
    """A one-line PluginError for what ``fn`` (a plug-in's) gave: ``plug-in M: WHAT WHY``."""
    module = plugin_of(fn)
    return PluginError(f"{'plug-in ' + module + ': ' if module else ''}{what} {why}")
