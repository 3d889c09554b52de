"""Server group: θs sharded over ranks 0..S-1 with FSDP2 (``fully_shard``), rank 0 the RPC front.

Every server rank holds the same server object around its shard of θs (parameters, gradients and optimizer state
are split S ways: the memory that does not fit one device). Rank 0's endpoint announces each execution of a server
method to the other server ranks (:class:`CallBroadcast`, the endpoint's ``mirror``), which replay the same
executions in the same order (:func:`follow`), so the all-gathers and reduce-scatters of FSDP line up across the
group.

A server that declares ``data_parallel`` (HO-SFL) divides a round's work: the announcement of its gathered round
carries the round number only, rank 0 scatters each rank its share of the rows, and the server multiplies FSDP's
averaged gradient by S to get the sum of the shares (:mod:`hosfl_dist.algorithms.step`; exact for S a power of two,
gloo has no pre-multiplied sum to set a divide factor of 1). Other methods' calls are announced with their
arguments and every rank computes the whole call; the reduction then averages S identical gradients: for S a power of
two, g/S summed S times is exactly g, so their results equal a 1-rank server bit for bit; for other S they differ by
float rounding (≤ a few ulp per step).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hosfl_dist.core.digest import tensors_digest
from hosfl_dist.measure.tracker import process_memory


def shard_server_model(model: nn.Module, group: dist.ProcessGroup, device: torch.device) -> nn.Module:
    """fully_shard each element of the model's ModuleLists (transformer layers, conv blocks), then the root. Works on
    a meta-device model (its weights are materialised afterwards, shard by shard)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device.type)
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                if any(p.requires_grad for p in block.parameters()):
                    fully_shard(block, mesh=mesh)
    for name, module in list(model.named_modules()):
        if name.split(".")[-1] == "lm_head":  # its own group: gathered for its forward only, not kept unsharded
            fully_shard(module, mesh=mesh)  # with the root's parameters between forward and backward (V·D each)
    fully_shard(model, mesh=mesh)
    return model


def full_digest(model: nn.Module) -> str:
    """SHA-256 of the full (gathered) θs, equal to ``tensors_digest`` of an unsharded model. Collective."""
    return tensors_digest(p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters())


class CallBroadcast:
    """Rank 0's side: announce each server call (and each checkpoint save or load) to the other server ranks before
    executing it."""

    def __init__(self, group: dist.ProcessGroup, lean: tuple[str, ...] = ()) -> None:
        self.group = group
        self.lean = lean
        """Methods announced with the round number only (the server scatters their data itself)."""

    def __call__(self, method: str, kwargs: dict[str, Any]) -> None:
        self._send(("call", method, {"t": kwargs["t"]} if method in self.lean else kwargs))

    def digest(self, model: nn.Module) -> str:
        self._send(("digest",))
        return full_digest(model)

    def memory(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every server rank's :func:`~hosfl_dist.measure.tracker.process_memory` entry, rank 0's (``mine``) first."""
        self._send(("memory",))
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.gather_object(mine, out, group=self.group, group_dst=0)
        return out

    def save(self, loop: Any, meta: dict[str, Any]) -> None:
        self._send(("save", loop, meta))

    def load(self, path: str) -> None:
        self._send(("load", path))

    def stop(self) -> None:
        self._send(("stop",))

    def _send(self, msg: tuple) -> None:
        dist.broadcast_object_list([msg], group=self.group, group_src=0)


def follow(server: Any, group: dist.ProcessGroup, checkpointer: Any) -> None:
    """Server ranks 1..S-1: replay rank 0's calls on this rank's shard until rank 0 says stop."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, group=group, group_src=0)
        msg = box[0]
        if msg[0] == "stop":
            return
        if msg[0] == "digest":
            full_digest(server.model)
        elif msg[0] == "memory":
            entry = process_memory(dist.get_rank(), "server-shard", server.model)
            dist.gather_object(entry, None, group=group, group_dst=0)
        elif msg[0] == "save":  # DCP writes this rank's shard of θs; rank 0 writes the rest
            checkpointer.save(server, msg[1], {}, msg[2])
        elif msg[0] == "load":
            checkpointer.load(server, msg[1])
        else:
            _, method, kwargs = msg
            getattr(server, method)(**kwargs)  # the answers are rank 0's to send; here only the shard moves
