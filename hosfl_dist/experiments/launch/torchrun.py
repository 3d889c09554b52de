"""``--launcher torchrun``: every run a local torchrun job, started by the product's own launch line.

That line is ``launch/torchrun.sh`` (NPROC processes, c10d rendezvous on a free port of localhost, the config's
``--check`` against the role map first, ``OMP_NUM_THREADS`` kept, a job token of its own in ``HOSFL_JOB_TOKEN``,
SIGTERM passed on so that every rank stops at a round boundary with a checkpoint, and ``--record-death`` when torchrun
fails). The script runs in the repository root, so the study hands it the config and the run folder as absolute paths;
other relative paths in overrides are read from the repository root as well.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from hosfl_dist.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
"""The checkout the package runs from (launch/ and slurm/ are beside hosfl_dist/)."""
SCRIPT = ROOT / "launch" / "torchrun.sh"


def script() -> Path:
    if not SCRIPT.is_file():
        raise ConfigError(f"--launcher torchrun runs {SCRIPT}, which is missing (hosfl_dist installed without its "
                          "repository's launch/ folder)")  # fmt: skip
    return SCRIPT


def command(config: str | None, nproc: int, overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """The job's argv and the environment it adds: ``NPROC=… CONFIG=… bash launch/torchrun.sh OVERRIDES``, with the
    interpreter running this study (its environment as ``VENV``, its folder first on PATH)."""
    if not config:
        raise ConfigError("--launcher torchrun needs --config (launch/torchrun.sh would take configs/quickstart.yaml)")
    env = {
        "NPROC": str(nproc),
        "CONFIG": str(Path(config).resolve()),
        "VENV": sys.prefix,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
    }
    return ["bash", str(script()), *overrides], env


def shown(argv: list[str], env: dict[str, str]) -> str:
    """The command as a shell line (PATH and VENV left out: the study's interpreter)."""
    words = [f"{k}={shlex.quote(env[k])}" for k in ("NPROC", "CONFIG")] + [shlex.quote(a) for a in argv]
    return " ".join(words)
