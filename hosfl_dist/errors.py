"""Errors that the CLI turns into one-line messages."""

from __future__ import annotations

import difflib
import errno
import os
import re
from collections.abc import Iterable


def first_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's first line (its type's name when it has no message), at most ``limit`` characters: what a
    one-line error quotes of an error from below (torch, RPC, a library)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:limit]


def close_to(word: object, choices: Iterable[object]) -> str | None:
    """The choice ``word`` was most likely meant to be (difflib's ratio of at least 0.6, case folded), or None when
    none is close: what a "did you mean" names."""
    if not isinstance(word, str):
        return None
    by_folded = {str(c).lower(): str(c) for c in choices}
    found = difflib.get_close_matches(word.lower(), list(by_folded), n=1, cutoff=0.6)
    return by_folded[found[0]] if found else None


def did_you_mean(word: object, choices: Iterable[object], prefix: str = "", quote: bool = False) -> str:
    """``"; did you mean X?"`` for the choice closest to ``word`` (:func:`close_to`; ``quote``: X as repr), or ``""``
    when none is close: the end of a message that names the choices."""
    found = close_to(word, choices)
    if found is None:
        return ""
    return f"; did you mean {prefix}{found!r}?" if quote else f"; did you mean {prefix}{found}?"


class HosflError(Exception):
    """Base of the errors the command line reports in one line, without a traceback."""

    exit_code = 2
    """The process exit code: 2 for bad input (the default), 1 for a run that failed while training."""


class ConfigError(HosflError, ValueError):
    """A configuration value is missing, unknown or invalid."""


class DataError(HosflError):
    """A data set cannot be found or read."""


class NonFiniteError(HosflError):
    """A non-finite activation, gradient, loss or scalar (``train.on_nonfinite=stop``): the run stops, failed."""

    exit_code = 1


class Interrupted(HosflError):
    """SIGTERM or SIGINT: the run checkpointed (where it could) and stopped; summary.json says ``interrupted``. Exit
    code 130 after SIGINT (Ctrl-C, as a shell reports it), 1 after SIGTERM (what torchrun and Slurm's requeue read)."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.by_ctrl_c = message.startswith("SIGINT")
        if self.by_ctrl_c:
            self.exit_code = 130


class ProtocolError(HosflError):
    """A client call the server refuses (fail closed): a client not sampled in the round, a malformed upload."""

    exit_code = 1


class CallbackError(HosflError):
    """A callback (``job.callbacks``, or one handed to :func:`hosfl_dist.train`) raised: the run stops, failed, with the
    rows written so far; the message names the callback and the event."""

    exit_code = 1


class PluginError(HosflError):
    """A plug-in's code (a task, model or model source registered by ``job.plugins`` / ``--plugin``) raised, or gave
    what its spec says it must not (a metric's scores of the wrong shape): one line naming the plug-in, what of it was
    called and what it raised. Exit code 2: a plug-in is input, like the config that names it."""


class ArgumentError(ConfigError, TypeError):
    """An argument of the Python API (:func:`hosfl_dist.train`, :func:`hosfl_dist.load_run`) of the wrong type: one
    line naming the argument, what it takes and what it was given. A ConfigError (exit code 2 where a command reports
    it) and a TypeError (what Python raises for a wrong argument type)."""


class WriteError(HosflError):
    """A file could not be written: the disk is full, a quota is reached, the file system is read-only, or the folder
    is not writable. What was written before stays; the command ends with one line and exit code 2."""


WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})
"""The errors of a write that the machine refused (not a bug): full disk, quota, read-only file system, file size."""
DENIED_ERRNOS = frozenset({errno.EACCES, errno.EPERM})
"""Permission refused: a write the machine refused where the caller knows the failure was a write."""

_WRAPPED_OS_ERROR = re.compile(r"Os \{ code: (\d+)")  # safetensors: IoError(Os { code: 28, kind: StorageFull, ... })


def write_failure(
    exc: BaseException, where: str | os.PathLike[str] | None = None, denied: bool = False
) -> WriteError | None:
    """``exc`` as a one-line :class:`WriteError` naming what could not be written and where, when it is a write the
    machine refused: an OSError of :data:`WRITE_ERRNOS` (with ``denied``, of :data:`DENIED_ERRNOS` too: the caller
    was writing), or torch's or safetensors' wrapping of one (torch.save says ``file write failed``, safetensors
    ``IoError(Os { code: 28 … })``). None for anything else."""
    if isinstance(exc, WriteError):
        return exc
    code = exc.errno if isinstance(exc, OSError) else None
    text = str(exc)
    if code is None and not isinstance(exc, OSError):
        found = _WRAPPED_OS_ERROR.search(text)
        if found is not None:
            code = int(found.group(1))
        elif "file write failed" in text or "unexpected pos" in text:
            code = errno.ENOSPC  # torch's zip writer does not say why; a full disk is what makes it fail
    if code not in WRITE_ERRNOS and not (denied and code in DENIED_ERRNOS):
        return None
    filename = getattr(exc, "filename", None) or where
    place = f" {filename}" if filename else ""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else os.strerror(code)
    return WriteError(f"cannot write{place}: {reason}")
