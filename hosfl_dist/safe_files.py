"""Paths a command writes or reads that are not regular files of ours, refused in one line before anything is
written or opened.

A command writes a file beside its destination and renames it over the destination, so whatever the destination was
is replaced: a device node (``/dev/full`` as root), a FIFO, a socket, a folder, or the link that pointed elsewhere.
:func:`check_output_file` refuses a destination that exists and is not a regular file, a symlink that leads out of
its folder, and (``in_export=False``) one inside an export's folder (it holds ``hosfl_export.json``: a file added
there breaks the export's signed manifest). :func:`check_output_folder` does the same for a folder a command fills.

Inputs are checked without blocking: :func:`check_input_file` looks with ``stat`` (an ``open`` of a FIFO waits for a
writer) and :func:`open_input` opens with ``O_NONBLOCK`` and checks the open file before it is read. Torch-free.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from hosfl_dist.errors import ConfigError

EXPORT_RECORD = "hosfl_export.json"
"""The file that marks an export's folder (hosfl_dist/export/card.py)."""


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words: "a folder", "a FIFO", "a device", "a socket", "a file"."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISLNK(mode):
        return "a symlink"
    return "a file"


def _lstat(path: Path, flag: str, error: type[Exception]) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # not there (under a file: the caller's write says so)
        return None
    except OSError as exc:
        raise error(f"{flag} {path}: cannot be looked at ({exc.strerror or exc})") from None


def _followed(path: Path, flag: str, error: type[Exception]) -> os.stat_result | None:
    """The stat of what ``path`` names: a symlink's target when the link stays in its folder (None when the target
    does not exist yet), refused when it leads out of the folder."""
    st = _lstat(path, flag, error)
    if st is None or not stat.S_ISLNK(st.st_mode):
        return st
    folder, target = path.absolute().parent.resolve(), path.resolve()
    if not target.is_relative_to(folder):
        raise error(f"{flag} {path} is a symlink to {target}, outside its folder: name a file there instead")
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # a link loop
        raise error(f"{flag} {path}: cannot be followed ({exc.strerror or exc})") from None


def export_around(path: Path) -> Path | None:
    """The export folder (it holds ``hosfl_export.json``) that ``path`` resolved lies in or is, or None."""
    target = path.resolve()
    for folder in (target, *target.parents):
        if (folder / EXPORT_RECORD).is_file():
            return folder
    return None


def check_output_file(path: Path, flag: str = "--out", in_export: bool = True, folder_ok: bool = False,
                      error: type[Exception] = ConfigError) -> None:  # fmt: skip
    """Refuse, in one line (``error``: a ConfigError, exit code 2), a file destination ``path`` (given as ``flag``)
    that a write-and-rename would wrongly replace: it exists and is not a regular file (with ``folder_ok``: nor a
    folder), it is a symlink out of its folder, or (``in_export`` False) it lies inside an export's folder."""
    path = Path(path)
    st = _followed(path, flag, error)
    if st is not None and not stat.S_ISREG(st.st_mode) and not (folder_ok and stat.S_ISDIR(st.st_mode)):
        raise error(f"{flag} {path} exists and is {kind_of(st.st_mode)}, not a regular file: it would be replaced; "
                    "name a new file or a file of yours")  # fmt: skip
    if not in_export:
        around = export_around(path)
        if around is not None:
            raise error(f"{flag} {path} lies inside the model folder {around} (it holds {EXPORT_RECORD}): a file "
                        "written there breaks the export; write it elsewhere")  # fmt: skip


def check_output_folder(path: Path, flag: str = "--out", in_export: bool = True,
                        error: type[Exception] = ConfigError) -> None:  # fmt: skip
    """Refuse a folder destination ``path`` that exists and is not a folder (a file, a device, a FIFO, a link to
    one), or (``in_export`` False) that lies inside another export's folder."""
    path = Path(path)
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # under a file: the caller's check names it
        st = None
    except OSError as exc:
        raise error(f"{flag} {path}: cannot be looked at ({exc.strerror or exc})") from None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise error(f"{flag} {path} exists and is {kind_of(st.st_mode)}, not a folder")
    if not in_export:
        around = export_around(path.absolute().parent)
        if around is not None:
            raise error(f"{flag} {path} lies inside the model folder {around} (it holds {EXPORT_RECORD}): write it "
                        "elsewhere")  # fmt: skip


def check_folder_entries(folder: Path, flag: str = "--out", most: int = 10_000,
                         error: type[Exception] = ConfigError) -> None:  # fmt: skip
    """Refuse a ``folder`` a command writes files into whose top-level entries (the first ``most``) include one that
    is not a regular file or a folder (a FIFO, a device, a socket) or a symlink out of the folder."""
    try:
        entries = os.scandir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        raise error(f"{flag} {folder}: cannot be listed ({exc.strerror or exc})") from None
    with entries:
        for i, entry in enumerate(entries):
            if i >= most:
                break
            if entry.is_dir(follow_symlinks=False):
                continue
            st = _followed(Path(entry.path), f"{flag} {folder}: its entry", error)
            if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise error(f"{flag} {folder}: its entry {entry.name} is {kind_of(st.st_mode)}, not a regular file "
                            "(a file written there would replace it); remove it or choose another folder")  # fmt: skip


def check_input_file(path: Path, what: str, error: type[Exception] = ConfigError) -> os.stat_result | None:
    """The stat of the input ``path`` (None: it does not exist), refused in one line when it is not a regular file
    (a FIFO, a device such as /dev/zero, a folder): looked at with ``stat``, which never blocks."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise error(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} {path} is {kind_of(st.st_mode)}, not a regular file")
    return st


def open_input(path: Path, what: str, error: type[Exception] = ConfigError) -> BinaryIO:
    """``path`` opened for reading in binary, refused in one line unless it is a regular file: opened with
    ``O_NONBLOCK`` (a FIFO does not wait for a writer) and checked with ``fstat`` before a byte is read (what was
    opened is what was checked). FileNotFoundError passes through."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} {path} is {kind_of(st.st_mode)}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def readable(folder: Path) -> None:
    """Give ``folder`` and what it holds the modes the umask says (safetensors and temporary files are written 0600):
    files ``0o666 & ~umask``, folders ``0o777 & ~umask``."""
    mask = os.umask(0)
    os.umask(mask)
    folder.chmod(0o777 & ~mask)
    for path in folder.rglob("*"):
        if path.is_symlink():
            continue
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def replace_file(path: Path, text: str, mode: int = 0o666, tmp: Path | None = None) -> None:
    """Write ``text`` to ``path`` whole: into ``tmp`` beside it (default ``<name>.tmp``), created anew and never
    through a link (``O_EXCL | O_NOFOLLOW``: a link or a FIFO planted at that name is not followed, and a reader
    never sees half a file), then renamed over ``path``, which replaces whatever stood there. ``mode`` as ``open``'s,
    less the umask. A failed write (a full disk) leaves ``path`` as it was and no ``tmp`` behind."""
    tmp = tmp if tmp is not None else path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
