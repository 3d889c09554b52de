"""Server group: θs sharded over ranks 0..S-1 with FSDP2 (``fully_shard``), rank 0 the RPC front.

Every server rank holds the same server object around its shard of θs (parameters, gradients and optimizer state
are split S ways: the memory that does not fit one device). Rank 0's endpoint announces each execution of a server
method to the other server ranks (:class:`CallBroadcast`, the endpoint's ``mirror``), which replay the same
executions in the same order (:func:`follow`), so the all-gathers and reduce-scatters of FSDP line up across the
group. A gathered call is announced once, with the whole round.

Every rank computes the round's forward/backward on the whole K-client batch, i.e. the algorithm's single server
step is unchanged. The FSDP gradient reduction then averages S identical gradients: for S a power of two, g/S
summed S times is exactly g, so a 2-rank server group gives bit-identical results to a 1-rank server (tested); for
other S it differs from g by float rounding (≤ a few ulp per step).
Splitting the batch over the group would divide the compute by S too, but needs per-rank loss weights inside the
algorithm's round when K is not a multiple of S.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hosfl_dist.core.digest import tensors_digest


def shard_server_model(model: nn.Module, group: dist.ProcessGroup, device: torch.device) -> nn.Module:
    """fully_shard each element of the model's ModuleLists (transformer layers, conv blocks), then the root."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device.type)
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                if any(p.requires_grad for p in block.parameters()):
                    fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_digest(model: nn.Module) -> str:
    """SHA-256 of the full (gathered) θs, equal to ``tensors_digest`` of an unsharded model. Collective."""
    return tensors_digest(p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters())


class CallBroadcast:
    """Rank 0's side: announce each server call (and each checkpoint save or load) to the other server ranks before
    executing it."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, method: str, kwargs: dict[str, Any]) -> None:
        self._send(("call", method, kwargs))

    def digest(self, model: nn.Module) -> str:
        self._send(("digest",))
        return full_digest(model)

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
        elif msg[0] == "save":  # DCP writes this rank's shard of θs; rank 0 writes the rest
            checkpointer.save(server, msg[1], {}, msg[2])
        elif msg[0] == "load":
            checkpointer.load(server, msg[1])
        else:
            _, method, kwargs = msg
            getattr(server, method)(**kwargs)  # the answers are rank 0's to send; here only the shard moves
