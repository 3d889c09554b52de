"""What the launcher told this process, and which rank does what. Torch-free.

``torchrun`` (locally, or under ``srun`` with c10d rendezvous) starts W processes and sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT. This module turns them into a :class:`RoleMap`:

- ranks 0..S-1 (S = ``server.ranks``) are the server group; rank 0 is its RPC front and holds the outputs;
- ranks S..W-1 are client workers; logical client m is hosted by worker ``m mod (W-S)`` (round-robin, so the K
  sampled clients of a round spread over the workers).

A world size that does not fit these roles is refused with the numbers before any process group exists, and every
environment variable the package reads is checked first (:func:`~hosfl_dist.config.environment.check_environment`):
a value that is not what its reader expects is one line naming the variable, not a traceback, a segmentation fault or
a folder elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from hosfl_dist.config import Config
from hosfl_dist.config.environment import check_environment
from hosfl_dist.errors import ConfigError


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
    agent: str = ""
    """The torchrun agent that started this process (its pid and start time), the same across its restarts."""

    def __post_init__(self) -> None:
        if not self.local_world_size:
            object.__setattr__(self, "local_world_size", self.world_size)

    @property
    def invocation(self) -> str:
        """What names this one torchrun invocation across its restarts and no other: the rendezvous id where it is
        one of its own (``--standalone`` draws a fresh one; a static rendezvous says ``none`` for every job), else
        the agent that started the workers. Where a restart finds its run's folder (:mod:`hosfl_dist.runfolder.
        folder`, the pins)."""
        return f"rdzv:{self.run_id}" if self.run_id not in ("", "none") else f"agent:{self.agent}"


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
        local_world, agent_of_this_process(),
    )  # fmt: skip


def agent_of_this_process() -> str:
    """``<pid>-<start time>`` of the process that started this one (torchrun's agent; the start time, in clock ticks
    since boot from /proc, tells a reused pid apart), or the pid alone where /proc is not there."""
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/stat", "rb") as fh:
            fields = fh.read(4096).rsplit(b")", 1)[-1].split()
        return f"{parent}-{int(fields[19])}"  # field 22 of stat(5), counted after the command's closing ")"
    except (OSError, ValueError, IndexError):
        return str(parent)


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
        """The client worker that reports v̄ to the server, runs evaluation and sends the metrics rows (an elastic
        server group's: rank 0, which runs the trainer)."""
        return self.worker_ranks[0] if self.worker_ranks else 0

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


def server_role_map(cfg: Config, world_size: int) -> RoleMap:
    """An elastic run's server under torchrun: every rank a server rank (``server.ranks`` = the world), no client
    worker (they join with ``--join``)."""
    if world_size != cfg.server.ranks:
        raise ConfigError(f"invalid value for server.ranks: {cfg.server.ranks} (--serve under torchrun runs the server "
                          f"group alone: server.ranks must be the world size, {world_size}; workers join with --join)")
    return RoleMap(world_size, tuple(range(world_size)), ())


def _ids(ids: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, ids[:8])) + (", …]" if len(ids) > 8 else "]")
