"""The live process groups and RPC agent of a torchrun process, and the job's key-value store.

:func:`init_distributed` limits glibc's malloc arenas, starts the default process group, the client-worker group
(the P-scalar all_reduce), the server group (FSDP) and RPC; :meth:`Distributed.shutdown` stops them again, gracefully
or not.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hosfl_dist.config import Config
from hosfl_dist.runtime.process.host import bind_interface, fix_mmap_threshold, limit_malloc_arenas
from hosfl_dist.runtime.process.launch import LaunchEnv, RoleMap

if TYPE_CHECKING:  # torch is imported where a process group is made: a bad config fails before that import
    import torch
    import torch.distributed as dist

SHUTDOWN_TIMEOUT_S = 30.0
"""Longest wait for the peers at the end of a job (a peer that is gone cannot hold the others forever)."""

RPC_TRANSPORTS = ["uv"]
"""TensorPipe transports: TCP through libuv, which sleeps in epoll while nothing arrives. TensorPipe's defaults add
"shm" (its first choice on one node) and "ibv", whose reactors poll in a busy loop: client workers waiting for the
server used 47-54 % of a core (0.19-0.22 CPU s per round) instead of 14-18 % (0.02-0.03 s), on a node whose cores
the server needed for the answer: on 2 cores a round of the previous version took 0.41 s, of this one 0.155 s
(results/scale/cpu_hygiene.md)."""
RPC_CHANNELS = ["cma", "basic"]
"""TensorPipe channels for the tensors: between processes of one node "cma" (one process_vm_readv copy; its thread
sleeps on a queue), else "basic" (in the transport's own messages). A 64 MiB round trip on loopback took 119 ms
with cma, 251 ms with basic alone, 1421 ms with TensorPipe's defaults (shm busy-polling on 2 cores). Every tensor is
staged to CPU before it crosses (:func:`~hosfl_dist.transport.rpc.to_wire`): no CUDA channel is needed."""


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
