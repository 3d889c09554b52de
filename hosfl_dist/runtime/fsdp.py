"""Server group: θs sharded over ranks 0..S-1 with FSDP2 (``fully_shard``), rank 0 the RPC front.

Every server rank holds the same server object around its shard of θs (parameters, gradients and optimizer state
are split S ways: the memory that does not fit one device). How calls execute on the group is
:mod:`hosfl_dist.runtime.server_group`'s.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hosfl_dist.core.digest import tensors_digest


def shard_server_model(
    model: nn.Module, group: dist.ProcessGroup, device: torch.device, reshard_after_forward: bool = True
) -> nn.Module:
    """fully_shard each element of the model's ModuleLists (transformer layers, conv blocks), then the root. Works on
    a meta-device model (its weights are materialised afterwards, shard by shard). ``reshard_after_forward``
    (``server.reshard_after_forward``): whether a block's gathered weights are freed after its forward and gathered
    again for its backward, or kept in between."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device.type)
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                if any(p.requires_grad for p in block.parameters()):
                    fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    for name, module in list(model.named_modules()):
        if name.split(".")[-1] == "lm_head":  # its own group: not kept unsharded with the root's parameters between
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)  # forward and backward (V·D)
    fully_shard(model, mesh=mesh)
    return model


def full_digest(model: nn.Module) -> str:
    """SHA-256 of the full (gathered) θs, equal to ``tensors_digest`` of an unsharded model. Collective."""
    return tensors_digest(p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters())
