"""Every environment variable the package reads (set by torchrun, Slurm or the user), with what its value must be.

The environment is input like the YAML and the overrides: :func:`check_environment` refuses, in one line naming the
variable, a value its reader cannot take, before anything reads it (``launch_env`` of
:mod:`hosfl_dist.runtime.process.launch` calls it first). The Slurm job a process runs in is read here too
(:func:`slurm_job_id`, :func:`slurm_start`): it names the run's folder and its lock (:mod:`hosfl_dist.runfolder`).
Torch-free.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from hosfl_dist.config.schema import IFNAME, MAX_THREADS
from hosfl_dist.errors import ConfigError

MAX_WORLD = 1 << 20
"""Most processes of a job (WORLD_SIZE, LOCAL_WORLD_SIZE): far beyond any cluster, far below a role map that fills
memory."""
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20
"""glibc's largest M_MMAP_THRESHOLD on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX): glibc ignores a larger one."""
SLURM_JOB_ID = re.compile(r"[0-9]{1,20}")
"""A Slurm job id (an integer): it becomes the folder runs/<job.name>/slurm-<id>."""
KERNEL_SETTING = re.compile(r"[A-Za-z0-9_,]{1,64}")
KERNEL_SETTINGS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")
"""Variables that cap or fix the instruction set oneDNN and MKL choose their kernels by (read only to be recorded in a
run's environment, :mod:`hosfl_dist.runfolder.environment`: the libraries read them themselves)."""


def _count(lo: int, hi: int) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        if not value.isascii() or not value.isdigit():
            return f"a whole number in {lo}..{hi}"
        return None if lo <= int(value) <= hi else f"in {lo}..{hi}"

    return check


def _omp_threads(value: str) -> str | None:
    """OpenMP's list of threads per nesting level, e.g. 4 or 4,2; each 1..MAX_THREADS."""
    levels = value.split(",")
    if not all(v.isascii() and v.isdigit() and 1 <= int(v) <= MAX_THREADS for v in levels):
        return f"threads per level in 1..{MAX_THREADS}, e.g. 4 or 4,2"
    return None


def _cache_folder(value: str) -> str | None:
    if not os.path.isabs(value):  # read as it is (no ~): a relative one would depend on each process's folder
        return "an absolute folder path"
    if len(value) > 4096 or any(ord(c) < 32 or ord(c) == 127 for c in value):
        return "a folder path of at most 4096 printable characters"
    return None


def _key_file(value: str) -> str | None:
    if not os.path.isabs(value):  # read as it is (no ~), like HOSFL_CACHE
        return "an absolute file path"
    if len(value) > 4096 or any(ord(c) < 32 or ord(c) == 127 for c in value):
        return "a file path of at most 4096 printable characters"
    return None


def _printable(limit: int) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        ok = len(value) <= limit and value.isprintable() and not any(c.isspace() for c in value)
        return None if ok else f"at most {limit} printable characters without spaces"

    return check


ENVIRONMENT: dict[str, Callable[[str], str | None]] = {
    "RANK": _count(0, MAX_WORLD - 1),
    "WORLD_SIZE": _count(1, MAX_WORLD),
    "LOCAL_RANK": _count(0, MAX_WORLD - 1),
    "LOCAL_WORLD_SIZE": _count(1, MAX_WORLD),
    "TORCHELASTIC_RESTART_COUNT": _count(0, 1_000_000),
    "MASTER_PORT": _count(1, 65535),
    "MASTER_ADDR": _printable(255),
    "TORCHELASTIC_RUN_ID": _printable(256),
    "SLURM_JOB_ID": lambda v: None if SLURM_JOB_ID.fullmatch(v) else "a Slurm job id: digits only",
    "SLURM_RESTART_COUNT": _count(0, 1_000_000),
    "OMP_NUM_THREADS": _omp_threads,
    "MALLOC_ARENA_MAX": _count(1, 65536),
    "MALLOC_MMAP_THRESHOLD_": _count(0, GLIBC_MMAP_THRESHOLD_MAX),
    "GLOO_SOCKET_IFNAME": lambda v: None if IFNAME.fullmatch(v) else "a network interface name such as lo, eth0",
    "TP_SOCKET_IFNAME": lambda v: None if IFNAME.fullmatch(v) else "a network interface name such as lo, eth0",
    "HOSFL_CACHE": _cache_folder,
    **{
        name: (lambda v: None if KERNEL_SETTING.fullmatch(v) else "an instruction-set name such as AVX2")
        for name in KERNEL_SETTINGS
    },
    "HOSFL_KEY_FILE": _key_file,
    "XDG_CONFIG_HOME": lambda v: None,  # a relative one is ignored, as the XDG base directory spec says
}
"""Every environment variable this package reads (set by torchrun, Slurm or the user), with what its value must be;
an empty value counts as unset, as each reader takes it."""


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Refuse, in one line naming the variable, a value of :data:`ENVIRONMENT` its reader cannot take."""
    env = os.environ if environ is None else environ
    for name, check in ENVIRONMENT.items():
        value = env.get(name, "")
        why = check(value) if value else None
        if why is not None:
            shown = repr(value) if len(value) <= 80 else f"{value[:79]!r}… ({len(value):,} characters)"
            raise ConfigError(f"environment variable {name}={shown} is not usable: expected {why}")


def kernel_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The :data:`KERNEL_SETTINGS` this process was started with, by name (those set only)."""
    env = os.environ if environ is None else environ
    return {name: env[name] for name in KERNEL_SETTINGS if env.get(name)}


def slurm_job_id(environ: Mapping[str, str] | None = None) -> str:
    """SLURM_JOB_ID, or "" outside a Slurm job; one that is not a job id is refused (it names a folder)."""
    value = (os.environ if environ is None else environ).get("SLURM_JOB_ID", "")
    if value and not SLURM_JOB_ID.fullmatch(value):
        raise ConfigError(f"environment variable SLURM_JOB_ID={value[:80]!r} is not usable: expected a Slurm job id: "
                          "digits only")  # fmt: skip
    return value


def slurm_start(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """(SLURM_JOB_ID, which start of the job this is: 1 + SLURM_RESTART_COUNT), or None outside a Slurm job."""
    env = os.environ if environ is None else environ
    job_id = slurm_job_id(env)
    if not job_id:
        return None
    check_environment({"SLURM_RESTART_COUNT": env.get("SLURM_RESTART_COUNT", "")})
    return job_id, 1 + int(env.get("SLURM_RESTART_COUNT") or 0)


def key_file_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where the user's signing key lives (:mod:`hosfl_dist.runfolder.signing`): ``$HOSFL_KEY_FILE``, else
    ``$XDG_CONFIG_HOME/hosfl_dist/key`` (an absolute XDG_CONFIG_HOME only), else ``~/.config/hosfl_dist/key``."""
    env = os.environ if environ is None else environ
    value = env.get("HOSFL_KEY_FILE", "")
    if value:
        check_environment({"HOSFL_KEY_FILE": value})
        return Path(value)
    config = env.get("XDG_CONFIG_HOME", "")
    base = Path(config) if config and os.path.isabs(config) else Path.home() / ".config"
    return base / "hosfl_dist" / "key"
