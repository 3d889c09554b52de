"""Process setup of the distributed runtime: the only module that reads the launcher's environment.

``torchrun`` (locally, or under ``srun`` with c10d rendezvous) starts W processes and sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT. This module turns them into a :class:`RoleMap`:

- ranks 0..S-1 (S = ``server.ranks``) are the server group; rank 0 is its RPC front and holds the outputs;
- ranks S..W-1 are client workers; logical client m is hosted by worker ``m mod (W-S)`` (round-robin, so the K
  sampled clients of a round spread over the workers).

A world size that does not fit these roles is refused with the numbers before any process group exists.
:func:`init_distributed` limits glibc's malloc arenas, starts the default process group, the client-worker group
(the P-scalar all_reduce), the server group (FSDP) and RPC; :meth:`Distributed.shutdown` stops them again, gracefully
or not.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import datetime
import os
import signal
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hosfl_dist.config import Config
from hosfl_dist.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where a process group is made: a bad config fails before that import
    import torch
    import torch.distributed as dist

SHUTDOWN_TIMEOUT_S = 30.0
"""Longest wait for the peers at the end of a job (a peer that is gone cannot hold the others forever)."""

MALLOC_ARENAS = 2
"""glibc malloc arenas of a torchrun process, unless MALLOC_ARENA_MAX says otherwise (glibc's default: 8 per core).
A thread that allocates while the others hold their arenas gets a new one, and memory freed in an arena stays there.
The server's executions run on one thread (:class:`~hosfl_dist.transport.endpoint.ServerThread`), which alone kept
its RSS flat; the cap bounds what the other threads (RPC, gloo, TensorPipe: more of them on larger nodes) can spread.
Alone, it held the server of the old runtime at 0.49 GiB instead of 0.87 over 50 tiny-Qwen3 rounds, at no cost
measured in round time (bench/cpu_hygiene.py). Set in code rather than by the launch scripts so that every start
(scripts, Slurm, tests, benchmarks) gets it."""

RPC_TRANSPORTS = ["uv"]
"""TensorPipe transports: TCP through libuv, which sleeps in epoll while nothing arrives. TensorPipe's defaults add
"shm" (its first choice on one node) and "ibv", whose reactors poll in a busy loop: client workers waiting for the
server used 47-54 % of a core (0.19-0.22 CPU s per round) instead of 14-18 % (0.02-0.03 s), on a node whose cores
the server needed for the answer: on 2 cores a round of the previous version took 0.41 s, of this one 0.155 s
(bench/cpu_hygiene.py)."""
RPC_CHANNELS = ["cma", "basic"]
"""TensorPipe channels for the tensors: between processes of one node "cma" (one process_vm_readv copy; its thread
sleeps on a queue), else "basic" (in the transport's own messages). A 64 MiB round trip on loopback took 119 ms
with cma, 251 ms with basic alone, 1421 ms with TensorPipe's defaults (shm busy-polling on 2 cores). Every tensor is
staged to CPU before it crosses (:func:`~hosfl_dist.transport.rpc.to_wire`): no CUDA channel is needed."""


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
    """The torchrun environment of this process, or None when it was started without a launcher."""
    env = os.environ if environ is None else environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise ConfigError(f"incomplete launcher environment: {', '.join(missing)} not set (start with torchrun)")
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
    except ValueError:
        raise ConfigError(
            f"launcher environment is not numeric: RANK={env['RANK']!r} WORLD_SIZE={env['WORLD_SIZE']!r}"
        ) from None
    if not 0 <= rank < world:
        raise ConfigError(f"launcher environment: RANK={rank} outside WORLD_SIZE={world}")
    restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    local_world = int(env.get("LOCAL_WORLD_SIZE", world) or world)
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
        from hosfl_dist.transport.rpc import SERVER_NAME

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
    if world_size < s + 1:
        raise ConfigError(
            f"world size {world_size} does not fit the roles: server.ranks={s} server rank(s) plus at least one "
            f"client worker need {s + 1} processes"
        )
    workers = tuple(range(s, world_size))
    if len(workers) > m:
        raise ConfigError(
            f"world size {world_size} does not fit the roles: {len(workers)} client workers for clients.total={m} "
            f"logical clients would leave {len(workers) - m} worker(s) without a client; use at most {s + m} processes"
        )
    hosted = {r: tuple(range(i, m, len(workers))) for i, r in enumerate(workers)}
    return RoleMap(world_size, tuple(range(s)), workers, hosted)


def _ids(ids: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, ids[:8])) + (", …]" if len(ids) > 8 else "]")


def process_device(cfg: Config, env: LaunchEnv) -> torch.device:
    """job.device for this process: a bare "cuda" means the GPU of this local rank."""
    import torch

    dev = torch.device(cfg.job.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", env.local_rank % max(1, torch.cuda.device_count()))
    return dev


@dataclass
class Distributed:
    """The live process groups and RPC agent of one process."""

    env: LaunchEnv
    roles: RoleMap
    device: torch.device
    worker_group: dist.ProcessGroup | None
    """Client workers only: the P-scalar all_reduce and small control reductions."""
    server_group: dist.ProcessGroup | None
    """Server ranks only, when server.ranks > 1: FSDP collectives and the call broadcast from rank 0."""
    rpc_up: bool = False
    interface: str | None = None
    """The network interface gloo and TensorPipe were bound to (None: torch's choice)."""

    @property
    def rank(self) -> int:
        return self.env.rank

    def store(self) -> dist.Store | None:
        """The rendezvous key-value store (used to elect the one process that reports a failure)."""
        import torch.distributed as dist

        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - best effort: no store means every failing process reports
            return None

    def post(self, key: str) -> None:
        """Set ``key`` in the job's store, for the peers that :meth:`wait_for` it."""
        self._kv().set(key, b"1")

    def put(self, key: str, value: str) -> None:
        """Set ``key`` to ``value`` in the job's store (read by the peers with :meth:`get`)."""
        self._kv().set(key, value.encode())

    def get(self, key: str, timeout_s: float) -> str:
        """The value a peer :meth:`put` under ``key``, waiting for it at most ``timeout_s``."""
        self.wait_for(key, timeout_s)
        return self._kv().get(key).decode()

    def wait_for(self, key: str, timeout_s: float) -> None:
        """Block until a peer has posted ``key``, at most ``timeout_s``. A store wait sleeps in a socket read and has
        a bound of its own; a collective would wait with its group's timeout, which is for collectives."""
        import torch.distributed as dist

        try:
            self._kv().wait([key], datetime.timedelta(seconds=timeout_s))
        except dist.DistStoreError as exc:
            raise TimeoutError(f"{key} was not posted within {timeout_s:g} s") from exc

    def _kv(self) -> dist.Store:
        store = self.store()
        if store is None:
            raise RuntimeError("no rendezvous store: init_distributed has not run")
        return store

    def shutdown(self, graceful: bool) -> None:
        """Stop RPC, then the process groups. Graceful waits for every peer (normal end), at most
        SHUTDOWN_TIMEOUT_S (torch's own default waits forever); otherwise, or after that, leave at once."""
        import torch.distributed as dist
        import torch.distributed.rpc as rpc

        if self.rpc_up:
            self.rpc_up = False
            try:
                rpc.shutdown(graceful=graceful, timeout=SHUTDOWN_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - peers may already be gone; leaving is all that is left to do
                if graceful:
                    with contextlib.suppress(Exception):
                        rpc.shutdown(graceful=False)
        if dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(cfg: Config, env: LaunchEnv, roles: RoleMap) -> Distributed:
    """Start the default process group (gloo on CPU, NCCL for CUDA tensors), the role groups and RPC (TensorPipe).

    Each wait on a peer has its own bound: ``server.rpc_timeout_s`` one RPC and the rendezvous (the store's
    timeout); ``server.collective_timeout_s`` one collective of the default, client-worker or server group. An
    evaluation, which only the leader worker runs, is waited for through the store with ``train.eval_timeout_s``
    (:meth:`Distributed.wait_for`), never in a collective.
    """
    import torch
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    limit_malloc_arenas()  # before RPC, gloo and the server start their threads
    fix_mmap_threshold()
    device = process_device(cfg, env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    interface = bind_interface(cfg, env)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    store = job_store(env, datetime.timedelta(seconds=cfg.server.rpc_timeout_s))
    timeout = datetime.timedelta(seconds=cfg.server.collective_timeout_s)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
    out = Distributed(env, roles, device, None, None, interface=interface)
    try:
        # new_group is collective over the whole world: every rank creates every group, in the same order.
        workers = dist.new_group(list(roles.worker_ranks), timeout=timeout)
        # a server rank also waits in this group for rank 0's next call, which may come after a whole evaluation or
        # the clients' slowest step: its bound is the longest of the waits it can stand for
        idle = max(cfg.server.collective_timeout_s, cfg.server.rpc_timeout_s, cfg.train.eval_timeout_s)
        servers = None
        if len(roles.server_ranks) > 1:
            servers = dist.new_group(list(roles.server_ranks), timeout=datetime.timedelta(seconds=idle))
        out.worker_group = workers if env.rank in roles.worker_ranks else None
        out.server_group = servers if env.rank in roles.server_ranks else None
        opts = rpc_options(cfg, roles, _store_url(store))
        with warnings.catch_warnings():  # TensorPipe's own device-map exchange uses a deprecated group handle
            warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
            rpc.init_rpc(roles.rpc_name(env.rank), rank=env.rank, world_size=env.world_size, rpc_backend_options=opts)
        out.rpc_up = True
    except BaseException:
        out.shutdown(graceful=False)
        raise
    return out


def rpc_options(cfg: Config, roles: RoleMap, init_method: str) -> Any:
    """TensorPipe's options: ``server.rpc_timeout_s`` per call, transports that sleep while idle."""
    import torch.distributed.rpc as rpc

    return rpc.TensorPipeRpcBackendOptions(
        rpc_timeout=cfg.server.rpc_timeout_s,
        init_method=init_method,
        # the server holds K submits of a round at once (async, no thread each) plus syncs and reports
        num_worker_threads=max(16, 4 * len(roles.worker_ranks)),
        _transports=RPC_TRANSPORTS,
        _channels=RPC_CHANNELS,
    )


def limit_malloc_arenas(environ: Mapping[str, str] | None = None) -> int | None:
    """Cap glibc's malloc arenas at :data:`MALLOC_ARENAS` (mallopt M_ARENA_MAX) unless MALLOC_ARENA_MAX is set, which
    glibc has read already; the cap in force, or None where there is no glibc. Arenas made before stay, so this runs
    before the process starts threads."""
    return _malloc_option("MALLOC_ARENA_MAX", -8, MALLOC_ARENAS, environ)  # M_ARENA_MAX of <malloc.h>


MMAP_THRESHOLD = 1 << 20
"""Allocations of at least this many bytes get their own mmap (glibc's M_MMAP_THRESHOLD), fixed."""


def fix_mmap_threshold(environ: Mapping[str, str] | None = None) -> int | None:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` unless MALLOC_MMAP_THRESHOLD_ is set; the threshold in
    force, or None where there is no glibc.

    glibc raises its threshold (up to 32 MiB) each time a mapped block is freed, after which blocks of that size come
    from the heap and stay resident once freed. FSDP's per-block all-gather buffers (tens of MB, one block after
    another) then pile up: an FSDP server rank of Qwen3-0.6B peaked at 2.45 GB after one forward with the dynamic
    threshold and 1.56 GB with it fixed at 1 MiB, which returns every freed buffer to the system."""
    return _malloc_option("MALLOC_MMAP_THRESHOLD_", -3, MMAP_THRESHOLD, environ)  # M_MMAP_THRESHOLD of <malloc.h>


def _malloc_option(variable: str, param: int, value: int, environ: Mapping[str, str] | None) -> int | None:
    """mallopt(param, value) unless the environment variable that glibc reads at start sets it; the value in force,
    or None where there is no glibc."""
    environ = os.environ if environ is None else environ
    if environ.get(variable):
        return int(environ[variable])
    mallopt = _mallopt()
    if mallopt is None or mallopt(param, value) != 1:
        return None
    return value


def _mallopt() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None


SOCKET_IFNAMES = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def bind_interface(cfg: Config, env: LaunchEnv, environ: dict[str, str] | None = None) -> str | None:
    """Bind gloo and TensorPipe to ``job.interface`` (set before any group or RPC agent exists); the name bound.

    auto: loopback when the job runs on one node (torchrun's LOCAL_WORLD_SIZE equals WORLD_SIZE), so that nothing of
    the job listens beyond this machine; across nodes, what the environment already says (name the interface with
    job.interface, e.g. as an override to slurm/hosfl.sbatch).
    """
    environ = os.environ if environ is None else environ
    name = cfg.job.interface
    if name == "auto":
        if env.local_world_size != env.world_size:
            return environ.get("GLOO_SOCKET_IFNAME") or None
        name = "lo"
    check_interface(name)
    for key in SOCKET_IFNAMES:
        environ[key] = name
    return name


def check_interface(name: str) -> None:
    """Refuse a network interface this node does not have (where the system lists them)."""
    net = Path("/sys/class/net")
    if name != "auto" and net.is_dir() and not (net / name).exists():
        have = sorted(p.name for p in net.iterdir())
        raise ConfigError(f"job.interface={name}: this node has no such interface (it has {', '.join(have)})")


def job_store(env: LaunchEnv, timeout: datetime.timedelta) -> dist.Store:
    """The key-value store every group and RPC of this attempt meets in, under a prefix of its own.

    torchrun (c10d rendezvous) keeps one TCPStore for the whole job and hands it to every restart of the workers, but
    ``env://`` puts no attempt in the keys: restarted workers would read the dead workers' addresses from the previous
    attempt and fail to connect. Under ``hosfl/<run id>/attempt-<n>/`` each attempt sees only its own keys.
    Without torchrun's agent store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, or RANK/WORLD_SIZE set by hand) rank 0
    hosts the store.
    """
    import torch.distributed as dist

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    base = dist.TCPStore(
        env.master_addr,
        int(env.master_port),
        env.world_size,
        is_master=not agent and env.rank == 0,
        timeout=timeout,
        multi_tenant=True,
    )
    return dist.PrefixStore(f"hosfl/{env.run_id or 'job'}/attempt-{env.restart}", base)


_STORES: dict[str, dist.Store] = {}


def _store_url(store: dist.Store) -> str:
    """An init_method for RPC that meets in ``store`` (RPC takes a URL, not a store)."""
    import torch.distributed as dist

    if not _STORES:  # the first store of this process: teach torch the scheme
        dist.register_rendezvous_handler("hosfl", _store_rendezvous)
    key = str(len(_STORES))
    _STORES[key] = store
    return f"hosfl://{key}"


def _store_rendezvous(url: str, **kwargs: Any):  # noqa: ANN202 - the generator torch's rendezvous expects
    from urllib.parse import parse_qs, urlparse

    parsed = urlparse(url)
    query = parse_qs(parsed.query)
    yield _STORES[parsed.netloc], int(query["rank"][0]), int(query["world_size"][0])


class StopRequest:
    """SIGTERM (what Slurm and torchrun send) and SIGINT turned into a request to stop at the next round boundary,
    where the runtime checkpoints and records the run as interrupted. A second SIGINT stops at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal: str | None = None
        self.since = 0.0
        """time.monotonic() of the first signal."""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal, self.since = signal.Signals(signum).name, time.monotonic()


def check_devices(cfg: Config) -> None:
    """Refuse a CUDA device (for the models or the noise generator) on a machine without one, in one line."""
    import torch

    for key, value in (("job.device", cfg.job.device), ("zo.rng_device", cfg.zo.rng_device)):
        if value.startswith("cuda"):
            if not torch.cuda.is_available():
                raise ConfigError(
                    f"{key}={value} but this machine has no CUDA device (torch.cuda.is_available() is False)"
                )
            index = torch.device(value).index
            if index is not None and index >= torch.cuda.device_count():
                raise ConfigError(f"{key}={value} but this machine has {torch.cuda.device_count()} CUDA device(s)")


SMALL_MODEL_PARAMS = 10_000_000
"""Below this many parameters a process runs on one intra-op thread (``job.threads=0``): the work per kernel is too
small to split, and threads that wait for cores other processes hold cost more than they save. In one process on a
2-core machine under load (bench/threads.py, bench/results/threads.json) the quickstart CNN took 0.18 s per round
with one thread and 2.47 s with two; a 135M-parameter LM 25.6 s and 59.0 s, so under load one thread wins there too,
while on an idle machine a model that size gains from every core (the auto rule's other branch)."""


def slurm_job_id(environ: Mapping[str, str] | None = None) -> str:
    """SLURM_JOB_ID, or "" outside a Slurm job."""
    return (os.environ if environ is None else environ).get("SLURM_JOB_ID", "")


def set_threads(cfg: Config, params: int, environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """Set this process's intra-op threads from ``job.threads`` (see its docstring); (threads, why) for the log.

    ``params``: the parameters of the model this process runs (both parts in one process)."""
    import torch

    environ = os.environ if environ is None else environ
    if cfg.job.threads:
        n, why = cfg.job.threads, "job.threads"
    elif environ.get("OMP_NUM_THREADS", "").isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        n = int(environ["OMP_NUM_THREADS"])
        why = f"job.threads=0 (auto): OMP_NUM_THREADS={n} from the environment (torchrun sets 1)"
    elif params < SMALL_MODEL_PARAMS:
        n, why = 1, f"job.threads=0 (auto): a model of {params / 1e6:.2g}M parameters runs fastest on one"
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        n, why = cores, f"job.threads=0 (auto): a model of {params / 1e6:.3g}M parameters, every core"
    torch.set_num_threads(n)
    return n, why
