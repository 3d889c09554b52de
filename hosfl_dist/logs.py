"""One logging path for the whole package.

Every module logs through ``logging.getLogger(__name__)`` (all under ``hosfl_dist``); ``print`` is left to the
command lines' final output (``done: …``, tables). The command line calls :func:`init_logging` once per process: one
handler on stderr whose lines name the role that speaks (``[server] …``, ``[worker 2] …``; nothing in one process).
Under torchrun rank 0 and the leader client worker log at INFO, the other processes only warnings and errors, so the
console shows each event once.
"""

from __future__ import annotations

import logging
import sys

ROOT = "hosfl_dist"


class _RoleFormatter(logging.Formatter):
    """Every line of a record prefixed with the role (a multi-line message stays attributable)."""

    def __init__(self, label: str) -> None:
        super().__init__("%(message)s")
        self.prefix = f"[{label}] " if label else ""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return "\n".join(self.prefix + line for line in text.splitlines()) if self.prefix else text


class _ConsoleHandler(logging.StreamHandler):
    """The handler :func:`init_logging` owns (replaced when it is called again). It writes to whatever ``sys.stderr``
    is when a record comes, not to the stream of when it was made (a test harness swaps and closes those)."""

    @property
    def stream(self):  # noqa: ANN201 - logging.StreamHandler's attribute
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def init_logging(label: str = "", verbose: bool = True) -> None:
    """Log ``hosfl_dist``'s records to stderr, prefixed with ``label``; INFO and up when ``verbose``, else WARNING."""
    logger = logging.getLogger(ROOT)
    for handler in [h for h in logger.handlers if isinstance(h, _ConsoleHandler)]:
        logger.removeHandler(handler)
    handler = _ConsoleHandler()
    handler.setFormatter(_RoleFormatter(label))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
