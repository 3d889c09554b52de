"""What the launcher told this process, and which rank does what. Torch-free.

``torchrun`` (locally, or under ``srun`` with c10d rendezvous) starts W processes and sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT. This module turns them into a :class:`RoleMap`:

- ranks 0..S-1 (S = ``server.ranks``) are the server group; rank 0 is its RPC front and holds the outputs;
- ranks S..W-1 are client workers; logical client m is hosted by worker ``m mod (W-S)`` (round-robin, so the K
  sampled clients of a round spread over the workers).

A world size that does not fit these roles is refused with the numbers before any process group exists, and every
environment variable the package reads is checked first (:func:`check_environment`): a value that is not what its
reader expects is one line naming the variable, not a traceback, a segmentation fault or a folder elsewhere.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from hosfl_dist.config import IFNAME, MAX_THREADS, Config
from hosfl_dist.errors import ConfigError

MAX_WORLD = 1 << 20
"""Most processes of a job (WORLD_SIZE, LOCAL_WORLD_SIZE): far beyond any cluster, far below a role map that fills
memory."""
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20
"""glibc's largest M_MMAP_THRESHOLD on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX): glibc ignores a larger one."""
SLURM_JOB_ID = re.compile(r"[0-9]{1,20}")
"""A Slurm job id (an integer): it becomes the folder runs/<job.name>/slurm-<id>."""


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


@dataclass(frozen=True)
class LaunchEnv:
    """What torchrun told this process."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: str
    run_id: str
    """torchrun's rendezvous id (TORCHELASTIC_RUN_ID), empty when RANK/WORLD_SIZE were set by hand."""
    restart: int = 0
    """How many times torchrun restarted the workers (TORCHELASTIC_RESTART_COUNT)."""
    local_world_size: int = 0
    """Processes on this node (LOCAL_WORLD_SIZE; the world size when it is not set)."""

    def __post_init__(self) -> None:
        if not self.local_world_size:
            object.__setattr__(self, "local_world_size", self.world_size)


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The torchrun environment of this process, or None when it was started without a launcher; the whole
    environment is checked first (:func:`check_environment`)."""
    env = os.environ if environ is None else environ
    check_environment(env)
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise ConfigError(f"incomplete launcher environment: {', '.join(missing)} not set (start with torchrun)")
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK") or rank)
    except ValueError:
        raise ConfigError(
            f"launcher environment is not numeric: RANK={env['RANK']!r} WORLD_SIZE={env['WORLD_SIZE']!r}"
        ) from None
    if not 0 <= rank < world:
        raise ConfigError(f"launcher environment: RANK={rank} outside WORLD_SIZE={world}")
    local_world = int(env.get("LOCAL_WORLD_SIZE") or world)
    if local_world > world or (env.get("LOCAL_RANK") and local >= local_world):
        raise ConfigError(f"launcher environment: LOCAL_RANK={local} and LOCAL_WORLD_SIZE={local_world} do not fit "
                          f"WORLD_SIZE={world}")  # fmt: skip
    restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return LaunchEnv(
        rank, world, local, env["MASTER_ADDR"], env["MASTER_PORT"], env.get("TORCHELASTIC_RUN_ID", ""), restart,
        local_world,
    )  # fmt: skip


@dataclass(frozen=True)
class RoleMap:
    """Which rank does what, and which logical clients each client worker hosts."""

    world_size: int
    server_ranks: tuple[int, ...]
    worker_ranks: tuple[int, ...]
    hosted: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """client-worker rank -> ids of the logical clients it hosts (data shard + θc replica each)."""

    @property
    def leader(self) -> int:
        """The client worker that reports v̄ to the server, runs evaluation and sends the metrics rows."""
        return self.worker_ranks[0]

    def role(self, rank: int) -> str:
        if rank == 0:
            return "server"
        if rank in self.server_ranks:
            return "server-shard"
        return "worker"

    def rpc_name(self, rank: int) -> str:
        from hosfl_dist.runtime.rpc import SERVER_NAME

        return SERVER_NAME if rank == 0 else f"{self.role(rank)}{rank}"

    def label(self, rank: int) -> str:
        """How log lines name a process: ``[server]``, ``[server-shard 1]``, ``[worker 2]``."""
        return "server" if rank == 0 else f"{self.role(rank)} {rank}"

    def describe(self) -> str:
        lines = [
            f"world size {self.world_size}: {len(self.server_ranks)} server rank(s), "
            f"{len(self.worker_ranks)} client worker(s)"
        ]
        for r in range(self.world_size):
            if r == 0:
                what = "RPC front, θs and its optimizer" + (", FSDP shard" if len(self.server_ranks) > 1 else "")
            elif r in self.server_ranks:
                what = "FSDP shard of θs, follows rank 0"
            else:
                ids = self.hosted[r]
                what = f"hosts {len(ids)} logical clients {_ids(ids)}" + (" (leader)" if r == self.leader else "")
            lines.append(f"  rank {r}: {self.role(r):12s} {what}")
        return "\n".join(lines)


def role_map(cfg: Config, world_size: int) -> RoleMap:
    """Map W ranks onto S server ranks and W-S client workers; refuse a world that does not fit, with the numbers."""
    s, m = cfg.server.ranks, cfg.clients.total
    n = world_size - s
    if n > m:  # before the tuples below: a world of 10^9 would fill memory first
        raise ConfigError(
            f"world size {world_size} does not fit the roles: {n} client workers for clients.total={m} "
            f"logical clients would leave {n - m} worker(s) without a client; use at most {s + m} processes"
        )
    if world_size < s + 1:
        raise ConfigError(
            f"world size {world_size} does not fit the roles: server.ranks={s} server rank(s) plus at least one "
            f"client worker need {s + 1} processes"
        )
    workers = tuple(range(s, world_size))
    hosted = {r: tuple(range(i, m, len(workers))) for i, r in enumerate(workers)}
    return RoleMap(world_size, tuple(range(s)), workers, hosted)


def _ids(ids: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, ids[:8])) + (", …]" if len(ids) > 8 else "]")


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
