"""Object collectives among the server ranks, rank 0 of the group leading (the data-parallel round step).

Thin wrappers over ``torch.distributed``'s object collectives with the group's own rank numbering, so the algorithm
code says what moves (rows out, λ rows and losses back, the step decision out) and not how.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def dist_rank(group: dist.ProcessGroup) -> int:
    return dist.get_rank(group)


def dist_size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def scatter_from_lead(group: dist.ProcessGroup, items: list[Any] | None) -> Any:
    """Rank 0 gives item k to rank k (``items`` is None on the other ranks); returns this rank's item."""
    out: list[Any] = [None]
    dist.scatter_object_list(out, items if dist_rank(group) == 0 else None, group=group, group_src=0)
    return out[0]


def gather_to_lead(group: dist.ProcessGroup, item: Any) -> list[Any] | None:
    """Every rank's ``item``, in rank order, on rank 0 (None elsewhere)."""
    lead = dist_rank(group) == 0
    out: list[Any] | None = [None] * dist_size(group) if lead else None
    dist.gather_object(item, out, group=group, group_dst=0)
    return out


def broadcast_from_lead(group: dist.ProcessGroup, item: Any) -> Any:
    """Rank 0's ``item`` on every rank."""
    box = [item]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]
