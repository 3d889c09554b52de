"""What every command that writes refuses or says in one line, shared by the commands beyond one run's (the export,
predict, pretraining, the measurements, the curves of ``experiments.report``):

- :func:`check_device`: a ``--device`` this machine cannot run (``meta``, ``mps``, ``xla``, a word torch does not
  know, CUDA where there is none) is one line, exit code 2;
- :func:`check_destination`: an output that is, lies inside or holds a run's folder (symlinks followed,
  :func:`hosfl_dist.runfolder.folder.run_in_the_way`) is refused whatever the command, so a run's record and
  checkpoints are never replaced, nor an output that is a device, a FIFO, a socket or a symlink out of its folder
  (:func:`hosfl_dist.safe_files.check_output_file`);
- :func:`guarded`: bad input, a write the machine refused (full disk, quota, read-only file system) and Ctrl-C are
  one line each (exit codes 2, 2 and 130), never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from hosfl_dist.errors import ConfigError, HosflError, write_failure

DEVICES = ("cpu", "cuda")


def check_device(value: str, flag: str = "--device") -> None:
    """Refuse a device other than cpu, cuda or cuda:N, or a CUDA device this machine does not have, in one line."""
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise ConfigError(f"{flag} {value!r}: expected cpu, cuda or cuda:N") from None
    if device.type not in DEVICES:
        raise ConfigError(f"{flag} {value}: expected cpu, cuda or cuda:N (this command runs on no other device)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{flag} {value}: this machine has no CUDA device (torch.cuda.is_available() is False)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{flag} {value}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_destination(dest: Path, flag: str = "--out", below: bool = True) -> None:
    """Refuse ``dest`` where writing it could replace a run's files (with ``below``, also a folder that holds a run
    below it)."""
    from hosfl_dist.runfolder.folder import refuse_run_in_the_way
    from hosfl_dist.safe_files import check_output_file

    check_output_file(Path(dest), flag, folder_ok=True)  # a device, a FIFO, a socket, a link out: never replaced
    refuse_run_in_the_way(Path(dest), flag, below=below)


def guarded(what: str, body: Callable[[], int], where: str | Path | None = None) -> int:
    """``body()``'s exit code; bad input and a write the machine refused (naming ``where`` when the error does not
    name its file) are one ``error:`` line, exit code 2 (or the error's own); Ctrl-C is one line naming ``what``
    stopped, exit code 130. Anything else keeps its traceback."""
    try:
        return body()
    except KeyboardInterrupt:
        print(f"interrupted: {what} stopped by Ctrl-C; nothing it had not finished was kept: run the same command "
              "again", file=sys.stderr)  # fmt: skip
        return 130
    except HosflError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:
        failure = write_failure(exc, where, denied=isinstance(exc, OSError))
        if failure is None:
            raise
        print(f"error: {failure}", file=sys.stderr)
        return failure.exit_code
