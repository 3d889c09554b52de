"""The live process groups and RPC agent of a torchrun process, and the job's key-value store.

:func:`init_distributed` limits glibc's malloc arenas, starts the default process group, the client-worker group
(the P-scalar all_reduce), the server group (FSDP) and RPC behind the process's RPC gate (:mod:`.gate`: TensorPipe's
listener reachable by holders of the job's token alone); :meth:`Distributed.shutdown` stops them again, gracefully or
not. :func:`job_token` agrees on the job's token, which rank 0's RPC entry points ask of every caller and the gates
of every connection.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hosfl_dist.config import Config
from hosfl_dist.errors import ConfigError
from hosfl_dist.runtime.process.host import (
    bind_interface,
    fix_mmap_threshold,
    keep_freed_memory,
    limit_malloc_arenas,
)
from hosfl_dist.runtime.process.launch import LaunchEnv, RoleMap

if TYPE_CHECKING:  # torch is imported where a process group is made: a bad config fails before that import
    import torch
    import torch.distributed as dist

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 30.0
"""Longest wait for the peers at the end of a job (a peer that is gone cannot hold the others forever)."""

RPC_TRANSPORTS = ["uv"]
"""TensorPipe transports: TCP through libuv, which sleeps in epoll while nothing arrives. TensorPipe's defaults add
"shm" (its first choice on one node) and "ibv", whose reactors poll in a busy loop: client workers waiting for the
server then burn the cores the server needs for the answer, and rounds on a small node slow down with them (CPU per
round and round time, before and after: results/scale/cpu_hygiene.md). uv alone is also what the RPC gate covers
(:data:`~hosfl_dist.runtime.process.gate.TRANSPORTS`): another transport has an address of its own, which peers
would reach without passing the gate."""
RPC_CHANNELS = ["cma", "basic"]
"""TensorPipe channels for the tensors: between processes of one node "cma" (one process_vm_readv copy; its thread
sleeps on a queue), else "basic" (in the transport's own messages). A 64 MiB round trip on loopback took 119 ms
with cma, 251 ms with basic alone, 1421 ms with TensorPipe's defaults (shm busy-polling on 2 cores). Every tensor is
staged to CPU before it crosses (:func:`~hosfl_dist.runtime.rpc.to_wire`): no CUDA channel is needed. Neither opens a
listener of its own (TensorPipe's default "mpt_uv" opens 16), which the RPC gate could not cover
(:data:`~hosfl_dist.runtime.process.gate.CHANNELS`)."""


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
    token: str = field(default="", repr=False)
    """This attempt's job token (:func:`job_token`), given with every call to rank 0's RPC entry points."""
    worker_device: torch.device | None = None
    """Where the client-worker group's collectives run: ``device``, or the CPU (gloo) when client workers share a
    GPU (:func:`shared_gpus`)."""

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

        from hosfl_dist.runtime.process.gate import close_gate

        if self.rpc_up:
            self.rpc_up = False
            try:
                rpc.shutdown(graceful=graceful, timeout=SHUTDOWN_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - peers may already be gone; leaving is all that is left to do
                if graceful:
                    with contextlib.suppress(Exception):
                        rpc.shutdown(graceful=False)
        close_gate()
        if dist.is_initialized():
            dist.destroy_process_group()


def set_allocator(rank: int, roles: RoleMap) -> int | None:
    """glibc's thresholds for this rank's role (the mmap threshold in force): a rank of a sharded server group
    returns what it frees (FSDP's all-gather buffers, :func:`fix_mmap_threshold`); a client worker's P+1 forwards
    and a one-rank server's step reuse the same activation memory every round (:func:`keep_freed_memory`)."""
    if rank in roles.server_ranks and len(roles.server_ranks) > 1:
        return fix_mmap_threshold()
    return keep_freed_memory()


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

    from hosfl_dist.runtime.process.gate import open_gate
    from hosfl_dist.runtime.rpc import expect_token

    secret = launcher_secret()  # a bad HOSFL_JOB_TOKEN stops the run before anything starts
    limit_malloc_arenas()  # before RPC, gloo and the server start their threads
    set_allocator(env.rank, roles)
    device = process_device(cfg, env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    interface = bind_interface(cfg, env)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    store = job_store(env, datetime.timedelta(seconds=cfg.server.rpc_timeout_s))
    token = job_token(env, store, secret, cfg.server.rpc_timeout_s)
    placement = gpu_placement(store, env, device, cfg.server.rpc_timeout_s)
    check_server_gpus(placement, roles)
    # client workers that share a GPU reduce their P scalars through gloo on the CPU: NCCL refuses such a group
    shared = shared_gpus(placement, roles.worker_ranks)
    worker_device = torch.device("cpu") if shared else device
    if shared and env.rank == roles.leader:
        logger.info("client workers %s: their all_reduce of the P scalars runs on gloo over the CPU (NCCL needs "
                    "one GPU per rank of a group)", sharing_text(shared))  # fmt: skip
    timeout = datetime.timedelta(seconds=cfg.server.collective_timeout_s)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
    out = Distributed(env, roles, device, None, None, interface=interface, token=token, worker_device=worker_device)
    try:
        # new_group is collective over the whole world: every rank creates every group, in the same order.
        workers = None
        if roles.worker_ranks:  # (an elastic run's server group has none: its workers join over its own RPC)
            workers = dist.new_group(list(roles.worker_ranks), timeout=timeout, backend="gloo" if shared else None)
        # a server rank also waits in this group for rank 0's next call, which may come after a whole evaluation or
        # the clients' slowest step: its bound is the longest of the waits it can stand for
        idle = max(cfg.server.collective_timeout_s, cfg.server.rpc_timeout_s, cfg.train.eval_timeout_s)
        servers = None
        if len(roles.server_ranks) > 1:
            servers = dist.new_group(list(roles.server_ranks), timeout=datetime.timedelta(seconds=idle))
        out.worker_group = workers if env.rank in roles.worker_ranks else None
        out.server_group = servers if env.rank in roles.server_ranks else None
        if not roles.worker_ranks:
            return out
        # RPC meets its peers in the store as the gate shows it: TensorPipe's listener shielded, its peers reached
        # through their gates (runtime/process/gate.py)
        gate = open_gate(token, cfg.server.rpc_timeout_s)
        opts = rpc_options(cfg, roles, _store_url(gate.view(store)))
        expect_token(token)  # before the agent serves anything
        with warnings.catch_warnings():  # TensorPipe's own device-map exchange uses a deprecated group handle
            warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
            rpc.init_rpc(roles.rpc_name(env.rank), rank=env.rank, world_size=env.world_size, rpc_backend_options=opts)
        out.rpc_up = True
    except BaseException:
        out.shutdown(graceful=False)
        raise
    return out


GPU_KEY = "gpu/{rank}"
"""Where each rank posts the GPU it drives (in this attempt's store): ``host|uuid|device``, or empty for the CPU."""


def gpu_placement(store: dist.Store, env: LaunchEnv, device: torch.device, timeout_s: float) -> dict[int, str]:
    """rank -> "host|uuid|device" of the GPU each rank of the job drives ("" for a rank on the CPU), agreed through
    the job's store: two ranks drive one GPU when host and uuid agree, whatever CUDA_VISIBLE_DEVICES each saw."""
    import torch
    import torch.distributed as dist

    mine = ""
    if device.type == "cuda":
        uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or device)
        mine = f"{socket.gethostname()}|{uuid}|{device}"
    store.set(GPU_KEY.format(rank=env.rank), mine)
    keys = [GPU_KEY.format(rank=r) for r in range(env.world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except dist.DistStoreError as exc:
        raise TimeoutError(f"the ranks did not all post their device within {timeout_s:g} s") from exc
    return {r: store.get(k).decode() for r, k in enumerate(keys)}


def shared_gpus(placement: Mapping[int, str], ranks: Sequence[int]) -> list[tuple[int, int, str]]:
    """(first rank, other rank, device) for each rank of ``ranks`` that drives a GPU an earlier one of them drives."""
    first: dict[tuple[str, str], int] = {}
    out = []
    for r in sorted(ranks):
        host, _, rest = placement.get(r, "").partition("|")
        uuid, _, device = rest.partition("|")
        if not uuid:
            continue
        if (host, uuid) in first:
            out.append((first[(host, uuid)], r, f"{device} on {host}"))
        else:
            first[(host, uuid)] = r
    return out


def sharing_text(shared: Sequence[tuple[int, int, str]]) -> str:
    return "; ".join(f"ranks {a} and {b} share {where}" for a, b, where in shared)


def check_server_gpus(placement: Mapping[int, str], roles: RoleMap) -> None:
    """A server group on CUDA is FSDP2 over NCCL, which needs a GPU of its own for each rank: refuse, in one line,
    server ranks that would share one."""
    if len(roles.server_ranks) < 2:
        return
    shared = shared_gpus(placement, roles.server_ranks)
    if shared:
        raise ConfigError(
            f"invalid value for server.ranks: {len(roles.server_ranks)} server ranks on CUDA need a GPU each (FSDP2 "
            f"over NCCL), but {sharing_text(shared)}: run as many GPUs per node as server ranks, or the server "
            "group on the CPU (job.device=cpu)"
        )


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


def job_store(env: LaunchEnv, timeout: datetime.timedelta) -> dist.Store:
    """The key-value store every group and RPC of this attempt meets in, under a prefix of its own.

    torchrun (c10d rendezvous) keeps one TCPStore for the whole job and hands it to every restart of the workers, but
    ``env://`` puts no attempt in the keys: restarted workers would read the dead workers' addresses from the previous
    attempt and fail to connect. Under ``hosfl/<run id>/attempt-<n>/`` each attempt sees only its own keys.
    Without torchrun's agent store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, or RANK/WORLD_SIZE set by hand) rank 0
    hosts the store, listening where :func:`store_address` says (a TCPStore left to itself listens on every
    interface, as torchrun's stores do).
    """
    import torch.distributed as dist

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    host, bind = (env.master_addr, None) if agent else store_address(env)
    listen_fd = _listen(bind, int(env.master_port)) if bind is not None and env.rank == 0 else None
    try:
        base = dist.TCPStore(
            host,
            int(env.master_port),
            env.world_size,
            is_master=not agent and env.rank == 0,
            timeout=timeout,
            multi_tenant=True,
            master_listen_fd=listen_fd,
        )
    except BaseException:
        if listen_fd is not None:
            os.close(listen_fd)
        raise
    return dist.PrefixStore(f"hosfl/{env.run_id or 'job'}/attempt-{env.restart}", base)


LOOPBACK = "127.0.0.1"


def store_address(env: LaunchEnv) -> tuple[str, str | None]:
    """(the address every rank dials for rank 0's store, the one it listens on; None: every interface).

    One node: loopback for both, as gloo and TensorPipe with job.interface=auto. Across nodes every rank dials
    MASTER_ADDR: an address (torchrun's ``--local-addr`` on the head) is listened on alone; a host name on every
    interface, since the head may resolve its own name elsewhere than the other nodes do (Debian maps it to
    127.0.1.1)."""
    if env.local_world_size == env.world_size:
        return LOOPBACK, LOOPBACK
    try:
        ipaddress.ip_address(env.master_addr)
    except ValueError:
        return env.master_addr, None
    return env.master_addr, env.master_addr


def _listen(host: str, port: int) -> int:
    """A socket listening on the address ``host`` alone; its descriptor, which the store takes over."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"the job's store cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock.detach()


TOKEN_VARIABLE = "HOSFL_JOB_TOKEN"
"""The job's secret, when the launcher hands every rank one (launch/torchrun.sh and slurm/hosfl.sbatch make one)."""
MIN_TOKEN_CHARS = 32
TOKEN_KEY = "hosfl/token"


def launcher_secret(environ: Mapping[str, str] | None = None) -> str | None:
    """HOSFL_JOB_TOKEN, or None where it is unset or empty; one that is too short to be a secret is refused in one
    line that gives its length only."""
    value = (os.environ if environ is None else environ).get(TOKEN_VARIABLE, "")
    if value and len(value) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"{TOKEN_VARIABLE} has {len(value)} characters; a job token needs at least {MIN_TOKEN_CHARS} "
            "(e.g. `openssl rand -hex 32`), or leave it unset and the launcher or rank 0 makes one"
        )
    return value or None


def job_token(env: LaunchEnv, store: dist.Store, secret: str | None, timeout_s: float) -> str:
    """This attempt's token: HMAC-SHA256 of the job's secret and the attempt (so a process of an earlier attempt
    holds another token).

    The secret is the launcher's (``secret``, from HOSFL_JOB_TOKEN: it never crosses the network; Slurm carries the
    environment to the nodes itself); without one rank 0 makes a random one and hands it to the others through the
    job's store, whose readers (anyone who can reach its port: it has no authentication) learn it too. Rank 0
    always posts the key, empty when it has the launcher's secret, so that a rank whose node lacks or alone has
    HOSFL_JOB_TOKEN stops in one line instead of being refused at its first call.
    """
    import torch.distributed as dist

    if env.rank == 0:
        if secret is None:
            secret = secrets.token_hex(32)
            store.set(TOKEN_KEY, secret)
        else:
            store.set(TOKEN_KEY, "")
    else:
        try:
            store.wait([TOKEN_KEY], datetime.timedelta(seconds=timeout_s))
        except dist.DistStoreError as exc:
            raise TimeoutError(f"rank 0 did not post the job's token within {timeout_s:g} s") from exc
        posted = store.get(TOKEN_KEY).decode()
        if (secret is None) == (not posted):
            where = "rank 0's node but not on this one" if secret is None else "this node but not on rank 0's"
            raise ConfigError(f"{TOKEN_VARIABLE} is set on {where}: hand every node the same one, or none")
        secret = secret or posted
    attempt = f"hosfl/{env.run_id or 'job'}/attempt-{env.restart}"
    return hmac.new(secret.encode(), attempt.encode(), hashlib.sha256).hexdigest()


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
