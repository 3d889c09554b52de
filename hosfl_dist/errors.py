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

_WRAPPED_OS_ERROR = re.compile(r"os error (\d+)|code: (\d+)|errno:? ?(\d+)", re.IGNORECASE)
"""A library's words for an OS error it wraps: safetensors' ``(os error 28)`` (earlier ``Os { code: 28 … }``), Python's
``[Errno 28]`` quoted in another exception's text."""
_WRITE_WORDS = re.compile(r"write|writing|serializ|i/o error|ioerror|flush", re.IGNORECASE)
"""What an error of a write says when it does not say why (torch's zip writer: ``file write failed``)."""
LOW_SPACE_BYTES = 1 << 20
"""Free space below which a write that failed without saying why is taken for a full disk."""


def _chain(exc: BaseException, most: int = 16) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling (``__cause__``, ``__context__``), at most
    ``most``, each once."""
    found: list[BaseException] = []
    while exc is not None and len(found) < most and all(exc is not e for e in found):
        found.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return found


def _errno_of(exc: BaseException) -> int | None:
    """The errno an exception carries: an OSError's own, or the number a library's text quotes (first match)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno
    found = _WRAPPED_OS_ERROR.search(str(exc))
    if found is not None:
        return int(next(g for g in found.groups() if g is not None))
    return None


def _nearly_full(where: str | os.PathLike[str] | None) -> bool:
    """Whether the file system of ``where`` (its nearest folder that exists) has less than :data:`LOW_SPACE_BYTES`
    free for this user."""
    if not where:
        return False
    import shutil

    place = os.path.abspath(os.fspath(where))
    while place and not os.path.isdir(place):
        parent = os.path.dirname(place)
        if parent == place:
            return False
        place = parent
    try:
        return shutil.disk_usage(place).free < LOW_SPACE_BYTES
    except OSError:
        return False


def write_failure(
    exc: BaseException, where: str | os.PathLike[str] | None = None, denied: bool = False
) -> WriteError | None:
    """``exc`` as a one-line :class:`WriteError` naming what could not be written and where, when it is a write the
    machine refused: an OSError of :data:`WRITE_ERRNOS` (with ``denied``, of :data:`DENIED_ERRNOS` too: the caller
    was writing) anywhere in its chain (``raise … from``), or a library's wrapping of one, read by the errno it
    quotes (safetensors' ``(os error 28)`` or ``Os { code: 28 … }``, ``[Errno 122]``), or a write that failed without
    saying why (torch.save's ``file write failed``, an I/O error) on a file system with less than
    :data:`LOW_SPACE_BYTES` free. None for anything else."""
    if isinstance(exc, WriteError):
        return exc
    chain = _chain(exc)
    codes = [_errno_of(e) for e in chain]
    code = next((c for c in codes if c in WRITE_ERRNOS or (denied and c in DENIED_ERRNOS)), None)
    source = chain[codes.index(code)] if code is not None else exc
    if code is None:
        text = " ".join(str(e) for e in chain)
        io = any(isinstance(e, OSError) and e.errno in (None, errno.EIO) for e in chain) or _WRITE_WORDS.search(text)
        if "file write failed" in text or "unexpected pos" in text:
            code = errno.ENOSPC  # torch's zip writer does not say why; a full disk is what makes it fail
        elif io and _nearly_full(where):
            code = errno.ENOSPC  # said in other words, but the destination has no room left
    if code is None:
        return None
    filename = getattr(source, "filename", None) or where
    place = f" {filename}" if filename else ""
    mine = isinstance(source, OSError) and source.strerror and source.errno == code
    reason = source.strerror if mine else os.strerror(code)
    return WriteError(f"cannot write{place}: {reason}")
