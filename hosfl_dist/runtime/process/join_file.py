"""The join file of a live run (``join.json`` in its folder): where its server listens and the run's token, written
by the server while it serves (:func:`write_join`, readable by its owner only) and read by every worker that joins or
waits for it to come back (:func:`read_join`). The file is input from a folder others may write: it is read as such."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from hosfl_dist.config import Config, load_config
from hosfl_dist.errors import ConfigError, first_line
from hosfl_dist.runtime.process.host import pid_alive
from hosfl_dist.safe_files import replace_file

JOIN_FILE = "join.json"


def write_join(folder: Path, host: str, port: int, token: str) -> Path:
    """The join file of the server serving at ``host:port`` in this process; returns its path (the server removes it
    when it stops serving). Written whole beside it, then renamed over it: a worker never reads half of it, and
    whatever stood at its name (a link planted to a file of the user's, a FIFO) is replaced, never followed."""
    path = folder / JOIN_FILE
    join = {"host": host, "port": port, "pid": os.getpid(), "node": socket.gethostname(), "token": token}
    replace_file(path, json.dumps(join), 0o600, folder / f".{JOIN_FILE}.{os.getpid()}")
    return path


def read_join(run_dir: Path) -> tuple[dict[str, Any], Config]:
    """The run's join address and token (``join.json``, written by ``--serve``) and its config. The file is input
    from a folder others may write: it must be a regular file (a FIFO or a link to /dev/zero is refused without
    waiting), of at most 64 KiB, a JSON object whose ``host`` is text, ``port`` an integer in 1..65535 and ``token``
    text (``pid`` an integer, ``node`` text, where given); anything else is one line, exit code 2."""
    from hosfl_dist.config.schema import shown
    from hosfl_dist.safe_files import check_input_file, open_input

    most = 64 << 10
    path = run_dir / JOIN_FILE
    try:
        with open_input(path, "invalid value for --join:", ConfigError) as fh:  # a FIFO, /dev/zero: refused at once
            if os.fstat(fh.fileno()).st_size > most:
                raise ValueError(f"larger than {most >> 10} KiB")
            text = fh.read(most + 1)
        if len(text) > most:  # grew while read
            raise ValueError(f"larger than {most >> 10} KiB")
        join = json.loads(text.decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"invalid value for --join: {str(run_dir)!r} (no {JOIN_FILE}: not a run started with "
                          "--serve, or one that has ended)") from None  # fmt: skip
    except ConfigError:  # not a regular file: said as it is
        raise
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"invalid value for --join: {str(path)!r} cannot be read ({first_line(exc, 200)})") from None
    if not isinstance(join, dict) or not {"host", "port", "token"} <= set(join):
        raise ConfigError(f"invalid value for --join: {str(path)!r} is not a join file of this version")

    def text_field(value: Any) -> bool:
        return isinstance(value, str) and 0 < len(value) <= 1024 and value.isprintable()

    def integer(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    fields = {
        "host": (text_field(join["host"]), "expected a host name or address"),
        "port": (integer(join["port"]) and 1 <= join["port"] <= 65535, "expected an integer in 1..65535"),
        "token": (text_field(join["token"]), "expected the run's token, text"),
        "pid": ("pid" not in join or (integer(join["pid"]) and join["pid"] > 0), "expected a process id"),
        "node": ("node" not in join or text_field(join["node"]), "expected a host name"),
    }
    bad = next((name for name, (ok, _) in fields.items() if not ok), None)
    if bad is not None:
        raise ConfigError(f"invalid value for --join: {JOIN_FILE} in {str(run_dir)!r}: its {bad} is "
                          f"{shown(join[bad], 60)} ({fields[bad][1]})")  # fmt: skip
    pid = join.get("pid")
    if join.get("node") == socket.gethostname() and isinstance(pid, int) and not pid_alive(pid):
        raise ConfigError(f"invalid value for --join: {str(run_dir)!r} (its server, pid {pid} on this machine, is not "
                          f"running: python -m hosfl_dist.run --status {run_dir})")  # fmt: skip
    check_input_file(run_dir / "config.yaml", "invalid value for --join:", ConfigError)  # a FIFO: no wait
    return join, load_config(run_dir / "config.yaml")


def reachable(join: dict[str, Any]) -> bool:
    """Whether something listens at the join file's address (a quick look before the store's client, which logs
    every failed try at length)."""
    try:
        with socket.create_connection((str(join["host"]), int(join["port"])), timeout=1.0):
            return True
    except (OSError, ValueError, TypeError):
        return False
