"""An elastic run's dynamic RPC group: a server that client workers join and leave while it runs (``init_rpc``
without a world size, as :mod:`torch.distributed.rpc` supports for TensorPipe).

torch's own join (``init_rpc(world_size=None)``) tells every member it knows of that a new one arrived, and a member
that died without leaving (SIGKILL, a lost node) is still known: the next join fails on it and leaves the group's
join token taken, so no one can join again. Here workers only ever call the server: a joining worker tells only the
server and itself (:func:`join_rpc`) and every process leaves without telling anyone (:func:`leave_rpc`). What is
private torch here (the agent's constructor, ``_update_group_membership``, the membership token) is what
``init_rpc`` itself calls for a dynamic group. Ranks come from one counter in the server's store, so a worker that
comes back is a new member. Every member's agent sits behind its RPC gate (:mod:`.gate`, keyed by the run's token):
only holders of the token reach TensorPipe.
"""

from __future__ import annotations

import datetime
import logging
import socket

import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.rpc import TensorPipeAgent, api
from torch.distributed.rpc._utils import _group_membership_management, _update_group_membership

from hosfl_dist.runtime.process.gate import close_gate, open_gate
from hosfl_dist.runtime.process.groups import RPC_CHANNELS, RPC_TRANSPORTS

SERVER_NAME = "server"
RANK_KEY = "hosfl/elastic/next_rank"
CONNECT_S = 30.0
_PREFIX = "rpc_prefix_0"  # what init_rpc's first call names its store prefix

logger = logging.getLogger(__name__)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _options(timeout_s: float) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(rpc_timeout=timeout_s, num_worker_threads=32, _transports=RPC_TRANSPORTS,
                                           _channels=RPC_CHANNELS)  # fmt: skip


def serve_rpc(host: str, port: int, timeout_s: float, token: str) -> dist.TCPStore:
    """Start the store and the server's RPC agent (rank 0, named ``server``) of a dynamic group; returns the store."""
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
    store.add(RANK_KEY, 1)  # rank 0 is the server's
    _start(dist.PrefixStore(_PREFIX, store), SERVER_NAME, 0, timeout_s, token, tell=())
    return store


def join_rpc(
    host: str, port: int, timeout_s: float, token: str, connect_s: float = CONNECT_S
) -> tuple[dist.TCPStore, str]:
    """Join the server's dynamic group as a new member; returns the store and this process's RPC name."""
    # a server that is gone (its join.json left behind by SIGKILL) is said within half a minute, not an RPC timeout
    connect_s = max(1.0, min(timeout_s, connect_s))
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=connect_s))
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    rank = int(store.add(RANK_KEY, 1)) - 1
    name = f"rpc{rank}"
    _start(dist.PrefixStore(_PREFIX, store), name, rank, timeout_s, token, tell=(name, SERVER_NAME))
    return store, name


def _start(store: dist.Store, name: str, rank: int, timeout_s: float, token: str, tell: tuple[str, ...]) -> None:
    try:
        dist_autograd._init(rank)  # as init_rpc does before its agent
    except RuntimeError as exc:  # a worker rejoining a restarted server: its container is the first member's (the
        if "already initialized" not in str(exc):  # run uses no distributed autograd)
            raise
    with _group_membership_management(store, name, True):
        gated = open_gate(token, timeout_s).view(store)
        agent = TensorPipeAgent(gated, name, rank, None, _options(timeout_s), {}, [])
        api._init_rpc_states(agent)
        me = agent.get_worker_info()
        try:
            for target in tell:  # the server learns of the new member; nobody else needs to
                rpc.rpc_sync(target, _update_group_membership, args=(me, [], {}, True), timeout=timeout_s)
        except Exception:
            rpc.shutdown(graceful=False)
            raise


def leave_rpc() -> None:
    """Leave without telling the other members (a dead member among them would make a polite leave fail)."""
    try:
        rpc.shutdown(graceful=False)
    except Exception as exc:  # noqa: BLE001 - leaving is best effort
        logger.debug(f"rpc shutdown: {exc}")
    close_gate()
